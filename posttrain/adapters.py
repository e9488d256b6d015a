"""Several LoRA adapters on one frozen base model in one job (`[[adapters]]`).

One base (torchtitan's model, LoRA converter applied, every base weight frozen) loaded from
`checkpoint.load_from`; per adapter its A/B tensors (posttrain.lora.AdapterWeights), data
stream (SFT-rendered, bfd-packed), step engine (runtime.steps: torchtitan's AdamW and the
recipe's LR schedule at its lr / warmup / steps, the token budget, the non-finite guard),
verified checkpoints (<output_dir>/adapters/<name>/step-N) and metrics (metrics.jsonl
records carry "adapter"; TensorBoard, W&B). Rounds run under runtime.step_guard.StepGuard.
Schedules (`finetune.adapter_schedule`, benchmarks/adapters.md): "turns" binds one adapter
at a time (posttrain.lora.bind_adapter, no copy): each adapter's arithmetic is exactly its
own; "batched" runs every adapter's rows as one batch with a segmented multi-LoRA matmul,
on a StepEngine over all their tensors (the same token budget, microbatches and non-finite
guard as "turns"), then each steps its own optimizer.

Several processes: data parallel over a 1-D mesh; the frozen base FSDP2-sharded, the
adapters replicated (`ignored_params`) with their gradients summed once per step (their loss
is normalised by the global trained-token count). tp/cp/pp > 1 are refused at launch.
docs/sft.md and docs/steps.md hold the details.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.atomic import write_json_atomic
from core.errors import ConfigError
from data.chat import ChatRenderer, make_renderer
from data.packing import IGNORE_INDEX, LOSS_WEIGHTS
from posttrain.adapter_checks import resume_problem
from posttrain.evaluate import exact_match, load_examples
from posttrain.lora import (
    AdapterWeights,
    bind_adapter,
    export_adapter,
    init_adapter,
    lora_modules,
)
from recipe.loader import blame
from recipe.schema import AdapterSection, Recipe
from runtime.build import recipe_checkpointer, recipe_optimizer
from runtime.rows import Rows
from runtime.stateful import Attrs
from runtime.step_guard import StepGuard
from runtime.steps import StepEngine


@dataclass
class AdapterState:
    spec: AdapterSection
    weights: AdapterWeights
    engine: StepEngine
    checkpointer: Any  # runtime.checkpoint.AtomicCheckpointManager
    stream: Any
    batches: Iterator[tuple[torch.Tensor, ...]]
    batch_size: int
    step: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    times: list[float] = field(default_factory=list)  # wall seconds of each round
    cpu_times: list[float] = field(default_factory=list)  # this process's CPU seconds
    heldout: list[dict[str, Any]] = field(default_factory=list)

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return self.weights.params

    @property
    def done(self) -> bool:
        return self.step >= self.spec.steps


class _RowGroups:
    """Which adapter each row of a batched round belongs to (rows grouped contiguously by
    adapter), and the group sizes of the rows the model is running now: the whole round,
    or the microbatch `_GroupedRows.span` cut last."""

    def __init__(self, sizes: list[int]) -> None:
        self.owner = [g for g, n in enumerate(sizes) for _ in range(n)]
        self.sizes = list(sizes)

    def select(self, lo: int, hi: int) -> None:
        part = self.owner[lo:hi]
        self.sizes = [part.count(g) for g in range(len(self.sizes))]


@dataclass
class _GroupedRows(Rows):
    """Rows of a batched round: cutting a microbatch (StepEngine cuts every microbatch with
    `span`, just before running it) points the row-group linears at its rows."""

    groups: _RowGroups | None = None

    def span(self, lo: int, hi: int) -> Rows:
        assert self.groups is not None
        self.groups.select(lo, hi)
        return super().span(lo, hi)


class _RowGroupLinear(nn.Module):
    """y = x W_g^T for the rows of group g (the sizes of the rows being run: `_RowGroups`)."""

    def __init__(self, weights: list[torch.Tensor], groups: _RowGroups) -> None:
        super().__init__()
        self.weights, self.groups = weights, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.groups.sizes, dim=0)
        return torch.cat([F.linear(p, w) for p, w in zip(parts, self.weights, strict=True)])


def _batches(stream: Any, batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    it = iter(stream)
    while True:
        rows = [next(it) for _ in range(batch_size)]
        if any(LOSS_WEIGHTS in r[0] for r in rows):
            # Weight 0 is applied (the stream masks those labels); other weights need the
            # weighted loss of the Trainer path (runtime.loss), not wired here yet.
            raise ConfigError(
                "[[adapters]] jobs support SFT record weights 0 and 1 only; train weighted "
                "data without [[adapters]]",
                key="data.source",
            )
        yield (
            torch.stack([r[0]["input"] for r in rows]),
            torch.stack([r[0]["positions"] for r in rows]),
            torch.stack([r[1] for r in rows]),
        )


def _saved_adapter(path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]] | None:
    """(adapter tensor shapes, data-position fingerprint) of the DCP checkpoint `path`, read
    before it is loaded (metadata, and the one small JSON item; no code run from the file).
    None when they cannot be read: the checkpoint manager's verification reports that."""
    from torch.distributed.checkpoint.api import CheckpointException

    from runtime.checkpoint import single_process, verify_checkpoint
    from runtime.safe_load import SafeFileSystemReader, safe_dcp_load

    if verify_checkpoint(path, checksums=False):  # damaged: the manager's to report
        return None
    try:
        md = SafeFileSystemReader(path).read_metadata()
        shapes = {
            k: tuple(m.size)
            for k, m in md.state_dict_metadata.items()
            if ".lora_" in k and not k.startswith(("optimizer", "lr_scheduler"))
            and hasattr(m, "size")
        }  # fmt: skip
        sd: dict[str, Any] = {"dataloader": {"json": ""}}
        with single_process():
            safe_dcp_load(sd, path, no_dist=True)
        data = json.loads(sd["dataloader"]["json"]).get("fingerprint", {})
    except (Exception, CheckpointException):  # DCP's is a BaseException; unreadable is
        # damage, which the manager's verified load reports (or falls back past)
        return None
    return shapes, data


