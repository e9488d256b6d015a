"""The throughput report: torchtitan's MetricsProcessor, with honest, unit-named metrics.

Definitions (per logged interval of `n` steps lasting `dt` seconds, on the rank that sees
the loss):
- tokens_per_sec_per_gpu = tokens this data-parallel rank consumed / (dt x pp x cp x tp):
  all tokens of the global batch divided by all devices, padding included (torchtitan's tps).
- useful_tokens_per_sec_per_gpu: the same for tokens whose label is not IGNORE_INDEX.
- tokens_per_sec_per_node = tokens_per_sec_per_gpu x processes per node.
- tflops_per_gpu = flops_per_token (torchtitan's count: 6N + 12 L H Q T) x tokens/s/gpu.
- mfu_doc_masked_pct: the same with attention FLOPs counted only for the (query, key) pairs
  the document mask keeps (labelled; torchtitan's count charges every row's full L x L).
- mfu_pct = tflops_per_gpu / the dense BF16 peak of this GPU, whatever the linears' precision
  (core.hardware; torchtitan's and Megatron's convention); null on CPU or an unknown GPU
  ("n/a" on the console). mfu_at_precision_peak_pct: the same against the peak of the linears'
  precision (FP8/MXFP8: twice BF16's on Hopper/Blackwell); equal to mfu_pct for BF16.
The summary's median excludes the first `summary_skip_steps` steps (compile, allocator and
collective warmup), and reports p10 / p90 next to it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torchtitan.components.metrics import MetricsProcessor, _get_metrics_rank
from torchtitan.tools.logging import logger

from core.atomic import write_text_atomic
from core.hardware import peak_flops
from core.jsonio import loads_line
from core.launch_env import launch_env
from core.models import model_shape
from data.accounting import doc_masked_flops
from runtime.stragglers import Arrivals, StragglerDetector


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    records: list[dict[str, Any]], skip_steps: int, start_step: int = 0
) -> dict[str, Any]:
    """Steady-state summary of logged step records.

    The first `skip_steps` steps run by this process (after `start_step`, the step it resumed
    from) are warmup and excluded: a resumed run warms up again.
    """
    steady = [r for r in records if r.get("first_step", r["step"]) > start_step + skip_steps]
    out: dict[str, Any] = {
        "steps_logged": len(records),
        "steps_in_summary": len(steady),
        "warmup_steps_excluded": skip_steps,
    }
    if not steady:
        out["note"] = "no steps after warmup; run more steps than metrics.summary_skip_steps"
        return out
    for key in (
        "tokens_per_sec_per_gpu",
        "useful_tokens_per_sec_per_gpu",
        "tokens_per_sec_per_node",
        "tflops_per_gpu",
        "step_time_s",
    ):
        vals = [r[key] for r in steady if r.get(key) is not None]
        if vals:
            out[f"median_{key}"] = statistics.median(vals)
            out[f"p10_{key}"] = percentile(vals, 10)
            out[f"p90_{key}"] = percentile(vals, 90)
    for key in ("mfu_pct", "mfu_at_precision_peak_pct", "mfu_doc_masked_pct"):
        vals = [r[key] for r in steady if r.get(key) is not None]
        out[f"median_{key}"] = statistics.median(vals) if vals else None
    out["peak_memory_gib"] = max(r["memory_gib"] for r in records)
    out["final_loss"] = records[-1]["loss"]
    return out


def moe_figures(model_parts: list[torch.nn.Module] | None) -> dict[str, Any]:
    """The last step's per-layer expert load (runtime.moe_metrics); {} for dense models."""
    from runtime.moe_metrics import EXPERT_LOAD_ATTR, expert_load_figures

    loads: list[torch.Tensor] = [
        x for p in model_parts or () if (x := getattr(p, EXPERT_LOAD_ATTR, None)) is not None
    ]
    return expert_load_figures(torch.cat(loads)) if loads else {}


