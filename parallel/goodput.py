"""Goodput: the tokens/s per GPU a run keeps after failures, checkpoints and restarts.

Pure first-order model (docs/fault_tolerance.md derives it). A job of N GPUs fails at rate
lambda * N (lambda: failures per GPU-hour, a cluster-profile field), so its mean time between
failures is M = 1 / (lambda N). Two recovery modes:

- whole-job restart (today's default): every failure stops all ranks; they restart
  (`restart_s`), read the last checkpoint and redo the work since it. With a checkpoint of
  cost C every T seconds of training the kept fraction of wall time is

      E(T) = T / (T + C) * (1 - (R + (T + C) / 2) / M),      R = restart_s + read time

  (Daly 2006, first order), maximised near Young's interval T* = sqrt(2 C M).
- per-replica recovery (torchft, [fault_tolerance]): a failure takes out one of G replica
  groups. That group restarts alone and heals from a live peer over the network (H = its
  share of the training state / network bandwidth); the other groups keep training. Every
  group loses the step in flight, the failure-detection timeout and two quorum
  reconfigurations (leave, rejoin); the failed group's GPUs are out for restart_s + H and the
  peer serving it for H. Checkpoints then guard only against what stops the whole job, taken
  here as a failure of the lighthouse's host (rate lambda x gpus_per_node): Young's interval
  against that far longer M.

Not modelled (stated in the docs): correlated failures of several groups at once, slowdowns
that are not failures (stragglers), asynchronous checkpoint staging (C is a blocking write).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Seconds a collective waits on a dead peer before the step is abandoned: torchtitan's
# fault_tolerance.process_group_timeout_ms default (10 s).
DETECT_S = 10.0
# Seconds to reconfigure the cross-group communicator after a quorum change. An assumption
# (NCCL communicator init at thousands of ranks takes tens of seconds); not measured here.
RECONFIGURE_S = 30.0
# Bytes of training state per parameter: fp32 weights + AdamW's two fp32 moments.
STATE_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class GoodputInputs:
    gpus: int
    tokens_per_sec_per_gpu: float  # failure-free throughput (parallel.perf)
    step_time_s: float
    failures_per_gpu_hour: float
    state_bytes: float  # unique training state of the whole model (weights + optimizer)
    checkpoint_bytes_per_s_per_gpu: float  # storage bandwidth, read or write
    net_bytes_per_s_per_gpu: float  # inter-node bandwidth (healing from a peer)
    restart_s: float  # failure -> first step again, without the checkpoint read
    replica_groups: int  # torchft groups (per-replica mode)
    lighthouse_gpus: int  # GPUs of the host the lighthouse runs on
    detect_s: float = DETECT_S
    reconfigure_s: float = RECONFIGURE_S


@dataclass(frozen=True)
class Goodput:
    mode: str  # "whole_job_restart" | "per_replica_recovery"
    efficiency: float  # kept fraction of wall time, in [0, 1]
    goodput_tokens_per_sec_per_gpu: float
    checkpoint_interval_s: float | None  # None: no failure stops the job (lambda = 0)
    checkpoint_interval_steps: int | None
    checkpoint_cost_s: float
    mtbf_s: float  # between the failures this mode pays for (inf when lambda = 0)
    lost_per_failure_s: float  # wall seconds of the whole job lost per such failure

    def to_json(self) -> dict:
        def r(x: float | None, n: int = 1) -> float | None:
            return None if x is None or math.isinf(x) else round(x, n)

        return {
            "goodput_tokens_per_sec_per_gpu": round(self.goodput_tokens_per_sec_per_gpu, 1),
            "efficiency": round(self.efficiency, 4),
            "checkpoint_interval_s": r(self.checkpoint_interval_s),
            "checkpoint_interval_steps": self.checkpoint_interval_steps,
            "checkpoint_cost_s": r(self.checkpoint_cost_s, 2),
            "mtbf_s": r(self.mtbf_s),
            "lost_per_failure_s": r(self.lost_per_failure_s, 2),
        }


def mtbf_s(failures_per_gpu_hour: float, gpus: int) -> float:
    """Mean seconds between failures of `gpus` GPUs (inf for a zero rate)."""
    rate = failures_per_gpu_hour * gpus
    return math.inf if rate == 0 else 3600.0 / rate


def young_interval_s(cost_s: float, mtbf: float) -> float:
    """Young's (1974) optimum checkpoint interval sqrt(2 C M), seconds of training."""
    return math.sqrt(2.0 * cost_s * mtbf)


