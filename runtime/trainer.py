"""torchtitan's Trainer, extended at its seams (no copied training loop).

- `batch_generator`: also counts useful tokens (labels != IGNORE_INDEX) for the report.
- `init_distributed`: builds the device mesh (from a planned rank order when one is given,
  see parallel.mesh) and runs the startup placement check (runtime.startup).
- `should_continue_training` (launch.stop_request.StopOnRequest): checkpoints and stops when
  the Slurm job script asks (time limit near), so the requeued job resumes there.
- `train`: writes a `start` event (resumed step, restart count) and, at the end, the
  steady-state summary; runs the step watchdog (runtime.watchdog) around the loop. One
  process skips the loop's closing 2 s sleep "for other ranks to complete" (there are none:
  `without_exit_sleep`).
- `train_step`: marks step begin/end for the watchdog; a collective timeout becomes a
  `RankTimeoutError` naming the rank that stopped answering and its groups. After the step's
  batches are fetched: the `batch` fault seam and, on logged steps, this rank's arrival for
  straggler detection (runtime.stragglers).
- `forward_backward_step`: the mid-step fault-injection seam (runtime.faults, tests only),
  and SFT's per-example weights: a step whose groups carry weights (data.loader) divides by
  the step's global weight sum instead of its trained-token count, and
  `_forward_backward_body` hands the microbatch's per-token weights to the loss
  (runtime.loss; docs/sft.md, "Per-example weights"). Steps without them run torchtitan's
  path untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

from core.launch_env import launch_env
from data.accounting import attention_pairs
from data.packing import LOSS_WEIGHT_DELTA, LOSS_WEIGHTS
from launch.stop_request import StopOnRequest
from parallel.fabric import Fabric
from runtime import faults
from runtime.metrics import TitanscaleMetrics
from runtime.stragglers import Arrivals
from runtime.watchdog import StepWatchdog, default_store, watched_step

EXIT_SLEEP_S = 2  # torchtitan/trainer.py, end of Trainer.train: `time.sleep(2)` on rank 0


class _TimeWithoutExitSleep:
    """The `time` module, except that torchtitan's closing sleep returns at once."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        if seconds != EXIT_SLEEP_S:
            time.sleep(seconds)


@contextmanager
def without_exit_sleep(world_size: int) -> Iterator[None]:
    """torchtitan's Trainer.train ends with rank 0 sleeping 2 s "for other ranks to complete".
    A one-process run has no other rank: the sleep was 2 s of every `python train.py` and of
    the ~60 single-process runs of the test suite. For the loop's duration the trainer
    module's `time` is a proxy whose sleep(2) returns at once (the module reads `time` only
    for that sleep and perf_counter). Several ranks keep it: rank 0 may host the store the
    others still read. tests/unit/test_trainer_exit_sleep.py checks torchtitan still has the
    statement and that one process skips it."""
    import torchtitan.trainer as tt

    if world_size > 1 or tt.time is not time:
        yield
        return
    tt.time = _TimeWithoutExitSleep()  # type: ignore[assignment]
    try:
        yield
    finally:
        tt.time = time