class TitanscaleMetrics(MetricsProcessor):
    """MetricsProcessor with useful-token accounting, per-node figures, JSONL and a summary."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl: bool = True
        """Write metrics.jsonl (one flushed JSON object per logged step)."""

        summary_skip_steps: int = 2
        """Steps excluded from the steady-state summary."""

        precision: str = "bf16"
        """Precision of the linear layers, selecting the peak for MFU (bf16/fp8/mxfp8)."""

        device_name: str = "cpu"
        """Device name for the peak-FLOPs table."""

        flavor: str = "debugmodel"
        """Model flavor, for the document-masked FLOP count."""

        family: str = "llama3"
        """Model family of `flavor`."""

        n_layers: int = 0
        """Layers actually built (model.layers); 0 = the flavor's."""

        wandb_project: str = "titanscale"
        """W&B project (with enable_wandb)."""

        wandb_entity: str = ""
        """W&B entity; '' = the account's default."""

        wandb_run_name: str = ""
        """W&B run name."""

        straggler_ratio: float = 1.5
        """runtime.stragglers: own step time over the others' median that names a rank."""

        straggler_steps: int = 3
        """Consecutive logged steps over the ratio before a rank is named."""

    # Re-declared from the base class: mypy cannot infer them through torchtitan's slots.
    time_last_log: float
    ntokens_since_last_log: int

    def __init__(self, config: Config, **kwargs: Any):
        if config.enable_wandb:
            _wandb_env(config, kwargs)
        super().__init__(config, **kwargs)
        self.tconfig = config
        self.useful_ntokens_since_last_log = 0
        # (query, key) pairs the document mask keeps, summed over this interval's batches.
        self.doc_attn_pairs_since_last_log = 0
        shape = model_shape(config.flavor, config.family)
        self.shape = replace(shape, n_layers=config.n_layers or shape.n_layers)
        self.data_stats: dict[str, Any] | None = None
        self.last_logged_step = 0
        self.start_step = 0
        self.records: list[dict[str, Any]] = []
        # MFU is against the BF16 peak (see module docstring); precision_peak beside it.
        self.peak = peak_flops(config.device_name, "bf16")
        self.precision_peak = peak_flops(config.device_name, config.precision)
        self.procs_per_node = launch_env().local_world_size
        dump_folder = kwargs.get("dump_folder", "./outputs")
        self.is_metrics_rank = (
            not torch.distributed.is_initialized()
            or torch.distributed.get_rank()
            == _get_metrics_rank(
                parallel_dims=kwargs["parallel_dims"],
                pp_schedule=kwargs.get("pp_schedule", "1F1B"),
            )
        )
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
        self.summary_path = os.path.join(dump_folder, "summary.json")
        self._jsonl = JsonlLog(self.jsonl_path) if config.jsonl and self.is_metrics_rank else None
        # Set by the trainer once the process group exists (runtime.stragglers).
        self.arrivals: Arrivals | None = None
        self.stragglers = StragglerDetector(config.straggler_ratio, config.straggler_steps)

    def write_event(self, event: str, **fields: Any) -> None:
        if self._jsonl is not None:
            self._jsonl.event(event, **fields)

    def start(self, resumed_from_step: int, **fields: Any) -> None:
        """This process starts after step `resumed_from_step` (0: fresh): the `start` event
        (read_trajectory drops the steps a restart replays) and the summary's warmup origin."""
        self.last_logged_step = self.start_step = resumed_from_step
        env = launch_env()
        self.write_event("start", resumed_from_step=resumed_from_step,
                         restart_count=env.restart_count,
                         slurm_restart_count=env.slurm_restart_count,
                         world_size=self.parallel_dims.world_size,
                         wall=time.strftime("%Y-%m-%dT%H:%M:%S"), **fields)  # fmt: skip

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        now = time.perf_counter()
        dt = now - self.time_last_log
        nsteps = max(step - self.last_logged_step, 1)
        non_dp = self.parallel_dims.non_data_parallel_size
        tps = self.ntokens_since_last_log / (dt * non_dp)
        useful_tps = self.useful_ntokens_since_last_log / (dt * non_dp)
        tflops = self.num_flops_per_token * tps / 1e12
        mfu = 100 * tflops * 1e12 / self.peak if self.peak else None
        mfu_prec = 100 * tflops * 1e12 / self.precision_peak if self.precision_peak else None
        # Second, clearly labelled variant: attention FLOPs only for the pairs the document
        # mask keeps (torchtitan's count charges the full L x L score matrix per row).
        tflops_doc = (
            doc_masked_flops(
                self.shape, self.ntokens_since_last_log, self.doc_attn_pairs_since_last_log
            )
            / (dt * non_dp)
            / 1e12
        )
        mfu_doc = 100 * tflops_doc * 1e12 / self.peak if self.peak else None
        mem = self.device_memory_monitor.get_peak_stats()
        data_s = sum(self.data_loading_times)
        rec: dict[str, Any] = {
            "step": step,
            "first_step": self.last_logged_step + 1,
            "loss": global_avg_loss,
            "max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "tokens_per_sec_per_gpu": tps,
            "useful_tokens_per_sec_per_gpu": useful_tps,
            "tokens_per_sec_per_node": tps * self.procs_per_node,
            "tflops_per_gpu": tflops,
            "mfu_pct": mfu,
            "mfu_at_precision_peak_pct": mfu_prec,
            "tflops_doc_masked_per_gpu": tflops_doc,
            "mfu_doc_masked_pct": mfu_doc,
            "memory_gib": mem.max_reserved_gib,
            "step_time_s": dt / nsteps,
            "data_loading_pct": 100 * data_s / dt if dt > 0 else 0.0,
            "padding_pct": (
                100 * (1 - self.useful_ntokens_since_last_log / self.ntokens_since_last_log)
                if self.ntokens_since_last_log
                else 0.0
            ),
        }
        if extra_metrics:
            rec.update({k: v for k, v in extra_metrics.items() if isinstance(v, (int, float))})
        if self.is_metrics_rank and self.arrivals is not None:
            rec.update(self._stragglers(step, rec["step_time_s"]))
        rec.update(moe_figures(getattr(self, "model_parts", None)))
        self.records.append(rec)
        if self._jsonl is not None:
            self._jsonl.write(rec)
        self.logger.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step)
        mfu_s = f"{mfu:.1f}%" if mfu is not None else "n/a"
        if self.is_metrics_rank:
            logger.info(
                f"step {step:4d}  loss {global_avg_loss:8.5f}  "
                f"tok/s/gpu {tps:,.0f} (useful {useful_tps:,.0f})  "
                f"tok/s/node {tps * self.procs_per_node:,.0f}  "
                f"tflops/gpu {tflops:,.3f}  mfu {mfu_s}  mem {mem.max_reserved_gib:.2f}GiB"
            )
        self.ntokens_since_last_log = 0
        self.useful_ntokens_since_last_log = 0
        self.doc_attn_pairs_since_last_log = 0
        self.data_loading_times.clear()
        self.last_logged_step = step
        self.device_memory_monitor.reset_peak_stats()
        self.time_last_log = time.perf_counter()

    def _stragglers(self, step: int, step_time_s: float) -> dict[str, Any]:
        assert self.arrivals is not None
        fields = self.stragglers.observe(self.arrivals.read(step), step_time_s)
        if fields.get("straggler_rank", -1) >= 0:
            logger.warning(
                f"straggler: rank {fields['straggler_rank']} took "
                f"{fields['slowest_rank_ratio']:.2f}x the other ranks' median step time for "
                f"{self.stragglers.steps}+ logged steps (step {step}; it arrives "
                f"{fields['slowest_rank_lateness_s']:.3f} s after the median rank)"
            )
        return fields

    def log_validation(
        self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None
    ) -> None:
        """torchtitan's validator result (mean loss per valid token over all data-parallel
        ranks): a `validation` event in metrics.jsonl and validation/* in TensorBoard/W&B."""
        ppl = math.exp(loss) if loss < 700 else math.inf
        rec = {"step": step, "val_loss": loss, "val_perplexity": ppl}
        self.write_event("validation", **rec)
        self.logger.log({"validation/loss": loss, "validation/perplexity": ppl}, step)
        if self.is_metrics_rank:
            logger.info(f"validation step {step:4d}  loss {loss:8.5f}  perplexity {ppl:,.3f}")

    def finish(self) -> dict[str, Any] | None:
        """Write and print the steady-state summary (metrics rank only)."""
        if not self.is_metrics_rank:
            return None
        summary = (
            summarize(self.records, self.tconfig.summary_skip_steps, self.start_step)
            if self.records
            else {}
        )
        summary["device"] = self.tconfig.device_name
        summary["precision"] = self.tconfig.precision
        summary["peak_tflops"] = self.peak / 1e12 if self.peak else None  # dense BF16
        summary["precision_peak_tflops"] = (
            self.precision_peak / 1e12 if self.precision_peak else None
        )
        if self.shape.is_moe:
            s = self.shape
            last: dict[str, Any] = next(
                (r for r in reversed(self.records) if "moe_load_balance_loss" in r), {}
            )
            summary["moe"] = {
                "mfu_basis": "active parameters (top_k of the routed experts + shared experts, "
                "attention, dense layers, router, head)",
                "total_params": s.total_params,
                "active_params": s.active_params,
                "routed_experts": s.n_routed_experts,
                "top_k": s.top_k,
                "moe_layers": s.n_moe_layers,
                "ep": self.parallel_dims.ep,
                **{k: v for k, v in last.items() if k.startswith("moe_")},
            }
        summary["world_size"] = self.parallel_dims.world_size
        summary["processes_per_node"] = self.procs_per_node
        if self.data_stats is not None:
            summary["data"] = self.data_stats
        with open(self.summary_path, "w") as f:
            json.dump(summary, f, indent=2)
        med = summary.get("median_tokens_per_sec_per_gpu")
        if med is not None:
            mfu = summary.get("median_mfu_pct")
            logger.info(
                "summary (steady state, first "
                f"{summary['warmup_steps_excluded']} steps excluded, "
                f"{summary['steps_in_summary']} logged steps): "
                f"median tok/s/gpu {med:,.0f} "
                f"[p10 {summary['p10_tokens_per_sec_per_gpu']:,.0f}, "
                f"p90 {summary['p90_tokens_per_sec_per_gpu']:,.0f}]  "
                f"useful {summary['median_useful_tokens_per_sec_per_gpu']:,.0f}  "
                f"tok/s/node {summary['median_tokens_per_sec_per_node']:,.0f}  "
                f"mfu {'n/a' if mfu is None else f'{mfu:.1f}%'}  "
                f"peak mem {summary['peak_memory_gib']:.2f}GiB  -> {self.summary_path}"
            )
        else:
            logger.info(f"summary: {summary.get('note', 'no steps logged')}")
        return summary

    def close(self) -> None:
        super().close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(dump_folder: str) -> str:
    """The W&B run id of the job writing to `dump_folder`: created at its first start, read
    back by every restart or Slurm requeue, so they all log to one run."""
    import uuid

    path = os.path.join(dump_folder, WANDB_ID_FILE)
    if os.path.exists(path):
        with open(path) as f:
            run_id = f.read().strip()
        if run_id:
            return run_id
    os.makedirs(dump_folder, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    write_text_atomic(path, run_id + "\n")
    return run_id


def _wandb_env(config: TitanscaleMetrics.Config, kwargs: dict[str, Any]) -> None:
    """torchtitan's WandBLogger reads its settings from the environment: set them (on the
    metrics rank, the only one that creates the logger) before it is built."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    metrics_rank = _get_metrics_rank(
        parallel_dims=kwargs["parallel_dims"], pp_schedule=kwargs.get("pp_schedule", "1F1B")
    )
    if rank != metrics_rank and not config.save_for_all_ranks:
        return
    wandb_env(
        config.wandb_project,
        config.wandb_entity,
        config.wandb_run_name,
        kwargs.get("dump_folder", "./outputs"),
    )


def wandb_env(project: str, entity: str, run_name: str, dump_folder: str) -> None:
    """The environment torchtitan's WandBLogger reads (one run id per output folder)."""
    os.environ["WANDB_PROJECT"] = project
    if entity:
        os.environ["WANDB_TEAM"] = entity
    if run_name:
        os.environ["WANDB_RUN_NAME"] = run_name
    os.environ["WANDB_RUN_ID"] = wandb_run_id(dump_folder)
    os.environ.setdefault("WANDB_RESUME", "allow")  # same id again = continue that run


def _finite_or_null(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite_or_null(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite_or_null(x) for x in v]
    return v


class JsonlLog:
    """metrics.jsonl, appended (a restarted or requeued job continues the same file; `start`
    events mark each start so a reader can drop the steps a restart replays), one flushed
    line per record."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._f = open(path, "a", buffering=1)  # noqa: SIM115
        # A process killed mid-line leaves no newline; start on a fresh line so the next
        # record stays parseable (read_trajectory skips the torn one).
        if self._f.tell() > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._f.write("\n")

    def write(self, rec: dict[str, Any]) -> None:
        # A non-finite float is written as null: json.dumps's bare NaN / Infinity are not
        # JSON, and one such value made the whole line unreadable to other tools (#41).
        self._f.write(json.dumps(_finite_or_null(rec)) + "\n")

    def event(self, event: str, **fields: Any) -> None:
        self.write({"event": event, "time": time.time(), **fields})
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class StepMetrics:
    """metrics.jsonl + TensorBoard + W&B (torchtitan's loggers, under <dump>/tb/<time>) for
    the post-training loops outside torchtitan's Trainer ([[adapters]] jobs). Only `rank` 0
    writes. `log(rec, step, tag)` writes the record to metrics.jsonl and its numbers as
    scalars `tag/name` (a per-adapter namespace) to TensorBoard and W&B."""

    def __init__(self, section: Any, dump_folder: str, *, rank: int, run_name: str) -> None:
        from datetime import datetime

        from torchtitan.components.metrics import (
            LoggerContainer,
            TensorBoardLogger,
            WandBLogger,
        )

        self.rank = rank
        self.jsonl = (
            JsonlLog(os.path.join(dump_folder, "metrics.jsonl"))
            if section.jsonl and rank == 0
            else None
        )
        self.loggers = LoggerContainer()
        if rank == 0 and (section.tensorboard or section.wandb):
            log_dir = os.path.join(dump_folder, "tb", datetime.now().strftime("%Y%m%d-%H%M"))
            if section.wandb:
                wandb_env(
                    section.wandb_project,
                    section.wandb_entity,
                    section.wandb_run_name or run_name,
                    dump_folder,
                )
                self.loggers.add_logger(WandBLogger(log_dir))
            if section.tensorboard:
                self.loggers.add_logger(TensorBoardLogger(log_dir))

    def log(self, rec: dict[str, Any], step: int, *, tag: str = "") -> None:
        if self.jsonl is not None:
            self.jsonl.write(rec)
        nums = {
            (f"{tag}/{k}" if tag else k): v
            for k, v in rec.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        if self.rank == 0 and nums:
            self.loggers.log(nums, step)

    def write_event(self, event: str, **fields: Any) -> None:
        if self.jsonl is not None:
            self.jsonl.event(event, **fields)

    def close(self) -> None:
        self.loggers.close()
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None


def read_trajectory(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The training trajectory in a metrics.jsonl that restarts appended to: one record per
    step, ascending, each from the latest (re)start that logged it.

    A restart resumes from its checkpoint (`resumed_from_step` of its start event) and
    replays the steps after it; the replayed records supersede the earlier ones, which
    belong to a trajectory that was lost with the crash. Torn lines (a process killed in
    the middle of a write) are skipped.
    """
    steps: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = loads_line(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("event") == "start":
                resumed = int(rec.get("resumed_from_step") or 0)
                for s in [s for s in steps if s > resumed]:
                    del steps[s]
            elif "event" not in rec and isinstance(rec.get("step"), int):
                steps[rec["step"]] = rec
    return [steps[s] for s in sorted(steps)]


def read_starts(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The `start` events of a metrics.jsonl, in order (one per process start)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                rec = loads_line(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == "start":
                out.append(rec)
    return out
