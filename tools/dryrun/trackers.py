"""What the dry run measures: torch's MemTracker and CommDebugMode extended to a whole step
(memory by category at the peak, collectives by the parallel axis of their group)."""

from __future__ import annotations

from typing import Any

from parallel.memory import GIB
from tools.dryrun.fake_world import PROPAGATING


def memory_tracker_class():
    """torch's MemTracker without its module tracker: ModTracker installs multi-grad hooks,
    which `torch.autograd.grad` refuses on leaves, and the pipeline schedules (zero-bubble
    input/weight split, backward metadata inference) call autograd.grad. Categories keep
    MemTracker's meaning: a module's parameters are tagged when it first runs (FSDP2's
    unsharded copies included), gradients by per-parameter hooks and after FSDP's
    reduce-scatter, optimizer state by the optimizer hooks; everything else allocated in
    backward is Temp, in forward (and recompute) Activation. Only the step's peak is kept
    (MemTracker's per-module snapshots cost O(modules) per op)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.utils.weak import WeakIdKeyDictionary

    class StepMemory(MemTracker):
        supports_higher_order_operators = True  # flex_attention is a higher-order op

        def __init__(self) -> None:
            super().__init__()
            self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
            self._hooks: list[Any] = []
            self._names: dict[int, str] = {}
            self._stack: list[Any] = []
            self.peak_where = ""
            # Post-training updates run in phases (tools.dryrun.posttrain): each phase's
            # peak, GiB, in order.
            self.phases: dict[str, float] = {}
            self.live_after: dict[str, float] = {}  # GiB live when each phase ended
            self._phase_peak = 0

        def end_phase(self, name: str) -> None:
            """Record the peak since the previous phase ended as `name`'s; the next phase
            starts from what is live now."""
            self.phases[name] = self._phase_peak / GIB
            self._phase_peak = sum(s[_TOTAL_KEY] for s in self._curr_mem_snap.values())
            self.live_after[name] = self._phase_peak / GIB

        def name_modules(self, parts: list[Any]) -> None:
            """Module names for `peak_where` (stage-qualified under PP)."""
            for i, part in enumerate(parts):
                for name, mod in part.named_modules():
                    self._names[id(mod)] = (f"part{i}." if len(parts) > 1 else "") + (
                        name or "model"
                    )

        def tag(self, t: Any, kind: str) -> None:
            ref = {"grad": _MemRefType.GRAD, "param": _MemRefType.PARAM}[kind]
            self._update_and_maybe_create_winfos(t, ref)

        def _module_post_forward(self, module, args, out) -> None:
            if self._stack and self._stack[-1] is module:
                self._stack.pop()

        def _module_pre_forward(self, module, args) -> None:
            self._stack.append(module)
            if module not in self._seen:
                self._seen[module] = True
                self._track_module_params_and_buffers(module, install_grad_hooks=False)
                # MemTracker's gradient hooks, on trained parameters only (a frozen LoRA
                # base has no gradient and refuses hooks).
                for p in module.parameters():
                    if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                        self._param_to_grad_hook_handles[p] = (
                            p.register_hook(lambda g: self.tag(g, "grad")),
                            p.register_post_accumulate_grad_hook(
                                lambda q: self.tag(q.grad, "grad")
                            ),
                        )
            else:  # FSDP2 swaps the unsharded parameters in at each call
                for p in module.parameters(recurse=False):
                    self._update_and_maybe_create_winfos(p, _MemRefType.PARAM)

        def __enter__(self):
            self._register_global_optimizer_hook()
            self._hooks = [
                register_module_forward_pre_hook(self._module_pre_forward),
                register_module_forward_hook(self._module_post_forward),
            ]
            self._track_resize()
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {d: s[_TOTAL_KEY] for d, s in self._peak_mem_snap.items()}
            self._depth = 1
            self._phase_peak = sum(s[_TOTAL_KEY] for s in self._curr_mem_snap.values())
            from torch._guards import active_fake_mode

            self._fake_mode_on_entry = active_fake_mode()
            from torch.utils._python_dispatch import TorchDispatchMode

            TorchDispatchMode.__enter__(self)
            return self

        def __exit__(self, *args) -> None:
            from torch.utils._python_dispatch import TorchDispatchMode

            self._deregister_param_and_optimizer_hooks()
            for h in self._hooks:
                h.remove()
            self._restore_resize()
            self._depth = 0
            TorchDispatchMode.__exit__(self, *args)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch
            from torch.distributed.tensor import DTensor
            from torch.utils._pytree import tree_map_only

            if any(t == DTensor for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            if PROPAGATING[0]:
                return func(*args, **kwargs)
            if func is torch.ops._c10d_functional.wait_tensor.default:
                return args[0]  # MemTracker's fix: the fake wait must not allocate
            res = func(*args, **kwargs)
            node = torch._C._current_autograd_node()
            if self._in_opt:
                ref = _MemRefType.OPT
            elif node is not None:
                ref = _MemRefType.TEMP
            else:
                ref = _MemRefType.ACT
            tree_map_only(torch.Tensor, lambda t: self._track(ref, t), res)
            now = sum(s[_TOTAL_KEY] for s in self._curr_mem_snap.values())
            self._phase_peak = max(self._phase_peak, now)
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                    top = self._names.get(id(self._stack[-1]), "?") if self._stack else "-"
                    self.peak_where = (
                        "optimizer step"
                        if self._in_opt
                        else f"backward ({node.name()}, in {top})"
                        if node is not None
                        else f"forward ({top})"
                    )
            return res

        def figures(self, which: str) -> dict[str, float]:
            snap = self._peak_mem_snap if which == "peak" else self._curr_mem_snap
            tot: dict[Any, int] = {}
            for dev_snap in snap.values():
                for k, v in dev_snap.items():
                    tot[k] = tot.get(k, 0) + v
            g = lambda *ks: sum(tot.get(k, 0) for k in ks) / GIB  # noqa: E731
            return {
                "total_gib": g(_TOTAL_KEY),
                "parameters_gib": g(_MemRefType.PARAM, _MemRefType.BUFFER),
                "gradients_gib": g(_MemRefType.GRAD),
                "optimizer_gib": g(_MemRefType.OPT),
                "activations_gib": g(_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH),
            }

    return StepMemory


def collective_counter_class():
    """CommDebugMode's counts, plus what a comparison with the perf model needs: the
    process group (-> mesh axis) and the bytes of each collective (torch's
    fake_collectives helpers), and point-to-point sends/receives (pipeline). Its module
    tracker is left out for the reason MemTracker's is (autograd.grad under PP)."""
    from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    kinds = {
        "allgather": "all_gather",
        "all_gather": "all_gather",
        "reduce_scatter": "reduce_scatter",
        "allreduce": "all_reduce",
        "all_reduce": "all_reduce",
        "alltoall": "all_to_all",
        "all_to_all": "all_to_all",
        "broadcast": "broadcast",
        "send": "p2p",
        "recv": "p2p",
        "isend": "p2p",
        "irecv": "p2p",
        "batch_p2p": "p2p",
    }

    def kind_of(func) -> str:
        name = func._overloadpacket.__name__.lstrip("_")
        for k in sorted(kinds, key=len, reverse=True):
            if name.startswith(k):
                return kinds[k]
        return name

    class Collectives(CommDebugMode):
        def __init__(self, axes: dict[frozenset[int], str]) -> None:
            super().__init__()
            self.axes = axes
            self.names: dict[str, str] = {}  # process group name -> axis
            self.by_axis: dict[tuple[str, str], list[float]] = {}

        def axis_of(self, pg) -> str:
            import torch.distributed as dist

            name = self.names.get(pg.group_name)
            if name is None:
                ranks = frozenset(dist.get_process_group_ranks(pg))
                name = self.axes.get(ranks, f"group of {len(ranks)}")
                self.names[pg.group_name] = name
            return name

        def __enter__(self):
            self.comm_counts.clear()
            TorchDispatchMode.__enter__(self)
            return self

        def __exit__(self, *args) -> None:
            TorchDispatchMode.__exit__(self, *args)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            if any(t == DTensor for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if isinstance(func, torch._ops.HigherOrderOperator):
                return out
            if func in collective_ops and func not in sync_ops:
                self.comm_counts[func._overloadpacket] += 1
                try:
                    pg = CollectiveOp.get_process_group(func, args)
                    axis = self.axis_of(pg)
                    nbytes = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs)
                except (TypeError, AttributeError, IndexError):
                    axis, nbytes = "?", 0
                row = self.by_axis.setdefault((axis, kind_of(func)), [0, 0.0])
                row[0] += 1
                row[1] += nbytes
            return out

    return Collectives