class TitanscaleTrainer(StopOnRequest, Trainer):
    summary: dict[str, Any] | None = None
    watchdog: StepWatchdog | None = None
    # This step's sum of loss-weight deltas (data.packing.group_weight_delta) over the
    # batches fetched so far; None while the step has no weighted group.
    _weight_delta: float | None = None

    def __init__(
        self,
        config: Trainer.Config,
        *,
        rank_order: list[int] | None = None,
        fabric: Fabric | None = None,
    ) -> None:
        # rank_order: mesh position (row-major over MESH_ORDER) -> global rank; None = plain
        # rank order, which is the planned order when the launcher assigned node ranks in
        # topology order (tools.launch). fabric: the cluster's hosts/switches, if known.
        self.rank_order = rank_order
        self.fabric = fabric
        super().__init__(config)

    def init_distributed(self) -> ParallelDims:
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.tools.logging import logger

        from parallel.mesh import make_parallel_dims
        from runtime.startup import startup_check

        world_size = dist_utils.init_distributed(
            self.config.comm,
            enable_cpu_backend=self.config.training.enable_cpu_offload,
            base_folder=self.config.dump_folder,
        )
        pd = make_parallel_dims(self.config.parallelism, world_size, self.rank_order)
        pd.build_mesh()
        # One all_gather_object at start-up: every rank's host, NVLink domain and switch
        # path; a tp/cp group spanning NVLink domains stops here, naming group and hosts.
        summary = startup_check(pd, self.fabric)
        if torch.distributed.get_rank() == 0:
            logger.info("placement:\n" + summary)
        return pd

    def batch_generator(
        self, data_iterable: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        metrics = self.metrics_processor
        assert isinstance(metrics, TitanscaleMetrics)
        # First call happens inside the first train_step of this process, after any
        # checkpoint load: self.step is already the step being run.
        pd = self.parallel_dims
        layout = {"pp": pd.pp, "dp_replicate": pd.dp_replicate, "dp_shard": pd.dp_shard,
                  "cp": pd.cp, "tp": pd.tp}  # fmt: skip
        metrics.start(self.step - 1, layout=layout)
        for input_dict, labels in super().batch_generator(data_iterable):
            delta = input_dict.pop(LOSS_WEIGHT_DELTA, None)
            if delta is not None:
                # Per row: its group's delta; this rank's rows cover each group once.
                self._weight_delta = (self._weight_delta or 0.0) + float(delta.sum())
            # labels stay on CPU here; counting them costs no device sync.
            metrics.useful_ntokens_since_last_log += int((labels != IGNORE_INDEX).sum())
            if "positions" in input_dict:
                metrics.doc_attn_pairs_since_last_log += attention_pairs(
                    input_dict["positions"]
                ).doc_causal
            yield input_dict, labels

    def _start_watchdog(self) -> StepWatchdog:
        groups = {
            name: [int(r) for r in mesh.mesh.flatten().tolist()]
            for name, mesh in self.parallel_dims.get_all_one_dimensional_meshes().items()
        }
        return StepWatchdog(
            rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
            world_size=self.parallel_dims.world_size,
            timeout_s=self.config.comm.train_timeout_seconds,
            first_timeout_s=self.config.comm.init_timeout_seconds,
            groups=groups,
            store=default_store(),
            attempt=launch_env().restart_count,
        ).start()

    def _arrival_marked(self, data_iterator: Iterator[Any]) -> Iterator[Any]:
        """The step's batches; after the last one (just before the step's first collective)
        the `batch` fault seam, then this rank's arrival on logged steps
        (runtime.stragglers)."""
        metrics = self.metrics_processor
        assert isinstance(metrics, TitanscaleMetrics)
        n = self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches
        step = self.step
        for i in range(n):
            item = next(data_iterator)
            if i == n - 1:
                faults.inject("batch", step)
                if metrics.arrivals is not None and metrics.should_log(step):
                    metrics.arrivals.publish(step)
            yield item

    def train_step(self, data_iterator) -> None:
        # torchtitan fetches all of a step's microbatches before the first forward, so by
        # then batch_generator has summed the whole step's weight delta.
        self._weight_delta = None
        data_iterator = self._arrival_marked(data_iterator)
        wd = self.watchdog
        if wd is None:
            return super().train_step(data_iterator)
        # e.g. DataloaderExhaustedError passes through (torchtitan's loop handles it).
        with watched_step(wd, self.step, self.parallel_dims.world_size):
            super().train_step(data_iterator)

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        faults.inject("step", self.step)
        gvt = kwargs["global_valid_tokens"]
        if self._weight_delta is not None:
            # Weighted step: normalizer = sum_t w_t over the step's trained tokens on every
            # rank = the global trained-token count (already all-reduced by torchtitan)
            # + the step's weight delta (the same on every rank).
            self._check_weighted()
            # In float64: sum(w - 1) cancels most of the count when weights are small, and a
            # float32 sum would keep too few bits of what is left (data.loader.WEIGHT_RANGE).
            gvt = (gvt.to(torch.float64) + self._weight_delta).to(torch.float32)
        # A step without a trained token (an SFT step of weight-0 / prompt-only examples)
        # divides its zero loss by 1, not 0 (torchtitan would stop on the NaN); any count
        # >= 1 is unchanged, so the unweighted loss stays bit-identical.
        kwargs["global_valid_tokens"] = torch.where(gvt > 0, gvt, torch.ones_like(gvt))
        return super().forward_backward_step(**kwargs)

    def _check_weighted(self) -> None:
        """Layouts whose loss path cannot carry per-token weights: refused by name."""
        pd = self.parallel_dims
        why = (
            "pipeline parallelism (pp > 1)"
            if pd.pp_enabled
            else "context parallelism (cp > 1)"
            if pd.cp_enabled
            else "CUDA graphs (set training.cuda_graphs = 'off')"
            if not self.config.training.disable_cuda_graphs
            else ""
        )
        if why:
            from core.errors import ConfigError

            raise ConfigError(
                f"SFT records with a weight other than 0 or 1 are not supported with {why}",
                key="data.source",
            )

    def _forward_backward_body(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor,
        extra_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        weights = extra_kwargs.pop(LOSS_WEIGHTS, None)
        if weights is None:
            return super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)
        from runtime.loss import WeightedChunkedLoss

        if not isinstance(self.loss_fn, WeightedChunkedLoss):
            raise TypeError(f"per-token SFT weights need runtime.loss, not {type(self.loss_fn)}")
        with self.loss_fn.token_weights(weights):
            return super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)

    def train(self) -> None:
        self.watchdog = self._start_watchdog()
        metrics = self.metrics_processor
        assert isinstance(metrics, TitanscaleMetrics)
        if metrics.stragglers.ratio > 0 and self.parallel_dims.world_size > 1:
            metrics.arrivals = Arrivals(
                default_store(),
                rank=torch.distributed.get_rank(),
                world_size=self.parallel_dims.world_size,
                attempt=launch_env().restart_count,
                log_every=self.config.metrics.log_freq,
            )
        try:
            with without_exit_sleep(self.parallel_dims.world_size):
                super().train()
        finally:
            self.watchdog.stop()
        metrics = self.metrics_processor
        assert isinstance(metrics, TitanscaleMetrics)
        stats = getattr(self.dataloader, "packing_stats", None)
        metrics.data_stats = stats() if stats else None
        self.summary = metrics.finish()
