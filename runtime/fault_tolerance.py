"""train.py under torchft replica groups, through torchtitan's experiments/torchft seam.

One torchrun is one replica group (an HSDP replica: FSDP inside the group, torchft's
Manager averaging gradients across the live groups). Nothing of the protocol is ours:
- `TitanscaleFTTrainer`: TitanscaleTrainer plus the additions torchtitan's FaultTolerantTrainer
  makes, each at the current Trainer's seams (that class's own __init__ is a stale copy of
  Trainer.__init__ and is not used): the `TorchFTManager`, the dataloader's share of the
  global stream (`dp_info` = torchtitan's `get_dp_info`), the FSDP all-reduce hook over
  torchft's managed process group, torchft.Optimizer (quorum at zero_grad, should_commit
  at step).
- `FTCheckpointManager`: our atomic, verified checkpointer (runtime.checkpoint) over
  torchtitan's `TorchFTCheckpointManager`: a per-group dataloader checkpoint every step (a
  restarted group resumes its own share of the stream), only the participating rank-0
  group writes the full checkpoint (an ordinary DCP checkpoint, loadable without torchft);
  the state torchft sends a healing group is `heal_state` (local shards, no collective).
- `fault_tolerance_config`: our `[fault_tolerance]` section onto torchtitan's
  `FaultTolerance` config; `torchft_env`: onto torchft's environment variables (timeouts).

What this costs and what is lost on a failure: docs/fault_tolerance.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import Any

from core.errors import ConfigError, shown
from core.launch_env import LIGHTHOUSE_ENV, REPLICA_ENV
from recipe.loader import replica_groups
from recipe.schema import Recipe

# torchft.manager reads these before its constructor's arguments (TIMEOUT_SEC_ENV, ...):
# the one way to set the Manager's timeouts through torchtitan's TorchFTManager, which
# does not pass them.
QUORUM_TIMEOUT_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
TIMEOUT_ENV = "TORCHFT_TIMEOUT_SEC"


def replica_id(env: Mapping[str, str], groups: int) -> int:
    """This process's replica group from REPLICA_GROUP_ID (set by tools.launch), checked."""
    raw = env.get(REPLICA_ENV)
    if raw is None or not raw.isdigit() or not raw.isascii() or int(raw) >= groups:
        got = "nothing" if raw is None else shown(raw)
        raise ConfigError(
            f"expected a replica group id in 0..{groups - 1} (fault_tolerance.enabled; "
            f"tools.launch sets it), got {got}",
            file="environment",
            key=REPLICA_ENV,
        )
    return int(raw)


def lighthouse(recipe: Recipe, env: Mapping[str, str]) -> str:
    """The lighthouse address: TORCHFT_LIGHTHOUSE (tools.launch), else
    fault_tolerance.lighthouse; one line when neither is set."""
    addr = env.get(LIGHTHOUSE_ENV) or recipe.fault_tolerance.lighthouse
    if not addr:
        raise ConfigError(
            f"no torchft lighthouse: set fault_tolerance.lighthouse or {LIGHTHOUSE_ENV} "
            "(tools.launch starts one)",
            file=recipe.source,
            key="fault_tolerance.lighthouse",
        )
    return addr


def torchft_env(recipe: Recipe, env: MutableMapping[str, str]) -> None:
    """torchft's settings that torchtitan's TorchFTManager does not pass, as the environment
    torchft reads: the lighthouse, the quorum timeout and the collective timeout (both
    fault_tolerance.quorum_timeout_s: a dead peer is given up on after it). A value already
    in the environment wins (an operator's override)."""
    env[LIGHTHOUSE_ENV] = lighthouse(recipe, env)
    t = str(recipe.fault_tolerance.quorum_timeout_s)
    env.setdefault(QUORUM_TIMEOUT_ENV, t)
    env.setdefault(TIMEOUT_ENV, t)


def fault_tolerance_config(recipe: Recipe, rid: int, *, cpu: bool) -> Any:
    """torchtitan's FaultTolerance config for replica group `rid`: gloo on CPU, NCCL on CUDA;
    the process-group timeout is the quorum timeout (the step a dead peer spoils is
    abandoned after it)."""
    from torchtitan.experiments.torchft.config import FaultTolerance

    ft = recipe.fault_tolerance
    return FaultTolerance(
        enable=True,
        process_group="gloo" if cpu else "nccl",
        process_group_timeout_ms=ft.quorum_timeout_s * 1000,
        replica_id=rid,
        group_size=replica_groups(recipe),
        min_replica_size=ft.min_replicas,
        semi_sync_method=None if ft.semi_sync == "off" else ft.semi_sync,
        sync_steps=ft.sync_steps,
    )


