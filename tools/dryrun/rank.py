"""One rank's world: its launch environment, a scratch folder, the fake world at the job's
size and torchtitan's Trainer config for it, built as training builds it (synthetic batch,
no tokenizer, checkpoint or metrics files) (`rank_world`); and the rank's measured entry of
the report (`rank_entry`). The pretraining step's and the post-training rounds' alike."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from parallel.memory import GIB
from tools.dryrun.fake_world import fake_world
from tools.dryrun.job import DryRunJob


def _synthetic_loader_config():
    """torchtitan's dataloader seam: batches shaped as titanscale's loader yields them
    ({"input", "positions"} and labels, [local batch, seq_len] int64), as constant fake
    tensors (their token counts are read with int(), as training reads real ones)."""
    import torch
    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchtitan.components.dataloader import BaseDataLoader

    class SyntheticLoader(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, *, seq_len: int, local_batch_size: int, **_: Any) -> None:
            self.seq_len, self.batch = seq_len, local_batch_size

        def __iter__(self):
            mode = active_fake_mode()
            assert mode is not None, "the dry run's loader runs under FakeTensorMode"

            def fake(t):
                return mode.fake_tensor_converter.from_real_tensor(mode, t, make_constant=True)

            while True:
                with unset_fake_temporarily():
                    tokens = torch.zeros(self.batch, self.seq_len, dtype=torch.int64)
                    positions = torch.arange(self.seq_len).repeat(self.batch, 1)
                    labels = tokens.clone()
                yield {"input": fake(tokens), "positions": fake(positions)}, fake(labels)

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    return SyntheticLoader.Config()


@dataclass
class _NoTokenizer:
    """torchtitan's tokenizer seam: the dry run reads no text."""

    @dataclass
    class Config:
        def build(self, **_: Any) -> None:
            return None


def _trainer_config(job: DryRunJob, caps, out_dir: str):
    """runtime.build's Trainer.Config for the job on the profile's GPU, then the dry run's
    few changes: eager (compile and async TP off; torchtitan captures no CUDA graph off a
    GPU), no checkpoint, validation, metrics files, tokenizer or data."""
    from kernels.registry import check_kernels
    from runtime.build import build_trainer_config
    from runtime.platform import Platform

    platform = Platform(caps.device_type, caps.name, caps.capability,
                        "nccl" if caps.is_cuda else "gloo")  # fmt: skip
    kernels = check_kernels(job.recipe, caps, cp=job.layout.cp)
    cfg = build_trainer_config(
        job.recipe, job.layout, platform=platform, kernels=kernels, tokenizer_path=out_dir
    )
    cfg.compile.enable = False
    cfg.compile.enable_async_tensor_parallel = False
    # disable_cuda_graphs stays as built: torchtitan runs the step eagerly off CUDA, and the
    # setting decides whether the step frees its gradients (zero_grad(set_to_none=...)).
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.metrics.enable_tensorboard = False
    cfg.metrics.enable_wandb = False
    if hasattr(cfg.metrics, "jsonl"):
        cfg.metrics.jsonl = False
    cfg.dump_folder = out_dir
    cfg.dataloader = _synthetic_loader_config()
    cfg.tokenizer = _NoTokenizer.Config()  # type: ignore[assignment]
    return cfg, kernels


@contextlib.contextmanager
def rank_world(job: Any, rank: int, boundary: Any) -> Iterator[tuple[Any, Any]]:
    """`rank`'s launch environment, a scratch output folder and the fake world at the job's
    size; yields torchtitan's config and the kernels for it, built inside (the FP8 / MXFP8
    converters check the emulated GPU when built). The pretraining step's and the
    post-training rounds' (tools.dryrun.posttrain) one entry."""
    from parallel.job_checks import planning_caps

    caps = planning_caps(job.cluster.gpu)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % job.cluster.gpus_per_node),
                      WORLD_SIZE=str(job.world_size))  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="dryrun-") as out_dir,
        fake_world(job.world_size, rank, caps, boundary),
    ):
        yield _trainer_config(job, caps, out_dir)


def rank_entry(job: Any, rank: int, pp_rank: int, stages: list[int], kernels: Any,
               figures: tuple[dict[str, float], dict[str, float]], peak_where: Any,
               comms: Any, posttrain: dict[str, Any] | None, built: float,
               t0: float) -> dict[str, Any]:  # fmt: skip
    """One rank's entry of the report (the pretraining step's and the post-training
    updates' alike, tools.dryrun.posttrain): `figures` = the memory tracker's (peak,
    current) read right after the step, its collectives by axis from `comms`, the build
    and total seconds since `t0`."""
    peak, after = figures
    return {
        "rank": rank,
        "world_size": job.world_size,
        "pp_rank": pp_rank,
        "stages": stages,
        "linear": kernels.linear,
        "attention": kernels.attention,
        "peak_gib": round(peak["total_gib"], 3),
        "peak": {k: round(v, 3) for k, v in peak.items()},
        "peak_where": peak_where,
        "after_step": {k: round(v, 3) for k, v in after.items()},
        "collectives": {
            f"{axis}.{kind}": {"count": int(c), "gib": round(b / GIB, 3)}
            for (axis, kind), (c, b) in sorted(comms.by_axis.items())
        },
        "posttrain": posttrain,
        "seconds": {"build": round(built, 1), "total": round(time.perf_counter() - t0, 1)},
    }