def axis_groups(layout, rank: int, ep: int = 1) -> dict[frozenset[int], str]:
    """The rank set of each parallel axis's group holding `rank`, named as the performance
    model names them (parallel.perf: tp, cp, fsdp = dp_shard x cp, dp_replicate, pp).
    Collectives are attributed by their group's ranks, not by torchtitan's mesh names:
    several of its meshes share ranks (batch, loss, dp_shard, fsdp), and FSDP2 and
    context parallelism create groups of their own."""
    import itertools

    from core.axes import MESH_ORDER

    order = [a.value for a in MESH_ORDER]
    shape = [getattr(layout, a) for a in order]
    coords, r = [], rank
    for size in reversed(shape):
        coords.append(r % size)
        r //= size
    coords.reverse()

    def group(axes: set[str]) -> frozenset[int]:
        ranges = [
            range(n) if a in axes else [c] for a, n, c in zip(order, shape, coords, strict=True)
        ]
        out = set()
        for point in itertools.product(*ranges):
            idx = 0
            for n, c in zip(shape, point, strict=True):
                idx = idx * n + c
            out.add(idx)
        return frozenset(out)

    named = [
        ("tp", {"tp"}),
        ("cp", {"cp"}),
        ("fsdp", {"dp_shard", "cp"}),
        ("dp_shard", {"dp_shard"}),
        ("dp_replicate", {"dp_replicate"}),
        ("dp", {"dp_replicate", "dp_shard"}),
        ("dp_cp", {"dp_replicate", "dp_shard", "cp"}),
        ("pp", {"pp"}),
        ("world", set(order)),
    ]
    out: dict[frozenset[int], str] = {}
    if ep > 1:
        # torchtitan's sparse mesh (pp, dp_replicate, efsdp, ep), ep innermost: an EP group
        # is `ep` consecutive ranks of the dp_shard x cp x tp block, efsdp strides over them.
        inner = layout.dp_shard * layout.cp * layout.tp
        base = rank - rank % inner
        pos = rank % inner
        out[frozenset(range(base + pos - pos % ep, base + pos - pos % ep + ep))] = "ep"
        efsdp = frozenset(base + pos % ep + k * ep for k in range(inner // ep))
        if len(efsdp) > 1:
            out[efsdp] = "efsdp"
    for name, axes in named:
        g = group(axes)
        if len(g) > 1:
            out.setdefault(g, name)
    return out