def efficiency(interval_s: float, cost_s: float, restart_s: float, mtbf: float) -> float:
    """Kept fraction of wall time with a checkpoint of `cost_s` every `interval_s` seconds of
    training and a failure every `mtbf` seconds costing `restart_s` plus, on average, half an
    interval of redone work (Daly's first-order model). Clipped to [0, 1]."""
    if math.isinf(mtbf):
        return interval_s / (interval_s + cost_s) if not math.isinf(interval_s) else 1.0
    period = interval_s + cost_s
    e = interval_s / period * (1.0 - (restart_s + period / 2.0) / mtbf)
    return min(1.0, max(0.0, e))


def _steps(interval_s: float, step_time_s: float) -> int | None:
    if math.isinf(interval_s):
        return None
    return max(1, round(interval_s / step_time_s))


def whole_job_restart(i: GoodputInputs, interval_s: float | None = None) -> Goodput:
    """Every failure restarts all ranks from the last checkpoint. `interval_s`: price this
    checkpoint interval instead of the optimum."""
    m = mtbf_s(i.failures_per_gpu_hour, i.gpus)
    # Each GPU writes (and reads back) its 1/N of the unique state (DCP spreads replicas).
    cost = i.state_bytes / i.gpus / i.checkpoint_bytes_per_s_per_gpu
    restart = i.restart_s + cost
    t = young_interval_s(cost, m) if interval_s is None else interval_s
    return _result("whole_job_restart", i, efficiency(t, cost, restart, m), t, cost, m, restart)


def _result(
    mode: str, i: GoodputInputs, e: float, t: float, cost: float, mtbf: float, lost: float
) -> Goodput:
    return Goodput(
        mode=mode,
        efficiency=e,
        goodput_tokens_per_sec_per_gpu=i.tokens_per_sec_per_gpu * e,
        checkpoint_interval_s=None if math.isinf(t) else t,
        checkpoint_interval_steps=_steps(t, i.step_time_s),
        checkpoint_cost_s=cost,
        mtbf_s=mtbf,
        lost_per_failure_s=lost,
    )


def heal_s(i: GoodputInputs) -> float:
    """Seconds for a rejoining group to fetch its full state from a live peer: each of its
    N / G GPUs receives its shard of the state at the network bandwidth."""
    group_gpus = i.gpus / i.replica_groups
    return i.state_bytes / group_gpus / i.net_bytes_per_s_per_gpu


def per_replica_lost_s(i: GoodputInputs) -> float:
    """Whole-job-equivalent wall seconds lost per failure under per-replica recovery: every
    group loses the step in flight, the detection timeout and two reconfigurations; the failed
    group (1/G of the GPUs) is out for restart + heal, and its peer for the heal."""
    h = heal_s(i)
    everyone = i.step_time_s + i.detect_s + 2.0 * i.reconfigure_s
    return everyone + (i.restart_s + 2.0 * h) / i.replica_groups


