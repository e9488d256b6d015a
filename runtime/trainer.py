"""torchtitan's Trainer, extended at its seams (no copied training loop).

- `batch_generator`: also counts useful tokens (labels != IGNORE_INDEX) for the report.
- `init_distributed`: builds the device mesh from a planned rank order when one is given
  (`rank_order`, see parallel.mesh), else torchtitan's plain order.
- `should_continue_training` (launch.stop_request.StopOnRequest): checkpoints and stops when
  the Slurm job script asks (time limit near), so the requeued job resumes there.
- `train`: writes a `start` event (resumed step, restart count) and, at the end, the
  steady-state summary.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

from data.accounting import attention_pairs
from launch.stop_request import StopOnRequest
from runtime.metrics import TitanscaleMetrics


class TitanscaleTrainer(StopOnRequest, Trainer):
    # Set before construction by runtime.session when a placement is planned; a list mapping
    # mesh position (row-major over MESH_ORDER) -> global rank. None = plain rank order.
    rank_order: list[int] | None = None
    summary: dict[str, Any] | None = None

    def init_distributed(self) -> ParallelDims:
        if self.rank_order is None:
            return super().init_distributed()
        from parallel.mesh import make_parallel_dims
        from torchtitan.distributed import utils as dist_utils

        world_size = dist_utils.init_distributed(
            self.config.comm,
            enable_cpu_backend=self.config.training.enable_cpu_offload,
            base_folder=self.config.dump_folder,
        )
        return make_parallel_dims(self.config.parallelism, world_size, self.rank_order)

    def batch_generator(
        self, data_iterable: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        metrics = self.metrics_processor
        assert isinstance(metrics, TitanscaleMetrics)
        # First call happens inside the first train_step of this process, after any
        # checkpoint load: self.step is already the step being run.
        resumed_from = self.step - 1
        metrics.last_logged_step = resumed_from
        metrics.start_step = resumed_from
        metrics.write_event(
            "start",
            resumed_from_step=resumed_from,
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            world_size=self.parallel_dims.world_size,
            layout={
                "pp": self.parallel_dims.pp,
                "dp_replicate": self.parallel_dims.dp_replicate,
                "dp_shard": self.parallel_dims.dp_shard,
                "cp": self.parallel_dims.cp,
                "tp": self.parallel_dims.tp,
            },
            wall=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )
        for input_dict, labels in super().batch_generator(data_iterable):
            # labels stay on CPU here; counting them costs no device sync.
            metrics.useful_ntokens_since_last_log += int((labels != IGNORE_INDEX).sum())
            if "positions" in input_dict:
                metrics.doc_attn_pairs_since_last_log += attention_pairs(
                    input_dict["positions"]
                ).doc_causal
            yield input_dict, labels

    def train(self) -> None:
        super().train()
        metrics = self.metrics_processor
        assert isinstance(metrics, TitanscaleMetrics)
        stats = getattr(self.dataloader, "packing_stats", None)
        metrics.data_stats = stats() if stats else None
        self.summary = metrics.finish()
