"""SFT / LoRA on torchtitan's Trainer (finetune.mode = full | lora, no [[adapters]]).

TitanscaleTrainer extended at two seams: `train_step` scores the held-out set (exact match of
the answers, posttrain.evaluate) before the first step, every `finetune.eval_every` steps and
after the last step, writing `heldout` events to metrics.jsonl; after the last step the LoRA
adapter is exported in PEFT format (and the merged model on request). Every layout the Trainer
supports (FSDP, TP, PP excepted for the held-out score) trains; exports gather full tensors on
every rank and rank 0 writes them.
"""

from __future__ import annotations

import time
from typing import Any

from torchtitan.tools.logging import logger

from data.chat import ChatRenderer, Example
from posttrain.evaluate import exact_match
from posttrain.lora import export_adapter
from recipe.schema import Recipe
from runtime.metrics import TitanscaleMetrics
from runtime.trainer import TitanscaleTrainer


class SFTTrainer(TitanscaleTrainer):
    def __init__(
        self,
        config: Any,
        *,
        recipe: Recipe,
        renderer: ChatRenderer | None = None,
        heldout: list[Example] | None = None,
        state_dict_adapter: Any = None,
        **kwargs: Any,
    ) -> None:
        self.recipe = recipe
        self.renderer = renderer
        self.heldout_examples = heldout or []
        self.state_dict_adapter = state_dict_adapter
        self.heldout_history: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()
        super().__init__(config, **kwargs)

    def _heldout(self, step: int) -> None:
        if not self.heldout_examples or self.renderer is None or len(self.model_parts) != 1:
            return
        t0 = time.perf_counter()
        res = exact_match(
            self.model_parts[0],
            self.renderer,
            self.heldout_examples,
            device=self.device,
            pad_id=0,
        )
        rec = {"step": step, **res, "eval_s": time.perf_counter() - t0,
               "wall_s": time.perf_counter() - self._t0}  # fmt: skip
        self.heldout_history.append(rec)
        metrics = self.metrics_processor
        assert isinstance(metrics, TitanscaleMetrics)
        metrics.write_event("heldout", **rec)
        logger.info(
            f"held-out exact match at step {step}: {res['exact_match']:.3f} "
            f"({res['examples']} examples, token accuracy {res['token_accuracy']:.3f}, "
            f"loss {res['nll_per_trained_token']:.4f})"
        )

    def train_step(self, data_iterator: Any) -> None:
        if not self.heldout_history:
            self._heldout(self.step - 1)
        super().train_step(data_iterator)
        every = self.recipe.finetune.eval_every
        last = self.step >= self.config.training.steps
        if last or (every and self.step % every == 0):
            self._heldout(self.step)
        if last:
            self.export()

    def export(self) -> str | None:
        """PEFT adapter (lora mode) and/or merged HF folder under finetune.export_dir."""
        r = self.recipe
        if r.finetune.mode != "lora" or self.state_dict_adapter is None:
            return None
        folder = export_adapter(self.model_parts[0], r, r.job.name,
                                model_config=self.config.model_spec.model,
                                state_dict_adapter=self.state_dict_adapter,
                                tokenizer_dir=self.config.hf_assets_path)  # fmt: skip
        logger.info(f"exported adapter to {folder}")
        return folder
