"""SFT / LoRA on torchtitan's Trainer (finetune.mode = full | lora, no [[adapters]]).

TitanscaleTrainer extended at two seams: `train_step` scores the held-out set (exact match of
the answers, posttrain.evaluate) before the first step, every `finetune.eval_every` steps and
after the last step, writing `heldout` events to metrics.jsonl; after the last step the LoRA
adapter is exported in PEFT format (and the merged model on request). Every layout the Trainer
supports (FSDP, TP, PP excepted for the held-out score) trains; exports gather full tensors on
every rank and rank 0 writes them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torchtitan.tools.logging import logger

from data.chat import ChatRenderer, Example
from posttrain.evaluate import exact_match
from posttrain.lora import adapter_state, base_state, export_merged, export_peft
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
            f"({res['examples']} examples, token accuracy {res['token_accuracy']:.3f})"
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
        model = self.model_parts[0]
        folder = os.path.join(
            r.finetune.export_dir.replace("{output_dir}", r.output_dir), r.job.name
        )
        adapter = adapter_state(model)  # collectives under FSDP/TP: every rank calls
        base = base_state(model) if r.finetune.export_merged else None
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        cfg = self.config.model_spec.model
        if rank0:
            export_peft(folder, model_config=cfg, adapter=adapter,
                        state_dict_adapter=self.state_dict_adapter,
                        rank=r.lora.rank, alpha=r.lora.alpha)  # fmt: skip
            if base is not None:
                export_merged(os.path.join(folder, "merged"), base=base, adapter=adapter,
                              model_config=cfg, state_dict_adapter=self.state_dict_adapter,
                              scale=r.lora.alpha / r.lora.rank,
                              family=r.model.family)  # fmt: skip
            logger.info(f"exported adapter to {folder}")
        return folder
