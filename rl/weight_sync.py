"""The collective weight push's wire protocol: one module for the sender and the receiver.

The trainer imports it as `rl.weight_sync`; the vLLM engine process (rl/vllm_server.py, its own
venv) imports the same file as `weight_sync`, so it may import only the standard library and
torch. Both sides run the functions below, and nothing else decides what crosses the wire:

1. `rendezvous` + `join`: a torch c10d group over a TCPStore on 127.0.0.1 (the trainer's rank
   0 is rank 0 and the store's master, on a free port it reports; the engine's workers are
   ranks 1..world_size-1). Backend "nccl" on CUDA, "gloo" where a CPU stands in for it (the
   unit tests). `join` ends with a one-element all-reduce, so a broken link fails at set-up,
   not at the first push.
2. `manifest(tensors, version)`: the push as plain lists (names in send order, dtype names,
   shapes, bucket ranges, the weight version), sent to the engine over its socket.
3. `send` / `receive`: a header all-reduce (version, tensor count, bytes; every rank learns
   whether all agree, so a disagreement fails on every rank instead of hanging one), then one
   broadcast from rank 0 per bucket: consecutive tensors packed into one uint8 buffer of at
   most `bucket_bytes` (a larger tensor travels alone), each at a 16-byte aligned offset so a
   view of any dtype is legal. The receiver yields (name, view) pairs bucket by bucket, for
   the engine's `load_weights` to copy from.

Why torch's c10d and not vLLM's PyNcclCommunicator + StatelessProcessGroup (its RLHF
examples): the trainer's venv has no vLLM, so it cannot build a PyNcclCommunicator; torch is
in both venvs and its NCCL backend speaks the same NCCL broadcast. (docs/vllm.md "NCCL".)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # the engine is the trainer's own child process: same machine
ALIGN = 16  # bytes: every tensor's offset in a bucket (legal views of any dtype)
BUCKET_BYTES = 1 << 30  # vLLM's packed transfer's buffer size (1 GiB)
PREFIX = "titanscale-weight-sync"


class WeightSyncError(RuntimeError):
    """The two sides disagree about a push, or the group failed (one line)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def nbytes(dtype: str, shape: list[int]) -> int:
    n = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for d in shape:
        n *= d
    return n


def plan_buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """[start, end) ranges of consecutive tensors whose aligned sizes fit in `limit` bytes
    (a tensor larger than `limit` alone in its range)."""
    out: list[list[int]] = []
    start, used = 0, 0
    for i, s in enumerate(sizes):
        if i > start and used + _aligned(s) > limit:
            out.append([start, i])
            start, used = i, 0
        used += _aligned(s)
    if sizes:
        out.append([start, len(sizes)])
    return out


def manifest(
    tensors: Mapping[str, torch.Tensor], version: int, bucket_bytes: int = BUCKET_BYTES
) -> dict[str, Any]:
    """The push, as the engine is told it over its socket (plain lists, no tensors)."""
    names = list(tensors)
    dtypes = [str(tensors[n].dtype).removeprefix("torch.") for n in names]
    shapes = [list(tensors[n].shape) for n in names]
    sizes = [nbytes(d, s) for d, s in zip(dtypes, shapes, strict=True)]
    return {
        "version": int(version),
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "buckets": plan_buckets(sizes, bucket_bytes),
        "bytes": sum(sizes),
    }


def _layout(man: dict[str, Any], lo: int, hi: int) -> tuple[list[int], int]:
    """Offsets of tensors lo..hi-1 in their bucket, and the bucket's size."""
    offs, at = [], 0
    for i in range(lo, hi):
        offs.append(at)
        at += _aligned(nbytes(man["dtypes"][i], man["shapes"][i]))
    return offs, at