def load_base(model: nn.Module, path: str, *, file: str | None = None) -> None:
    """Model weights from a DCP checkpoint folder (a base: adapter keys absent are skipped).

    The checkpoint must hold exactly the base's tensors (runtime.checkpoint_fit): more
    layers, other shapes or adapter weights that would be dropped are one line naming
    checkpoint.load_from (ConfigError), before any tensor is read."""
    from core.errors import ConfigError
    from runtime.checkpoint_fit import check_fits, expected_from_module
    from runtime.safe_load import drop_absent_adapter_keys, safe_dcp_load

    expected = expected_from_module([model])
    expected.model = {k: v for k, v in expected.model.items() if ".lora_" not in k}
    problem = check_fits(path, expected, model_only=True)
    if problem:
        raise ConfigError(
            f"{path} does not fit the model: {problem}", file=file, key="checkpoint.load_from"
        )
    sd = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    sd = drop_absent_adapter_keys(sd, path)
    safe_dcp_load(sd, path)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad = [k for k in missing if ".lora_" not in k]
    if bad or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {bad[:3]}")


def shard_base(model: nn.Module, mesh: Any) -> None:
    """FSDP2 over the frozen base: every transformer block, then the root (embeddings, norm,
    output). The LoRA tensors stay out (`ignored_params`): they are replicated and swapped per
    adapter, which FSDP's flat parameter groups would not allow. No reduce-scatter ever runs
    (nothing FSDP manages has a gradient); each block costs one all-gather in forward and one
    in backward (reshard_after_forward)."""
    from torch.distributed.fsdp import fully_shard

    ignored = {p for _, m in lora_modules(model) for p in (m.lora_a.weight, m.lora_b.weight)}
    layers = model.layers
    blocks = layers.values() if isinstance(layers, nn.ModuleDict) else layers
    assert isinstance(blocks, Iterable)
    for block in blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)