def group_dump_folder(output_dir: str, rid: int) -> str:
    """Each group's metrics, logs and summary (groups would overwrite each other's
    metrics.jsonl in one folder); checkpoints stay in the recipe's one folder."""
    return os.path.join(output_dir, f"replica_{rid}")


def dp_info(dp_degree: int, dp_rank: int, groups: int, rid: int) -> tuple[int, int]:
    """The data-parallel coordinates a rank reads the global stream at: torchtitan's
    TorchFTManager.get_dp_info (each group one contiguous share of groups x dp shards)."""
    return dp_degree * groups, dp_degree * rid + dp_rank


@functools.cache
def _classes() -> tuple[Any, Any, Any, Any]:
    """Built on first use: they subclass torchtitan/torchft classes (imports cost seconds)."""
    from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer

    from data.loader import TitanscaleDataLoader
    from runtime.checkpoint import AtomicCheckpointManager
    from runtime.trainer import TitanscaleTrainer

    class ReplicaDataLoader(TitanscaleDataLoader):
        """TitanscaleDataLoader reading its group's share of the stream (`dp_info`): the
        base Trainer passes the group's own dp coordinates."""

        @dataclass(kw_only=True, slots=True)
        class Config(TitanscaleDataLoader.Config):
            replica_groups: int = 1
            """torchft replica groups sharing the stream."""

            replica_id: int = 0
            """This group's index among them."""

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, **kw: Any):
            world, rank = dp_info(dp_world_size, dp_rank, config.replica_groups, config.replica_id)
            super().__init__(config, dp_world_size=world, dp_rank=rank, **kw)

    class FTOptimizers(TorchFTOptimizersContainer):
        """torchft.Optimizer around torchtitan's container (start_quorum at zero_grad,
        should_commit at step); the manager arrives through the config because the base
        Trainer builds optimizers with model_parts only."""

        @dataclass(kw_only=True, slots=True)
        class Config(TorchFTOptimizersContainer.Config):
            ft_manager: Any = None
            """The TorchFTManager (set by TitanscaleFTTrainer.init_distributed)."""

        def __init__(self, config: Config, *, model_parts: list[Any]) -> None:
            super().__init__(config, model_parts=model_parts, ft_manager=config.ft_manager)

    class FTCheckpointManager(AtomicCheckpointManager, TorchFTCheckpointManager):  # type: ignore[misc]
        """AtomicCheckpointManager (commit, verify, prune) over TorchFTCheckpointManager
        (per-group dataloader checkpoints, the participating rank-0 group alone writes the
        full checkpoint); the heal state replaced by `heal_state`."""

        @dataclass(kw_only=True, slots=True)
        class Config(AtomicCheckpointManager.Config):
            # TorchFTCheckpointManager.Config's one field (two slotted Config bases cannot
            # be combined): a restarted group resumes its dataloader from its own folder.
            enable_ft_dataloader_checkpoints: bool = True
            """Save each group's dataloader position every step (torchtitan's default)."""

            ft_manager: Any = None
            """The TorchFTManager (set by TitanscaleFTTrainer.init_distributed)."""

        def __init__(self, config: Any, **kwargs: Any) -> None:
            super().__init__(config, ft_manager=config.ft_manager, **kwargs)
            mgr = self.ft_manager
            if mgr is not None and self.enable:
                # torchft 0.2.0 has no unregister: TorchFTCheckpointManager's registration
                # (key "set_state_dict_fns") is replaced in place.
                # The parameters as FSDP2 holds them sharded, taken now (the model is
                # parallelized before the checkpointer is built): see sharded_parameters.
                key = "set_state_dict_fns"
                params = sharded_parameters(self.states)
                mgr._user_state_dicts[key] = lambda: heal_state(self.states, params)
                mgr._load_state_dict_fns[key] = lambda sd: load_heal_state(self.states, sd, params)

    class TitanscaleFTTrainer(TitanscaleTrainer):
        """TitanscaleTrainer plus torchtitan's FT additions at the base Trainer's seams.

        Not torchtitan's FaultTolerantTrainer: its __init__ is a copy of an older
        Trainer.__init__ (0.3.0) that never sets the chunked loss's lm_head ("Set lm_head
        before calling ChunkedLossWrapper"), nor the spmd backend, nor applies overrides.
        Its additions are made here instead, each through the component torchtitan
        provides: the TorchFTManager (init_distributed), the dataloader's share
        (ReplicaDataLoader), torchft.Optimizer (FTOptimizers), the FT checkpointer and
        the FSDP all-reduce hook over torchft's managed process group (after the model is
        built, through post_optimizer_build_fn)."""

        def __init__(self, config: Any, *, ft: Any, **kwargs: Any) -> None:
            self.ft_config = ft
            spec = config.model_spec
            prev = spec.post_optimizer_build_fn

            def post_optimizer_build(optimizers: Any, model_parts: Any, pd: Any) -> None:
                if prev is not None:
                    prev(optimizers, model_parts, pd)
                self.ft_manager.maybe_set_all_reduce_hook(model_parts)

            spec.post_optimizer_build_fn = post_optimizer_build
            super().__init__(config, **kwargs)

        def init_distributed(self) -> Any:
            pd = super().init_distributed()  # TitanscaleTrainer's: mesh, startup check
            # After the group's own process group exists (the Manager uses its store).
            self.ft_manager = self.ft_config.build()
            self.config.optimizer.ft_manager = self.ft_manager
            self.config.checkpoint.ft_manager = self.ft_manager
            return pd

        def train(self) -> None:
            super().train()
            # Each rank's digest of what it holds (runtime.fault_tolerance.state_digest):
            # equal across groups, rank by rank, when they are replicas of each other.
            import torch

            digest = {"step": self.step, **state_digest(heal_state(self.checkpointer.states))}
            path = os.path.join(
                self.config.dump_folder, f"state_digest_rank{torch.distributed.get_rank()}.json"
            )
            with open(path, "w") as f:
                json.dump(digest, f)

        def close(self) -> None:
            super().close()
            mgr = getattr(self, "ft_manager", None)
            if mgr is not None and mgr.enabled:
                mgr.manager.shutdown(wait=False)

    return ReplicaDataLoader, FTOptimizers, FTCheckpointManager, TitanscaleFTTrainer