def rendezvous(rank: int, world_size: int, *, port: int = 0, timeout_s: float = 300.0) -> Any:
    """The group's TCPStore: rank 0 listens (port 0: a free one, read back as `.port`), the
    others connect to HOST:port."""
    return dist.TCPStore(
        HOST,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join(store: Any, backend: str, rank: int, world_size: int, timeout_s: float = 300.0) -> Any:
    """This rank's c10d backend object (no default process group: nothing global is set),
    checked by a one-element all-reduce on `device_for(backend)`. Blocks until every rank
    has joined (gloo at construction, NCCL at that first collective)."""
    prefixed = dist.PrefixStore(PREFIX, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    elif backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        raise ValueError(f"backend {backend!r}: expected 'nccl' or 'gloo'")
    probe = torch.ones(1, device=device_for(backend))
    group.allreduce([probe]).wait()
    if int(probe.item()) != world_size:
        raise WeightSyncError(f"weight-sync group check: {int(probe.item())} of {world_size}")
    return group


def device_for(backend: str) -> torch.device:
    """Where a rank's buffers live: its current CUDA device for NCCL, the CPU for gloo."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(group: Any, man: dict[str, Any], device: torch.device, side: str) -> None:
    """Every rank contributes (version, count, bytes) and its negation; one MAX all-reduce
    tells every rank whether all hold the same header (max == -max(-x) == min)."""
    h = torch.tensor(
        [man["version"], len(man["names"]), man["bytes"]], dtype=torch.int64, device=device
    )
    both = torch.cat([h, -h])
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    group.allreduce([both], opts).wait()
    hi, lo = both[:3].tolist(), (-both[3:]).tolist()
    if hi != lo:
        raise WeightSyncError(
            f"{side}: the ranks disagree about the push (version, tensors, bytes): "
            f"between {lo} and {hi}, this rank {h.tolist()}"
        )


def _broadcast(group: Any, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([buf], opts).wait()


def send(group: Any, tensors: Mapping[str, torch.Tensor], man: dict[str, Any]) -> int:
    """Rank 0: the manifest's tensors, bucket by bucket; returns the bytes broadcast. Each
    tensor is checked against the manifest first (a mismatch would desynchronise the ranks)."""
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    _agree(group, man, device, "sender")
    sent = 0
    for lo, hi in man["buckets"]:
        offs, size = _layout(man, lo, hi)
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        for i, off in zip(range(lo, hi), offs, strict=True):
            name = man["names"][i]
            t = tensors[name]
            if (
                str(t.dtype).removeprefix("torch.") != man["dtypes"][i]
                or list(t.shape) != man["shapes"][i]
            ):
                raise WeightSyncError(f"sender: {name} is {t.dtype} {list(t.shape)}, not as sent")
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[off : off + flat.numel()].copy_(flat)
        _broadcast(group, buf)
        sent += size
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # buffers may be freed after this
    return sent


def receive(
    group: Any, man: dict[str, Any], device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks > 0: (name, tensor) in the manifest's order, views of each received bucket
    (valid until the next bucket arrives: the consumer copies them)."""
    _agree(group, man, device, "receiver")
    for lo, hi in man["buckets"]:
        offs, size = _layout(man, lo, hi)
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        _broadcast(group, buf)
        for i, off in zip(range(lo, hi), offs, strict=True):
            dtype = getattr(torch, man["dtypes"][i])
            n = nbytes(man["dtypes"][i], man["shapes"][i])
            yield man["names"][i], buf[off : off + n].view(dtype).view(man["shapes"][i])


def receive_into(
    group: Any,
    man: dict[str, Any],
    device: torch.device,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
) -> int:
    """`receive` handed to `load` (vLLM's reload_weights), then drained: a loader that
    stopped early, or raised (a name the model lacks), must not leave the sender waiting in
    a broadcast; after a loader's error the remaining buckets are received and dropped, so
    both sides end the push together and the group stays usable. Returns the count."""
    it = receive(group, man, device)
    count = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for pair in it:
            count += 1
            yield pair

    try:
        load(counted())
    except Exception:
        for _ in it:  # the rest of the push, dropped; then the loader's error
            pass
        raise
    for _ in it:  # whatever the loader left
        count += 1
    if count != len(man["names"]):
        raise WeightSyncError(f"receiver: {count} of {len(man['names'])} tensors received")
    return count
