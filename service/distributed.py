"""A model resource: `tools.serve` over the processes torchrun starts, one base shared.

    python -m tools.torchrun --standalone --nproc-per-node N -m tools.serve --recipe R ...

Every rank builds the backend (service.titan_backend: the frozen base FSDP2-sharded over all
ranks, adapters replicated). Rank 0 serves HTTP (service.server, unchanged: tenants,
admission, fair scheduling, accounting) with a `ResourceBackend`: each backend call the
scheduler makes becomes one command, run by every rank in the scheduler's order:

- the device thread (rank 0) broadcasts `(name, args, kwargs)` on a gloo control group
  (`broadcast_object_list`: the datums and specs are small numpy / dataclass objects),
  runs the call on its own backend, and gathers every rank's result (`gather_object`);
  followers (ranks > 0, `follow`) loop on the same broadcast. Tensors move as the backend
  moves them (FSDP all-gathers, the adapters' gradient sum) on the data group.
- forward_backward: each rank takes a contiguous share of the datums (a rank with none runs
  the first datum with a zero mask: the same collectives, no contribution); the loss is
  summed over ranks inside the step, per-datum logprobs are gathered on rank 0 in order.
- sample: every rank decodes every row with the same seed (rank 0 picks one when the
  request has none); rank 0 answers and checks the others sampled the same tokens.
- save_state / save_sampler_weights: rank 0 alone (the adapters are replicated). Loads:
  every rank reads the folder (`--storage` must be visible to every node).

Failures (the per-op deadline `--op-timeout` bounds each call on rank 0):
- every rank refusing the same way (a 4xx: unknown adapter, NaN loss: the loss the ranks
  check is the all-reduced one) fails that operation only, as on one process;
- ranks disagreeing, a collective failing (a rank died: gloo reports the closed connection
  at once; a hung rank: the group's timeout) or the deadline passing mark the resource
  broken: that operation and every later one fail with one sentence naming the lost rank
  where this host can tell (`ResourceBroken`), and `on_broken` lets the server stop (exit
  non-zero). Checkpoints already written are complete (saves are atomic); a restarted
  service loads them.
- idle, rank 0 pings every `heartbeat_s`, so a rank that dies between operations is found
  within seconds, and the followers' waits stay short.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import resource
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from service.backend import BaseModelInfo
from service.errors import ServiceError
from service.types import (
    AdamParams,
    Datum,
    FwdBwdResult,
    LoraSpec,
    SampleResult,
    SamplingParams,
)

log = logging.getLogger("service")
HEARTBEAT_S = 2.0
EXIT, PING = "exit", "ping"
# After a failed collective: how long to wait for a local rank's process to be seen gone.
LOST_WAIT_S = 2.0
# Operations only rank 0 runs (the adapters are replicated: one writer).
RANK0_ONLY = ("save_state", "save_sampler_weights")


class ResourceBroken(ServiceError):
    """The resource lost a rank or its ranks disagree: no operation can run any more."""

    logged = True  # one line, once, by the dispatcher (no traceback: the cause is known)

    def __init__(self, reason: str):
        super().__init__(503, reason)


class FailedEverywhere(ServiceError):
    """Every rank failed the operation the same way (a bug, a file none can read): that
    operation fails, as it would on one process; rank 0 logged its traceback."""

    logged = True

    def __init__(self, text: str):
        super().__init__(500, text)


@dataclass(frozen=True)
class RankInfo:
    """What one rank holds, measured on that rank (reported by rank 0 at start)."""

    rank: int
    pid: int
    host: str
    base_params: int  # parameters of the frozen base in this rank's shards
    base_bytes: int
    total_params: int  # the whole base
    rss_bytes: int  # this process's peak resident memory so far

    def line(self, world: int) -> str:
        share = 100 * self.base_params / max(self.total_params, 1)
        return (
            f"resource: rank {self.rank} of {world} (pid {self.pid} on {self.host}) holds "
            f"{self.base_params:,} of {self.total_params:,} base parameters ({share:.1f}%, "
            f"{self.base_bytes / 2**20:.1f} MiB), peak RSS {self.rss_bytes / 2**20:.0f} MiB"
        )


def peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024


# ------------------------------------------------------------------------- process group


@dataclass
class Group:
    """This process's place in the resource: the process group (the platform's backend:
    gloo on CPU, NCCL on CUDA), the 1-D mesh the base is sharded over, and a gloo group
    for commands (objects travel on CPU whatever the data backend)."""

    rank: int
    world: int
    mesh: Any
    control: Any
    timeout_s: float

    @classmethod
    def start(cls, *, backend: str, device_type: str, timeout_s: float) -> Group:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, timeout=timeout)
        world = dist.get_world_size()
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))
        control = dist.new_group(backend="gloo", timeout=timeout)
        return cls(dist.get_rank(), world, mesh, control, timeout_s)

    def broadcast(self, obj: Any = None) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def rank_info(group: Group, model: Any) -> RankInfo:
    from service.titan_backend import base_shard_sizes

    params, nbytes, total = base_shard_sizes(model)
    return RankInfo(
        group.rank, os.getpid(), socket.gethostname(), params, nbytes, total, peak_rss_bytes()
    )


# ---------------------------------------------------------------------- one call, any rank


def share(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share [lo, hi) of n datums (the first n % world ranks take
    one more; pure)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def run_local(backend: Any, name: str, args: tuple, kwargs: dict, rank: int, world: int) -> tuple:
    """Run one command on this rank's backend: ("ok", value) | ("user", status, message) |
    ("error", text). Never raises (a rank must always reach the gather)."""
    try:
        if name == "forward_backward":
            adapter, data, loss_fn, cfg = args
            lo, hi = share(len(data), rank, world)
            if lo == hi:  # nothing of this request: the same collectives, no contribution
                r = backend.forward_backward(
                    adapter, data[:1], loss_fn, cfg, contribute=False, **kwargs
                )
            else:
                r = backend.forward_backward(adapter, data[lo:hi], loss_fn, cfg, **kwargs)
            return ("ok", (r.outputs, r.metrics))
        value = getattr(backend, name)(*args, **kwargs)
        if name == "sample" and rank > 0:  # rank 0 answers; the others prove they agree
            value = [s.tokens.tolist() for s in value.sequences]
        return ("ok", value)
    except ServiceError as e:
        return ("user", e.status, e.message)
    except Exception as e:  # reported to rank 0, which decides (and logs, see combine)
        return ("error", f"{type(e).__name__}: {e}", traceback.format_exc())


def combine(name: str, results: list[tuple]) -> Any:
    """One answer from every rank's result, or the exception the operation fails with:
    the same refusal on every rank is that refusal (the resource goes on); ranks that
    disagree break the resource (ResourceBroken)."""
    kinds = {r[0] for r in results}
    if kinds == {"user"} and len({r[1:] for r in results}) == 1:
        raise ServiceError(results[0][1], results[0][2])
    if kinds == {"error"} and len({r[1] for r in results}) == 1:
        # The same failure on every rank (a bug both hit, a file all fail to read): that
        # operation fails, as it would on one process, and the resource goes on.
        log.error("resource: %s failed on every rank; rank 0's traceback:\n%s", name,
                  results[0][2].rstrip())  # fmt: skip
        raise FailedEverywhere(results[0][1])
    if kinds != {"ok"}:
        what = "; ".join(
            f"rank {i}: {'ok' if r[0] == 'ok' else r[-2 if r[0] == 'error' else -1]}"
            for i, r in enumerate(results)
        )
        raise ResourceBroken(f"the resource's ranks disagree on {name} ({what[:600]})")
    values = [r[1] for r in results]
    if name == "forward_backward":
        outputs = [o for outs, _ in values for o in outs]
        losses = {m["loss:sum"] for _, m in values}
        if len(losses) != 1:
            raise ResourceBroken(f"the resource's ranks disagree on the loss ({sorted(losses)})")
        return FwdBwdResult(outputs, values[0][1])
    if name == "sample":
        first: SampleResult = values[0]
        tokens = [s.tokens.tolist() for s in first.sequences]
        if any(v != tokens for v in values[1:]):
            raise ResourceBroken("the resource's ranks sampled different tokens")
        return first
    if name in ("optim_step", "snapshot", "load_sampler") and any(v != values[0] for v in values):
        raise ResourceBroken(f"the resource's ranks disagree on {name} ({values[:4]})")
    return values[0]


# ---------------------------------------------------------------------------- rank 0


class Dispatcher:
    """Rank 0's device thread: every command (and, idle, a ping) goes to every rank in one
    order; `call` waits for it at most `op_timeout_s`."""

    def __init__(
        self,
        group: Group,
        backend: Any,
        ranks: list[RankInfo],
        *,
        op_timeout_s: float,
        heartbeat_s: float = HEARTBEAT_S,
    ):
        self.group = group
        self.backend = backend
        self.ranks = ranks
        self.op_timeout_s = op_timeout_s
        self.heartbeat_s = heartbeat_s
        self.broken: str | None = None
        self.on_broken: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="resource-device", daemon=True)
        self._thread.start()

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self.broken is not None:
            raise ResourceBroken(self.broken)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((name, args, kwargs, fut))
        try:
            return fut.result(timeout=self.op_timeout_s)
        except concurrent.futures.TimeoutError:
            self._break(
                f"the resource did not finish {name} within {self.op_timeout_s:g} s "
                "(tools.serve --op-timeout): a rank is hung or far slower than the others"
            )
            raise ResourceBroken(self.broken or "") from None

    def probe(self, timeout_s: float) -> bool:
        """Whether every rank answers a ping within `timeout_s` (False: broken now, or
        busy past the timeout)."""
        try:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            if self.broken is not None:
                return False
            self._q.put((PING, (), {}, fut))
            fut.result(timeout=timeout_s)
            return True
        except (ServiceError, concurrent.futures.TimeoutError):
            return False

    def close(self, timeout_s: float = 30.0) -> None:
        """Tell every rank to exit (not when broken: the group may be unusable)."""
        if self._closed:
            return
        self._closed = True
        if self.broken is None:
            self._q.put((EXIT, (), {}, None))
            self._thread.join(timeout_s)

    def _break(self, reason: str) -> None:
        with self._lock:
            if self.broken is not None:
                return
            self.broken = reason
        log.error("resource: %s; the service is stopping", reason)
        if self.on_broken is not None:
            self.on_broken(reason)

    def _lost(self, name: str, e: BaseException) -> str:
        """The sentence for a collective that failed: which ranks of this host are gone."""
        host = socket.gethostname()
        local = [r for r in self.ranks if r.host == host and r.rank]
        # The peer's sockets close while it is still exiting: give it a moment to be gone.
        end = time.monotonic() + LOST_WAIT_S
        while True:
            gone = [r for r in local if not _alive(r.pid)]
            if gone or not local or time.monotonic() > end:
                break
            time.sleep(0.05)
        what = f"{type(e).__name__}: {_first_line(e)}"
        if gone:
            names = ", ".join(f"rank {r.rank} (pid {r.pid})" for r in gone)
            return (
                f"the resource lost {names} of {self.group.world} during {name} ({what}); "
                "checkpoints saved before stay loadable: restart the service"
            )
        return (
            f"a rank of the resource stopped answering during {name} ({what}); checkpoints "
            "saved before stay loadable: restart the service"
        )

    def _loop(self) -> None:
        while True:
            try:
                name, args, kwargs, fut = self._q.get(timeout=self.heartbeat_s)
            except queue.Empty:
                name, args, kwargs, fut = PING, (), {}, None
            if self.broken is not None:  # the group may be unusable: touch it no more
                if fut is not None:
                    fut.set_exception(ResourceBroken(self.broken))
                if name == EXIT:
                    return
                continue
            try:
                value = self._run(name, args, kwargs)
            except ResourceBroken as e:
                self._break(e.message)
                value = e
            except ServiceError as e:
                value = e
            except Exception as e:  # a collective failed: a rank is gone or the group broke
                self._break(self._lost(name, e))
                value = ResourceBroken(self.broken or "")
            if fut is not None:
                if isinstance(value, BaseException):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)
            if name == EXIT:
                return

    def _run(self, name: str, args: tuple, kwargs: dict) -> Any:
        g = self.group
        if name in RANK0_ONLY:
            return combine(name, [run_local(self.backend, name, args, kwargs, 0, g.world)])
        g.broadcast((name, args, kwargs))
        if name == EXIT:
            return None
        if name == PING:
            g.gather(None)
            return None
        mine = run_local(self.backend, name, args, kwargs, 0, g.world)
        results = g.gather(mine)
        assert results is not None
        return combine(name, results)


def _first_line(e: BaseException) -> str:
    """An exception's first line without gloo's source location prefix, cut to 160."""
    text = str(e).splitlines()[0] if str(e) else ""
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0][:160]  # gloo's generic hint


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class ResourceBackend:
    """The `service.backend.Backend` rank 0's service calls: each call runs on every rank
    of the resource (see the module docstring)."""

    def __init__(self, local: Any, dispatcher: Dispatcher):
        self.local = local
        self.dispatcher = dispatcher
        self.devices = local.devices  # the whole resource: world size x (one device each)
        self.max_lora_rank = local.max_lora_rank
        self.microbatch_tokens = local.microbatch_tokens
        self.generators = local.generators
        self.generator_tokens = local.generator_tokens

    def base_model(self) -> BaseModelInfo:
        return self.local.base_model()

    def create_adapter(self, adapter: str, spec: LoraSpec) -> None:
        if spec.seed is None:  # one seed for every rank's replica
            spec = replace(spec, seed=secrets.randbits(62))
        self.dispatcher.call("create_adapter", adapter, spec)

    def drop_adapter(self, adapter: str) -> None:
        self.dispatcher.call("drop_adapter", adapter)

    def forward_backward(
        self,
        adapter: str,
        data: list[Datum],
        loss_fn: str,
        loss_config: dict[str, float | str],
        *,
        forward_only: bool,
    ) -> FwdBwdResult:
        return self.dispatcher.call(
            "forward_backward", adapter, data, loss_fn, loss_config, forward_only=forward_only
        )

    def optim_step(self, adapter: str, params: AdamParams) -> dict[str, float]:
        return self.dispatcher.call("optim_step", adapter, params)

    def save_state(self, adapter: str, folder: Path) -> None:
        self.dispatcher.call("save_state", adapter, folder)

    def load_state(self, adapter: str, folder: Path, *, optimizer: bool) -> None:
        self.dispatcher.call("load_state", adapter, folder, optimizer=optimizer)

    def save_sampler_weights(self, adapter: str, folder: Path) -> None:
        self.dispatcher.call("save_sampler_weights", adapter, folder)

    def snapshot(self, adapter: str) -> str:
        return self.dispatcher.call("snapshot", adapter)

    def load_sampler(self, folder: Path, spec: LoraSpec) -> str:
        return self.dispatcher.call("load_sampler", folder, spec)

    def drop_sampler(self, handle: str) -> None:
        self.dispatcher.call("drop_sampler", handle)

    def sample(
        self,
        handle: str | None,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        *,
        prompt_logprobs: bool,
        topk_prompt_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> SampleResult:
        if params.seed is None:  # every rank must draw the same samples
            params = replace(params, seed=secrets.randbits(63))
        return self.dispatcher.call(
            "sample",
            handle,
            prompt,
            num_samples,
            params,
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
        )


# ------------------------------------------------------------------------- ranks > 0


def follow(group: Group, backend: Any) -> int:
    """A follower's life: run rank 0's commands until it says exit (0) or is gone (1)."""
    stop = threading.Event()

    def note(sig: int, frame: Any) -> None:
        # torchrun forwards SIGTERM/SIGINT to every rank; rank 0 decides when the resource
        # stops (a drain still needs this rank), so a follower only notes it.
        if not stop.is_set():
            stop.set()
            log.info("resource rank %d: %s received; following rank 0", group.rank,
                     signal.Signals(sig).name)  # fmt: skip

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)
    while True:
        try:
            name, args, kwargs = group.broadcast()
            if name == EXIT:
                return 0
            if name == PING:
                group.gather(None)
                continue
            group.gather(run_local(backend, name, args, kwargs, group.rank, group.world))
        except Exception as e:  # rank 0 (or another rank) is gone: nothing can run
            first = _first_line(e)
            print(
                f"error: resource rank {group.rank}: lost the resource's rank 0 "
                f"({type(e).__name__}: {first}); stopping",
                file=sys.stderr,
                flush=True,
            )
            return 1