def trainer_class() -> type:
    """The trainer train.py runs when fault_tolerance.enabled (pass it `ft=`)."""
    return _classes()[3]


def as_fault_tolerant(config: Any, recipe: Recipe, rid: int) -> Any:
    """A built Trainer.Config with torchft's components swapped in for replica group `rid`:
    the dataloader's share of the stream, torchft's optimizer and the FT checkpointer;
    every other field as built (runtime.build)."""
    loader_cls, optim_cls, ckpt_cls, _ = _classes()

    def convert(obj: Any, cls: type, **extra: Any) -> Any:
        return cls(**{f.name: getattr(obj, f.name) for f in fields(obj) if f.init}, **extra)

    config.dataloader = convert(
        config.dataloader, loader_cls.Config, replica_groups=replica_groups(recipe), replica_id=rid
    )
    config.optimizer = convert(config.optimizer, optim_cls.Config)
    config.checkpoint = convert(config.checkpoint, ckpt_cls.Config)
    # torchft heals a restarted group through the state functions the checkpointer
    # registers, which it does only when enabled; with checkpoint.interval = 0 it then saves
    # the last step only (runtime.build sets the interval to the run's steps).
    config.checkpoint.enable = True
    return config


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def sharded_parameters(states: dict[str, Any]) -> list[tuple[str, Any]]:
    """(part index.name, parameter) of every model part, to be taken while the parameters
    are FSDP2's sharded DTensors (after parallelization, outside a step).

    Why not `named_parameters()` when torchft asks: between a module's forward and its
    reshard FSDP2 registers the unsharded parameters in their place (for the last group,
    whose reshard_after_forward is False, until the backward), and torchft's quorum thread
    calls `heal_state` while the step's forward runs. Reading the registration then sends a
    full tensor where the healing rank holds a shard (seen, with restarts a few seconds
    apart: `norm.weight` (256,) against a (128,) shard). These objects are FSDP2's sharded
    parameters for the run's lifetime: the optimizer steps and checkpoint loads update
    them in place, and between the quorum's start and the optimizer step (torchft's
    should_commit) their values do not change."""
    from torchtitan.components.checkpoint import MODEL

    return [(f"{i}.{name}", p) for i, part in enumerate(states[MODEL].model)
            for name, p in part.named_parameters()]  # fmt: skip


