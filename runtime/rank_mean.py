"""A loop's metric values averaged over the ranks that report them.

The post-training loops (RL) log per-rank statistics; `mean_over_ranks` reduces them so the
logged figure is the job's, with ranks that report different keys handled (below).
"""

from __future__ import annotations

import torch


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value averaged over the ranks that report it (as is with one process).

    Ranks may report different keys (a rank whose rollouts all failed trains nothing and has
    no loss statistics): the key lists are gathered first, so every rank reduces the same
    vector and a key's mean is over the ranks that have it. Reducing unequal lists instead
    would pair one rank's `kl` with another's `reward_mean`, or hang on unequal lengths.
    Costs one all_gather_object of the key names beside the all-reduce, once per update.
    """
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return values
    names: list[list[str] | None] = [None] * world
    dist.all_gather_object(names, sorted(values))
    keys = sorted({k for ks in names for k in (ks or [])})
    if not keys:
        return values
    dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(
        [values.get(k, 0.0) for k in keys] + [float(k in values) for k in keys],
        dtype=torch.float64,
        device=dev,
    )
    dist.all_reduce(t)
    sums, counts = t[: len(keys)].tolist(), t[len(keys) :].tolist()
    return {k: v / n for k, v, n in zip(keys, sums, counts, strict=True)}