class AdapterJob:
    """The frozen base + every adapter of a recipe; `train()` runs them all."""

    def __init__(
        self,
        recipe: Recipe,
        model_config: Any,
        *,
        tokenizer_path: str,
        state_dict_adapter: Any = None,
        device: str = "cpu",
        schedule: str = "turns",
        mesh: Any = None,
        microbatch_tokens: int = 0,
    ) -> None:
        """`mesh`: a 1-D DeviceMesh over the job's processes (None: one process).
        `microbatch_tokens`: the token budget (0: training.microbatch_tokens, else every
        adapter's rows in one microbatch)."""
        self._init_base(recipe, model_config, device=device, schedule=schedule, mesh=mesh,
                        microbatch_tokens=microbatch_tokens)  # fmt: skip
        self.state_dict_adapter = state_dict_adapter
        self.tokenizer_path = tokenizer_path
        self.renderer: ChatRenderer = make_renderer(tokenizer_path, recipe.data.chat_template)
        self.out = recipe.output_dir
        os.makedirs(self.out, exist_ok=True)
        self.adapters = [self._new_adapter(spec) for spec in recipe.adapters]
        from runtime.metrics import StepMetrics

        # Rank 0 writes metrics, the summary and exports; the others compute the same values.
        self.metrics = StepMetrics(recipe.metrics, self.out, rank=self.rank,
                                   run_name=recipe.job.name)  # fmt: skip
        self._eval_sets = {
            a.spec.name: load_examples(a.spec.eval_source) if a.spec.eval_source else []
            for a in self.adapters
        }

    def _init_base(self, recipe: Recipe, model_config: Any, *, device: str, schedule: str,
                   mesh: Any, microbatch_tokens: int, load: bool = True) -> None:  # fmt: skip
        """The frozen base on its device (FSDP-sharded over `mesh`), the schedule and the token
        budget: what every adapter steps on (`load` False: the base's weights are not read,
        tools.dryrun.posttrain's fake tensors)."""
        if schedule not in ("turns", "batched"):
            raise ValueError(f"schedule must be 'turns' or 'batched', got {schedule!r}")
        self.recipe = recipe
        self.model_config = model_config
        self.device = torch.device(device)
        self.schedule = schedule
        tr = recipe.training
        rows = max(a.local_batch_size or tr.local_batch_size for a in recipe.adapters)
        self.microbatch_tokens = microbatch_tokens or tr.microbatch_tokens or rows * tr.seq_len
        torch.manual_seed(tr.seed)
        with torch.device(self.device):
            self.model = model_config.build()
            self.model.init_states()
        if load and recipe.checkpoint.load_from:
            load_base(self.model, recipe.checkpoint.load_from, file=recipe.source)
        self.model.train()
        for p in self.model.parameters():  # the converter froze them; make it a guarantee
            p.requires_grad_(False)
        self.mesh = mesh if mesh is not None and mesh.size() > 1 else None
        self.group = self.mesh.get_group() if self.mesh is not None else None
        self.rank = self.mesh.get_local_rank() if self.mesh is not None else 0
        self.world = self.mesh.size() if self.mesh is not None else 1
        if self.mesh is not None:
            shard_base(self.model, self.mesh)
        self.scale = recipe.lora.alpha / recipe.lora.rank

    def _new_adapter(self, spec: AdapterSection) -> AdapterState:
        from torchtitan.components.tokenizer import HuggingFaceTokenizer

        from data.loader import PackedStream

        tr, d = self.recipe.training, self.recipe.data
        weights, opt, sched, engine = self._adapter_engine(spec)
        stream = PackedStream(
            source=spec.source,
            tokenizer=HuggingFaceTokenizer(tokenizer_path=self.tokenizer_path),
            seq_len=tr.seq_len,
            dp_rank=self.rank,
            dp_world_size=self.world,
            packing=d.packing,
            window=d.window,
            bad_records=d.bad_records,
            renderer=make_renderer(self.tokenizer_path, d.chat_template),
            truncate=d.truncate,
        )
        bs = spec.local_batch_size or tr.local_batch_size
        a = AdapterState(spec, weights, engine, None, stream, _batches(stream, bs), bs)
        folder = os.path.abspath(os.path.join(self.out, "adapters", spec.name))
        a.checkpointer = recipe_checkpointer(
            self.recipe, folder, steps=spec.steps, model_parts=[weights], optimizers=opt,
            lr_schedulers=sched, states={"train_state": Attrs(a, "step", "tokens", "trained_tokens")},
            dataloader=Attrs(a, json_of="stream",
                             on_load=lambda: setattr(a, "batches", _batches(a.stream, bs))),
        )  # fmt: skip
        return a

    def _adapter_engine(self, spec: AdapterSection) -> tuple[AdapterWeights, Any, Any, StepEngine]:
        """An adapter's weights (its seed), the recipe's optimizer and schedule at its lr /
        warmup / steps, and its step engine (also what tools.dryrun.posttrain steps)."""
        weights = init_adapter(self.model, spec.seed)
        opt, sched = recipe_optimizer(self.recipe, weights, lr=spec.lr,
                                      warmup_steps=spec.warmup_steps, steps=spec.steps)  # fmt: skip
        engine = StepEngine(self.model, opt, sched, microbatch_tokens=self.microbatch_tokens,
                            max_norm=self.recipe.training.max_norm, replicated_group=self.group,
                            named_params=list(weights.named_parameters()),
                            dp_group=self.group, label=f"adapter {spec.name}")  # fmt: skip
        return weights, opt, sched, engine

    # -- one step --------------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            torch.distributed.all_reduce(t, group=self.group)
        return t

    def _ce(self, labels: torch.Tensor) -> tuple[Any, int]:
        """The loss of a batch's logprobs: this rank's summed cross-entropy over the trained
        tokens of every rank (the global count, one scalar all-reduce), so the ranks'
        losses add up to the single-process token mean."""
        mask = (labels != IGNORE_INDEX).float()
        n = int(self._all_reduce(mask.sum().to(torch.float64)).item())
        # -log p(target) per token is runtime.steps' (the one cross-entropy); summed here.
        return (lambda lp: -(lp * mask).sum() / max(n, 1)), n

    def _global(self, loss: float) -> float:
        return float(self._all_reduce(torch.tensor(loss, dtype=torch.float64, device=self.device)))

    def _step_turns(self, active: list[AdapterState]) -> list[tuple[AdapterState, float, float]]:
        out = []
        for a in active:
            x, pos, y = (t.to(self.device) for t in next(a.batches))
            bind_adapter(self.model, a.weights)
            loss_fn, n = self._ce(y)
            loss, _ = a.engine.forward_backward(Rows(x, y, pos), loss_fn)
            a.tokens += y.numel() * self.world
            a.trained_tokens += n
            out.append((a, self._global(loss), a.engine.optim_step()))
        return out

    def _step_batched(self, active: list[AdapterState]) -> list[tuple[AdapterState, float, float]]:
        """One round on a StepEngine over every active adapter's tensors: the rows of all
        adapters in one batch, each LoRA linear a segmented multi-LoRA matmul, the round's
        loss the sum of the adapters' own losses (so each adapter's gradient is its own
        loss's). The engine prices it (microbatches under `microbatch_tokens`, the same
        count on every rank) and guards it (a non-finite loss or d loss / d logprobs refuses
        the round before any optimizer runs); then each adapter steps its own optimizer."""
        data = [[t.to(self.device) for t in next(a.batches)] for a in active]
        x, pos, y = (torch.cat([d[i] for d in data]) for i in range(3))
        sizes = [d[0].shape[0] for d in data]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        ces = [self._ce(d[2]) for d in data]

        def round_loss(lp: torch.Tensor) -> torch.Tensor:
            return torch.stack([ce(lp[o : o + n]) for (ce, _), o, n in
                                zip(ces, offsets, sizes, strict=True)]).sum()  # fmt: skip

        groups = _RowGroups(sizes)
        engine = StepEngine(self.model, None, microbatch_tokens=self.microbatch_tokens,
                            named_params=[(f"{a.spec.name}/{n}", p) for a in active
                                          for n, p in a.params.items()],
                            dp_group=self.group,
                            label="adapters " + ", ".join(a.spec.name for a in active))  # fmt: skip
        mods = list(lora_modules(self.model))
        saved = [(m.lora_a, m.lora_b) for _, m in mods]
        try:
            for name, m in mods:
                m.lora_a = _RowGroupLinear(
                    [a.params[f"{name}.lora_a.weight"] for a in active], groups
                )
                m.lora_b = _RowGroupLinear(
                    [a.params[f"{name}.lora_b.weight"] for a in active], groups
                )
            _, lp = engine.forward_backward(_GroupedRows(x, y, pos, groups=groups), round_loss)
        finally:
            for (_, m), (la, lb) in zip(mods, saved, strict=True):
                m.lora_a, m.lora_b = la, lb
        out = []
        for a, d, (ce, n), o, k in zip(active, data, ces, offsets, sizes, strict=True):
            a.tokens += d[2].numel() * self.world
            a.trained_tokens += n
            loss = float(ce(lp[o : o + k]).detach())
            out.append((a, self._global(loss), a.engine.optim_step()))
        return out

    # -- evaluation, checkpoints -----------------------------------------------------------
    def heldout(self, a: AdapterState) -> dict[str, Any] | None:
        examples = self._eval_sets[a.spec.name]
        if not examples:
            return None
        bind_adapter(self.model, a.weights)
        t0 = time.perf_counter()
        res = exact_match(
            self.model, self.renderer, examples, device=self.device, pad_id=a.stream.pad_id
        )
        rec = {"event": "heldout", "adapter": a.spec.name, "step": a.step, **res,
               "eval_s": time.perf_counter() - t0}  # fmt: skip
        a.heldout.append(rec)
        self.metrics.log(rec, self._metrics_step(a), tag=f"{a.spec.name}/heldout")
        return rec

    def save(self, a: AdapterState) -> bool:
        """A full, resumable checkpoint of the adapter's current step (collective)."""
        from launch.stop_request import save_full_checkpoint

        return save_full_checkpoint(a.checkpointer, a.step)

    def _save_all(self, adapters: list[AdapterState]) -> bool:
        return all([self.save(a) for a in adapters])

    def resume(self, a: AdapterState) -> bool:
        """Load the adapter's newest verified checkpoint (falling back past damaged ones),
        after checking that it is this adapter: another rank, other targets or another data
        source is refused in one line naming the key (a misfit is never taken for damage,
        so nothing is moved aside)."""
        path = a.checkpointer.newest_step_folder()
        saved = _saved_adapter(path) if path else None
        if saved is not None:
            problem = resume_problem(
                adapter=a.spec.name,
                index=self.recipe.adapters.index(a.spec),
                checkpoint=path,
                saved_shapes=saved[0],
                shapes={k: tuple(v.shape) for k, v in a.params.items()},
                saved_data=saved[1],
                data=a.stream.fingerprint,
            )
            if problem:  # addressed to where the changed value came from (a --set, a base)
                raise blame(ConfigError(problem[1], file=self.recipe.source, key=problem[0]),
                            self.recipe)  # fmt: skip
        return bool(a.checkpointer.load(step=-1))

    def export(self, a: AdapterState) -> str:
        bind_adapter(self.model, a.params)
        return export_adapter(self.model, self.recipe, a.spec.name, model_config=self.model_config,
                              state_dict_adapter=self.state_dict_adapter,
                              tokenizer_dir=self.tokenizer_path)  # fmt: skip

    # -- the loop --------------------------------------------------------------------------
    def _start(self) -> None:
        for a in self.adapters:
            if self.recipe.checkpoint.resume:
                self.resume(a)
        from core.launch_env import launch_env

        self.metrics.write_event(
            "start",
            resumed_from={a.spec.name: a.step for a in self.adapters},
            restart_count=launch_env().restart_count,
            world_size=self.world,
            wall=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )
        for a in self.adapters:
            if a.step == 0:
                self.heldout(a)

    def _metrics_step(self, a: AdapterState) -> int:
        """TensorBoard's and W&B's x axis: the adapters' steps share one monotonic counter
        (W&B drops a record whose step goes back); metrics.jsonl keeps each one's own."""
        self._tb_step = max(getattr(self, "_tb_step", 0), a.step)
        return self._tb_step

    def _log(self, a: AdapterState, loss: float, norm: float, dt: float, dc: float, n: int) -> None:
        seq_len = self.recipe.training.seq_len
        rec = {
            "adapter": a.spec.name,
            "step": a.step,
            "loss": loss,
            "grad_norm": norm,
            "lr": a.engine.lr(),
            "tokens": a.tokens,
            "trained_tokens": a.trained_tokens,
            "round_s": dt,
            "round_cpu_s": dc,
            "adapters_in_round": n,
            # this adapter's tokens over every rank (global batch x seq_len)
            "tokens_per_sec": a.batch_size * self.world * seq_len / dt,
            "tokens_per_sec_per_rank": a.batch_size * seq_len / dt,
        }
        self.metrics.log(rec, self._metrics_step(a), tag=a.spec.name)

    def train(self, *, export: bool = True) -> dict[str, Any]:
        log_every = self.recipe.metrics.log_every
        eval_every = self.recipe.finetune.eval_every
        step_fn = self._step_turns if self.schedule == "turns" else self._step_batched
        guard = StepGuard(
            self.recipe, groups={"dp_shard": list(range(self.world))}, device=self.device
        )
        stopped = False
        try:
            self._start()
            rounds = 0
            while not stopped:
                active = [a for a in self.adapters if not a.done]
                if not active:
                    break
                rounds += 1
                t0, c0 = time.perf_counter(), time.process_time()
                with guard.step(rounds):
                    results = step_fn(active)
                dt = time.perf_counter() - t0  # the round: one step of every active adapter
                # CPU seconds of this process (all its threads): on a CPU shared with other
                # jobs, time slicing inflates wall time but not this (benchmarks/adapters.md).
                dc = time.process_time() - c0
                for a, loss, norm in results:
                    a.step += 1
                    # Each adapter advances by one step per round: its tokens/s is its tokens
                    # over the round's wall time (the job's total is the sum over adapters).
                    a.times.append(dt)
                    a.cpu_times.append(dc)
                    if a.step % log_every == 0 or a.done:
                        self._log(a, loss, norm, dt, dc, len(results))
                    # interval saves (the manager's interval) and the last step's full save
                    a.checkpointer.save(a.step, last_step=a.done)
                    if eval_every and a.step % eval_every == 0 and not a.done:
                        self.heldout(a)
                # The launcher asks (time limit near): a resumable checkpoint of every
                # unfinished adapter, then the job exits for its requeue.
                todo = [a for a in self.adapters if not a.done]
                if guard.stop_here(rounds, partial(self._save_all, todo)):
                    self.metrics.write_event("stopped", round=rounds,
                                             steps={a.spec.name: a.step for a in self.adapters})  # fmt: skip
                    stopped = True
        finally:
            guard.close()
            for a in self.adapters:
                a.checkpointer.maybe_wait_for_saving()
        summary: dict[str, Any] = {"schedule": self.schedule, "adapters": {}, "stopped": stopped}
        skip = self.recipe.metrics.summary_skip_steps
        seq_len = self.recipe.training.seq_len
        for a in self.adapters:
            if not stopped:
                self.heldout(a)
            times = a.times[skip:] or a.times
            cpu = a.cpu_times[skip:] or a.cpu_times
            round_tokens = a.batch_size * self.world * seq_len
            summary["adapters"][a.spec.name] = {
                "steps": a.step,
                "tokens": a.tokens,
                "trained_tokens": a.trained_tokens,
                "tokens_per_sec": round_tokens * len(times) / sum(times) if times else 0.0,
                "tokens_per_sec_per_rank": round_tokens * len(times) / sum(times) / self.world
                if times
                else 0.0,
                # this process's tokens per CPU second of this process
                "tokens_per_cpu_sec": round_tokens / self.world * len(cpu) / sum(cpu)
                if sum(cpu)
                else 0.0,
                "heldout": a.heldout,
                "export": self.export(a) if export and not stopped else None,
            }
        summary["world_size"] = self.world
        if self.rank == 0:
            write_json_atomic(os.path.join(self.out, "adapters_summary.json"), summary)
        self.close()
        return summary

    def close(self) -> None:
        self.metrics.close()
        for a in self.adapters:
            a.checkpointer.close()