def per_replica_recovery(i: GoodputInputs, interval_s: float | None = None) -> Goodput:
    """torchft replica groups: a failure costs `per_replica_lost_s`; checkpoints (same cost
    as whole-job) guard only against the lighthouse host failing."""
    if i.replica_groups < 2:  # one group: nothing to recover from
        return replace(whole_job_restart(i, interval_s), mode="per_replica_recovery")
    m_group = mtbf_s(i.failures_per_gpu_hour, i.gpus)
    m_whole = mtbf_s(i.failures_per_gpu_hour, i.lighthouse_gpus)
    cost = i.state_bytes / i.gpus / i.checkpoint_bytes_per_s_per_gpu
    t = young_interval_s(cost, m_whole) if interval_s is None else interval_s
    lost = per_replica_lost_s(i)
    e = efficiency(t, cost, i.restart_s + cost, m_whole)
    if not math.isinf(m_group):
        e = max(0.0, e - lost / m_group)
    return _result("per_replica_recovery", i, e, t, cost, m_group, lost)


def inputs_for(recipe, cluster, layout, step_time_s: float, tokens_per_sec_per_gpu: float):
    """GoodputInputs for a recipe's layout on a cluster profile. Replica groups: the
    recipe's [fault_tolerance] groups when enabled, else parallel.dp_replicate when > 1, else
    one group per data-parallel rank's model-parallel unit (pp x cp x tp GPUs; the
    throughput stays the recipe's layout's: the model does not reprice HSDP for it)."""
    from recipe.loader import effective_shape, replica_groups

    groups = replica_groups(recipe)
    if groups < 2:
        groups = layout.dp_replicate if layout.dp_replicate > 1 else layout.dp
    return GoodputInputs(
        gpus=cluster.world_size,
        tokens_per_sec_per_gpu=tokens_per_sec_per_gpu,
        step_time_s=step_time_s,
        failures_per_gpu_hour=cluster.failures_per_gpu_hour,
        state_bytes=effective_shape(recipe).total_params * STATE_BYTES_PER_PARAM,
        checkpoint_bytes_per_s_per_gpu=cluster.checkpoint_gbps_per_gpu * 1e9 / 8,
        # One node (no network in the profile): the peer is across NVLink; neither (a CPU
        # profile): the group reads its state back from storage instead.
        net_bytes_per_s_per_gpu=cluster.net_bytes_per_s
        or cluster.nvlink_bytes_per_s
        or cluster.checkpoint_gbps_per_gpu * 1e9 / 8,
        restart_s=cluster.restart_s,
        replica_groups=max(1, groups),
        lighthouse_gpus=cluster.gpus_per_node,
    )


def goodput_json(recipe, cluster, layout, step_time_s: float, tokens_per_sec_per_gpu: float):
    """tools.predict's goodput fields: both recovery modes at their best checkpoint interval
    (and at the recipe's checkpoint.interval when it sets one); the top-level
    goodput_tokens_per_sec_per_gpu is the mode the recipe runs in."""
    i = inputs_for(recipe, cluster, layout, step_time_s, tokens_per_sec_per_gpu)
    modes = {}
    for fn in (whole_job_restart, per_replica_recovery):
        g = fn(i)
        entry = g.to_json()
        if recipe.checkpoint.interval:
            at = fn(i, recipe.checkpoint.interval * step_time_s)
            entry["at_recipe_interval"] = {
                "checkpoint_interval_steps": recipe.checkpoint.interval,
                "goodput_tokens_per_sec_per_gpu": round(at.goodput_tokens_per_sec_per_gpu, 1),
            }
        modes[g.mode] = entry
    own = "per_replica_recovery" if recipe.fault_tolerance.enabled else "whole_job_restart"
    return {
        "goodput_tokens_per_sec_per_gpu": modes[own]["goodput_tokens_per_sec_per_gpu"],
        "goodput_mode": own,
        "goodput": {
            "failures_per_gpu_hour": cluster.failures_per_gpu_hour,
            "restart_s": cluster.restart_s,
            "replica_groups": i.replica_groups,
            "replica_group_gpus": i.gpus // i.replica_groups,
            "heal_s": round(heal_s(i), 2),
            **modes,
        },
    }