def _heal_tensors(states: dict[str, Any], params: list[tuple[str, Any]] | None) -> list:
    """(key, tensor) of what a heal moves: `params` (default: `sharded_parameters` now),
    then every model part's buffers (FSDP2 does not shard or swap those)."""
    from torchtitan.components.checkpoint import MODEL

    named = [*(sharded_parameters(states) if params is None else params)]
    for i, part in enumerate(states[MODEL].model):
        named += [(f"{i}.{name}", t) for name, t in part.named_buffers()]
    return named


def heal_state(
    states: dict[str, Any], params: list[tuple[str, Any]] | None = None
) -> dict[str, Any]:
    """What a live group's rank sends the same rank of a healing group: its own shards of
    the parameters, buffers and optimizer state (local tensors, by name and position), the
    optimizer's hyperparameters, the LR schedule and the step.

    Not torchtitan's `state_dict()` of the model, which TorchFTCheckpointManager registers:
    torchft calls this from its quorum thread on the sending rank alone, and the model's
    state_dict hooks run collectives (the fused-QKV split all-gathers `wqkv` inside the
    group, torchtitan.models.common.attention), which the healing peer never joins: a
    deadlock until torchft's timeout (found here, torchtitan 0.3.0). Both groups shard the
    same way (one layout per recipe), so rank r's shards are what rank r of the healing
    group holds; nothing here needs a peer."""
    from torchtitan.components.checkpoint import LR_SCHEDULER, OPTIMIZER, TRAIN_STATE

    model = {key: _local(t.detach()) for key, t in _heal_tensors(states, params)}
    optim = []
    for opt in states[OPTIMIZER].optimizers:
        held = [p for g in opt.param_groups for p in g["params"]]
        optim.append(
            {
                "state": [{k: _local(v) for k, v in opt.state[p].items()} for p in held],
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            }
        )
    return {
        "model": model,
        "optim": optim,
        LR_SCHEDULER: states[LR_SCHEDULER].state_dict(),
        TRAIN_STATE: states[TRAIN_STATE].state_dict(),
    }


def load_heal_state(
    states: dict[str, Any], sd: dict[str, Any], params: list[tuple[str, Any]] | None = None
) -> None:
    """`heal_state` from a live peer, copied in place into this rank's shards (torchft calls
    it on every rank of the healing group from the main thread, before the step)."""
    import torch
    from torchtitan.components.checkpoint import LR_SCHEDULER, OPTIMIZER, TRAIN_STATE

    with torch.no_grad():
        for key, t in _heal_tensors(states, params):
            _local(t).copy_(sd["model"][key])
        for opt, got in zip(states[OPTIMIZER].optimizers, sd["optim"], strict=True):
            held = [p for g in opt.param_groups for p in g["params"]]
            for p, st in zip(held, got["state"], strict=True):
                for k, v in st.items():
                    cur = opt.state[p].get(k)
                    if isinstance(cur, torch.Tensor):
                        _local(cur).copy_(v)
                    else:
                        opt.state[p][k] = v
            for g, hyper in zip(opt.param_groups, got["groups"], strict=True):
                g.update(hyper)
    states[LR_SCHEDULER].load_state_dict(sd[LR_SCHEDULER])
    states[TRAIN_STATE].load_state_dict(sd[TRAIN_STATE])


def state_digest(sd: dict[str, Any]) -> dict[str, str]:
    """SHA-256 of `heal_state`'s tensors (bytes, dtype, shape; by name and position): the
    parameters and buffers, and the optimizer state. Two ranks holding bit-identical shards
    give equal digests."""
    import torch

    def feed(h: Any, obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                feed(h, obj[k], f"{path}.{k}")
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                feed(h, v, f"{path}.{i}")
        elif isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{path}={obj!r}".encode())

    out = {}
    for key in ("model", "optim"):
        h = hashlib.sha256()
        feed(h, sd[key], key)
        out[key] = h.hexdigest()
    return out
