"""Post-training entry: which runner a prepared job uses (train.py calls `run`).

- no [finetune] mode: pretraining, runtime.session.run as before;
- finetune.mode = full | lora, no [[adapters]]: torchtitan's Trainer with posttrain.trainer's
  held-out scoring and exports (every parallel layout);
- [[adapters]]: posttrain.adapters (several LoRA adapters on one frozen base; one process, or
  data parallel over torchrun's processes with the base FSDP-sharded).
"""

from __future__ import annotations

import os
from typing import Any

from recipe.loader import check_adapter_layout
from runtime import session


def check(job: session.Job) -> None:
    """Post-training checks that need the launch (world size); ConfigError before training."""
    if job.recipe.adapters:
        # The recipe's [parallel] was checked at load; this covers a layout the planner chose.
        check_adapter_layout(job.recipe, job.layout)
    elif job.recipe.finetune.mode == "lora":  # posttrain.trainer exports <export_dir>/<job>
        from posttrain.lora import check_adapter_export

        check_adapter_export(job.recipe, job.recipe.job.name)


def adapter_job(job: session.Job, mesh: Any = None) -> Any:
    """The AdapterJob of a prepared [[adapters]] recipe (`mesh`: the processes, or None)."""
    import torch

    from posttrain.adapters import AdapterJob

    r = job.recipe
    cfg = job.config.model_spec.model
    adapter_cls = job.config.model_spec.state_dict_adapter
    sda = adapter_cls(cfg, None) if adapter_cls is not None else None
    device = "cpu"
    if torch.cuda.is_available() and not job.platform.is_cpu:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return AdapterJob(r, cfg, tokenizer_path=job.tokenizer_path, state_dict_adapter=sda,
                      device=device, schedule=r.finetune.adapter_schedule, mesh=mesh,
                      microbatch_tokens=job.microbatch_tokens)  # fmt: skip


def run_adapters(job: session.Job) -> dict[str, Any]:
    """[[adapters]] on this launch: a process group and a 1-D mesh when there are several
    processes or checkpoints are written asynchronously (gloo on CPU, NCCL on CUDA), torn
    down at the end."""
    import torch

    job.platform.apply()
    dist = torch.distributed
    need = job.world_size > 1 or job.recipe.checkpoint.async_mode != "disabled"
    own = need and not dist.is_initialized()
    if not job.platform.is_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # NCCL binds to it
    if own:
        dist.init_process_group(backend=job.platform.backend)
    try:
        mesh = None
        if job.world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(
                job.platform.device_type, (job.world_size,), mesh_dim_names=("dp_shard",)
            )
        return adapter_job(job, mesh).train()
    finally:
        if own and dist.is_initialized():
            dist.destroy_process_group()


def run(job: session.Job) -> dict[str, Any] | None:
    r = job.recipe
    if r.finetune.mode == "off":
        return session.run(job)
    check(job)
    if r.adapters:
        return run_adapters(job)
    from data.chat import make_renderer
    from posttrain.evaluate import load_examples
    from posttrain.trainer import SFTTrainer

    cfg = job.config.model_spec.model
    adapter_cls = job.config.model_spec.state_dict_adapter
    sda = adapter_cls(cfg, None) if adapter_cls is not None else None

    renderer = make_renderer(job.tokenizer_path, r.data.chat_template)
    heldout = load_examples(r.data.eval_source) if r.data.eval_source else []
    return session.run(job, SFTTrainer, recipe=r, renderer=renderer, heldout=heldout,
                       state_dict_adapter=sda)  # fmt: skip
