"""Post-training entry: which runner a prepared job uses (train.py calls `run`).

- no [finetune] mode: pretraining, runtime.session.run as before;
- finetune.mode = full | lora, no [[adapters]]: torchtitan's Trainer with posttrain.trainer's
  held-out scoring and exports (every parallel layout);
- [[adapters]]: posttrain.adapters (several LoRA adapters on one frozen base, one process).
"""

from __future__ import annotations

from typing import Any

from core.errors import ConfigError
from runtime import session


def check(job: session.Job) -> None:
    """Post-training checks that need the launch (world size); ConfigError before training."""
    r = job.recipe
    if r.adapters and job.world_size != 1:
        raise ConfigError(
            f"[[adapters]] train in one process; this launch has {job.world_size}",
            file=r.source,
            key="adapters",
        )


def run(job: session.Job) -> dict[str, Any] | None:
    r = job.recipe
    if r.finetune.mode == "off":
        return session.run(job)
    check(job)
    from data.chat import make_renderer
    from posttrain.evaluate import load_examples

    cfg = job.config.model_spec.model
    adapter_cls = job.config.model_spec.state_dict_adapter
    sda = adapter_cls(cfg, None) if adapter_cls is not None else None
    if r.finetune.export_merged and getattr(r.model, "family", "llama3") != "llama3":
        # posttrain.lora.llama_hf_config writes a Llama config.json; other families' merged
        # folders come from [checkpoint] export_hf after a merge (not wired yet).
        raise ConfigError(
            "export_merged writes Llama folders only; use family llama3 or turn it off",
            file=r.source,
            key="finetune.export_merged",
        )
    if r.adapters:
        import torch

        from posttrain.adapters import AdapterJob

        job.platform.apply()
        device = "cuda" if torch.cuda.is_available() and not job.platform.is_cpu else "cpu"
        aj = AdapterJob(r, cfg, tokenizer_path=job.tokenizer_path, state_dict_adapter=sda,
                        device=device, schedule=r.finetune.adapter_schedule)  # fmt: skip
        return aj.train()
    from posttrain.trainer import SFTTrainer

    renderer = make_renderer(job.tokenizer_path, r.data.chat_template)
    heldout = load_examples(r.data.eval_source) if r.data.eval_source else []
    return session.run(job, SFTTrainer, recipe=r, renderer=renderer, heldout=heldout,
                       state_dict_adapter=sda)  # fmt: skip
