"""Several LoRA adapters on one frozen base model in one job (`[[adapters]]`).

One base model is built once (torchtitan's model with its LoRA converter applied: every base
weight frozen) and loaded from `checkpoint.load_from`. Each adapter owns its A/B tensors,
its AdamW state and LR schedule, its data stream (data.loader.PackedStream over its own
source, SFT-rendered and bfd-packed), its metrics (metrics.jsonl records carry "adapter"),
its checkpoints (<output_dir>/adapters/<name>/step-N) and its exports (PEFT folder, merged
model on request). The base never receives a gradient and never changes.

How a step serves them (`finetune.adapter_schedule`, measured in benchmarks/adapters.md):
- "turns": adapters take turns; each turn binds one adapter's tensors into the LoRA layers
  (posttrain.lora.bind_adapter, no copy) and runs its own forward/backward/step. Each
  adapter's arithmetic is then exactly what it would be alone (bit-identical trajectories).
- "batched": one forward over the rows of every active adapter together, each LoRA layer
  applying adapter k's A and B to adapter k's rows (a segmented multi-LoRA matmul); the loss
  is the sum of per-adapter mean losses, so one backward gives every adapter its own
  gradient, then each steps its own optimizer. Equal to "turns" up to float rounding.

Several processes (torchrun, gloo on CPU, NCCL on CUDA): data parallel over a 1-D mesh. The
frozen base is sharded with FSDP2 (each rank holds 1/N of it, all-gathered per block in
forward and backward); the adapters' tensors are left out of FSDP (`ignored_params`) and
replicated, since binding another adapter swaps them per turn. Each rank takes its rows of
every adapter's global packed stream; its loss is its summed cross-entropy over the global
count of trained tokens, so one all-reduce (SUM) of each adapter's gradients (one flat buffer
of the adapter's size: ~150 MB fp32 for r = 16 on every linear of Llama 3 8B) gives every
rank the single-process gradient and the replicated AdamW steps stay identical. Rank 0 writes metrics, checkpoints and exports. tp, cp and pp > 1 are refused at
launch (posttrain.jobs.check): swapping adapters under TP/PP sharding is not implemented.
The Trainer path (finetune.mode with no [[adapters]]) covers every layout for one adapter.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.errors import ConfigError
from data.chat import ChatRenderer, make_renderer
from data.loader import _plain  # the loader's JSON encoding of its own state
from data.packing import LOSS_WEIGHTS
from posttrain.adapter_checks import resume_problem
from posttrain.evaluate import exact_match, load_examples, model_logits
from posttrain.lora import (
    adapter_state,
    base_state,
    bind_adapter,
    export_merged,
    export_peft,
    init_adapter,
    lora_modules,
)
from recipe.loader import blame
from recipe.schema import AdapterSection, Recipe

IGNORE_INDEX = -100


def lr_factor(step: int, *, warmup: int, steps: int) -> float:
    """Linear warmup over `warmup` steps, then linear decay to 10% at `steps` (step 0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(steps - warmup, 1)
    return 1.0 - 0.9 * (step - warmup) / span


@dataclass
class AdapterState:
    spec: AdapterSection
    params: dict[str, nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
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
    def done(self) -> bool:
        return self.step >= self.spec.steps


class _RowGroupLinear(nn.Module):
    """y = x W_g^T for the rows of group g (rows grouped contiguously by adapter)."""

    def __init__(self, weights: list[torch.Tensor], sizes: list[int]) -> None:
        super().__init__()
        self.weights, self.sizes = weights, sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.sizes, dim=0)
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


def _load_adapter_checkpoint(path: str, file: str | None) -> dict[str, Any]:
    """adapter.pt (plain tensors and JSON: weights_only); one line when it does not read."""
    try:
        st = torch.load(path, weights_only=True)
        if not isinstance(st, dict) or not isinstance(st.get("params"), dict):
            raise ValueError("no adapter tensors in it")
        json.loads(st["data"])
        return st
    except Exception as e:  # truncated, not a torch file, fields missing
        raise ConfigError(
            f"adapter checkpoint {path} is not readable ({type(e).__name__}: "
            f"{str(e).splitlines()[0].split('. ')[0][:160] if str(e) else ''}); move it away "
            "to start over",
            file=file,
            key="checkpoint.resume",
        ) from None


def load_base(model: nn.Module, path: str, *, file: str | None = None) -> None:
    """Model weights from a DCP checkpoint folder (a base: adapter keys absent are skipped).

    The checkpoint must hold exactly the base's tensors (runtime.checkpoint_fit): more
    layers, other shapes or adapter weights that would be dropped are one line naming
    checkpoint.load_from (ConfigError), before any tensor is read."""
    from core.errors import ConfigError
    from runtime.checkpoint import drop_absent_adapter_keys, safe_dcp_load
    from runtime.checkpoint_fit import check_fits, expected_from_module

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
    ) -> None:
        """`mesh`: a 1-D DeviceMesh over the job's processes (None: one process)."""
        if schedule not in ("turns", "batched"):
            raise ValueError(f"schedule must be 'turns' or 'batched', got {schedule!r}")
        self.recipe = recipe
        self.model_config = model_config
        self.state_dict_adapter = state_dict_adapter
        self.device = torch.device(device)
        self.schedule = schedule
        self.tokenizer_path = tokenizer_path
        tr = recipe.training
        torch.manual_seed(tr.seed)
        with torch.device(self.device):
            self.model = model_config.build()
            self.model.init_states()
        if recipe.checkpoint.load_from:
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
        self.renderer: ChatRenderer = make_renderer(tokenizer_path, recipe.data.chat_template)
        self.adapters = [self._new_adapter(spec) for spec in recipe.adapters]
        self.out = recipe.output_dir
        os.makedirs(self.out, exist_ok=True)
        # Rank 0 writes metrics, checkpoints and exports; the others compute the same values.
        self._jsonl = (
            open(os.path.join(self.out, "metrics.jsonl"), "a", buffering=1)  # noqa: SIM115
            if self.rank == 0
            else open(os.devnull, "w")  # noqa: SIM115
        )
        self._eval_sets = {
            a.spec.name: load_examples(a.spec.eval_source) if a.spec.eval_source else []
            for a in self.adapters
        }

    def _new_adapter(self, spec: AdapterSection) -> AdapterState:
        from torchtitan.components.tokenizer import HuggingFaceTokenizer

        from data.loader import PackedStream

        tr, d = self.recipe.training, self.recipe.data
        init = init_adapter(self.model, spec.seed)
        params = {k: nn.Parameter(v.clone()) for k, v in init.items()}
        opt = torch.optim.AdamW(
            params.values(),
            lr=spec.lr,
            betas=(0.9, 0.95),  # torchtitan's AdamW defaults, as the Trainer path uses
            eps=1e-8,
            weight_decay=tr.weight_decay,
            foreach=False,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, warmup=spec.warmup_steps, steps=spec.steps)
        )
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
        return AdapterState(spec, params, opt, sched, stream, _batches(stream, bs), bs)

    # -- one step --------------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            torch.distributed.all_reduce(t, group=self.group)
        return t

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's summed CE over the trained tokens of every rank (the global count, one
        scalar all-reduce), so the ranks' losses add up to the single-process mean."""
        n_local = (labels != IGNORE_INDEX).sum().to(torch.float64)
        n = int(self._all_reduce(n_local.clone()).item())
        ce = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return ce / max(n, 1), n

    def _sync(self, a: AdapterState, loss: torch.Tensor) -> float:
        """Sum every rank's adapter gradients and loss (one flat all-reduce per adapter);
        returns the global loss. One process: the loss as it is."""
        if self.group is None:
            return float(loss.detach())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in a.params.values()]
        flat = torch.cat([g.flatten() for g in grads] + [loss.detach().reshape(1).to(grads[0])])
        self._all_reduce(flat)
        off = 0
        for p, g in zip(a.params.values(), grads, strict=True):
            p.grad = flat[off : off + g.numel()].view_as(g).clone()
            off += g.numel()
        return float(flat[-1])

    def _optim(self, a: AdapterState) -> float:
        norm = torch.nn.utils.clip_grad_norm_(
            list(a.params.values()), self.recipe.training.max_norm, foreach=False
        )
        a.opt.step()
        a.sched.step()
        a.opt.zero_grad(set_to_none=True)
        return float(norm)

    def _step_turns(self, active: list[AdapterState]) -> list[tuple[AdapterState, float, float]]:
        out = []
        for a in active:
            x, pos, y = next(a.batches)
            bind_adapter(self.model, a.params)
            logits = model_logits(self.model, x.to(self.device), pos.to(self.device))
            loss, n = self._loss(logits, y.to(self.device))
            loss.backward()
            a.tokens += y.numel() * self.world
            a.trained_tokens += n
            out.append((a, self._sync(a, loss), self._optim(a)))
        return out

    def _step_batched(self, active: list[AdapterState]) -> list[tuple[AdapterState, float, float]]:
        data = [next(a.batches) for a in active]
        x = torch.cat([d[0] for d in data]).to(self.device)
        pos = torch.cat([d[1] for d in data]).to(self.device)
        sizes = [d[0].shape[0] for d in data]
        mods = list(lora_modules(self.model))
        saved = [(m.lora_a, m.lora_b) for _, m in mods]
        try:
            for name, m in mods:
                m.lora_a = _RowGroupLinear(
                    [a.params[f"{name}.lora_a.weight"] for a in active], sizes
                )
                m.lora_b = _RowGroupLinear(
                    [a.params[f"{name}.lora_b.weight"] for a in active], sizes
                )
            logits = model_logits(self.model, x, pos)
        finally:
            for (_, m), (la, lb) in zip(mods, saved, strict=True):
                m.lora_a, m.lora_b = la, lb
        losses, total = [], None
        for part, (a, d) in zip(
            torch.split(logits, sizes), zip(active, data, strict=True), strict=True
        ):
            loss, n = self._loss(part, d[2].to(self.device))
            a.tokens += d[2].numel() * self.world
            a.trained_tokens += n
            losses.append(loss)
            total = loss if total is None else total + loss
        assert total is not None
        total.backward()
        return [
            (a, self._sync(a, lo), self._optim(a)) for a, lo in zip(active, losses, strict=True)
        ]

    # -- evaluation, checkpoints, exports --------------------------------------------------
    def heldout(self, a: AdapterState) -> dict[str, Any] | None:
        examples = self._eval_sets[a.spec.name]
        if not examples:
            return None
        bind_adapter(self.model, a.params)
        t0 = time.perf_counter()
        res = exact_match(
            self.model, self.renderer, examples, device=self.device, pad_id=a.stream.pad_id
        )
        rec = {"event": "heldout", "adapter": a.spec.name, "step": a.step, **res,
               "eval_s": time.perf_counter() - t0}  # fmt: skip
        a.heldout.append(rec)
        self._jsonl.write(json.dumps(rec) + "\n")
        return rec

    def save(self, a: AdapterState) -> str:
        """Adapter weights, optimizer and schedule state, data position: one torch file that
        loads with weights_only=True (plain tensors, numbers and a JSON string)."""
        folder = os.path.join(self.out, "adapters", a.spec.name, f"step-{a.step}")
        if self.rank != 0:  # replicated state: rank 0's copy is every rank's
            return folder
        os.makedirs(folder, exist_ok=True)
        state = {
            "step": a.step,
            "params": {k: v.detach().cpu() for k, v in a.params.items()},
            "optimizer": a.opt.state_dict(),
            "scheduler": a.sched.state_dict(),
            "data": json.dumps(a.stream.state_dict(), default=_plain),
            "tokens": a.tokens,
            "trained_tokens": a.trained_tokens,
        }
        tmp = os.path.join(folder, "adapter.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(folder, "adapter.pt"))
        return folder

    def resume(self, a: AdapterState) -> bool:
        root = os.path.join(self.out, "adapters", a.spec.name)
        steps = sorted(
            int(d.split("-")[1])
            for d in (os.listdir(root) if os.path.isdir(root) else [])
            if d.startswith("step-") and os.path.exists(os.path.join(root, d, "adapter.pt"))
        )
        if not steps:
            return False
        path = os.path.join(root, f"step-{steps[-1]}", "adapter.pt")
        st = _load_adapter_checkpoint(path, self.recipe.source)
        problem = resume_problem(
            adapter=a.spec.name,
            index=self.recipe.adapters.index(a.spec),
            checkpoint=os.path.dirname(path),
            saved_shapes={k: tuple(v.shape) for k, v in st["params"].items()},
            shapes={k: tuple(v.shape) for k, v in a.params.items()},
            saved_data=json.loads(st["data"]).get("fingerprint", {}),
            data=a.stream.fingerprint,
        )
        if problem:  # addressed to where the changed value came from (a --set, a base)
            raise blame(ConfigError(problem[1], file=self.recipe.source, key=problem[0]),
                        self.recipe)  # fmt: skip
        with torch.no_grad():
            for k, v in st["params"].items():
                a.params[k].copy_(v)
        a.opt.load_state_dict(st["optimizer"])
        a.sched.load_state_dict(st["scheduler"])
        a.stream.load_state_dict(json.loads(st["data"]))
        a.batches = _batches(a.stream, a.batch_size)
        a.step, a.tokens, a.trained_tokens = st["step"], st["tokens"], st["trained_tokens"]
        return True

    def export(self, a: AdapterState) -> str:
        folder = self.recipe.finetune.export_dir.replace("{output_dir}", self.out)
        folder = os.path.join(folder, a.spec.name)
        bind_adapter(self.model, a.params)
        ad = adapter_state(self.model)
        # The merged model needs the full base: an all-gather on every rank (FSDP).
        base = base_state(self.model) if self.recipe.finetune.export_merged else None
        if self.rank != 0:
            return folder
        export_peft(
            folder,
            model_config=self.model_config,
            adapter=ad,
            state_dict_adapter=self.state_dict_adapter,
            rank=self.recipe.lora.rank,
            alpha=self.recipe.lora.alpha,
        )
        if base is not None:
            export_merged(
                os.path.join(folder, "merged"),
                base=base,
                adapter=ad,
                model_config=self.model_config,
                state_dict_adapter=self.state_dict_adapter,
                scale=self.scale,
                family=self.recipe.model.family,
            )
        return folder

    # -- the loop --------------------------------------------------------------------------
    def train(self, *, export: bool = True) -> dict[str, Any]:
        log_every = self.recipe.metrics.log_every
        interval = self.recipe.checkpoint.interval
        eval_every = self.recipe.finetune.eval_every
        for a in self.adapters:
            if self.recipe.checkpoint.resume:
                self.resume(a)
            if a.step == 0:
                self.heldout(a)
        step_fn = self._step_turns if self.schedule == "turns" else self._step_batched
        seq_len = self.recipe.training.seq_len
        while True:
            active = [a for a in self.adapters if not a.done]
            if not active:
                break
            t0, c0 = time.perf_counter(), time.process_time()
            results = step_fn(active)
            dt = time.perf_counter() - t0  # the round: one step of every active adapter
            # CPU seconds of this process (all its threads): on a CPU shared with other
            # jobs, time slicing inflates wall time but not this (benchmarks/adapters.md).
            dc = time.process_time() - c0
            for a, loss, norm in results:
                a.step += 1
                # Each adapter advances by one step per round: its tokens/s is its tokens over
                # the round's wall time (the job's total is the sum over adapters).
                a.times.append(dt)
                a.cpu_times.append(dc)
                if not math.isfinite(loss):
                    raise RuntimeError(f"adapter {a.spec.name}: loss is {loss} at step {a.step}")
                if a.step % log_every == 0 or a.done:
                    rec = {
                        "adapter": a.spec.name,
                        "step": a.step,
                        "loss": loss,
                        "grad_norm": norm,
                        "lr": a.sched.get_last_lr()[0],
                        "tokens": a.tokens,
                        "trained_tokens": a.trained_tokens,
                        "round_s": dt,
                        "round_cpu_s": dc,
                        "adapters_in_round": len(results),
                        # this adapter's tokens over every rank (global batch x seq_len)
                        "tokens_per_sec": a.batch_size * self.world * seq_len / a.times[-1],
                        "tokens_per_sec_per_rank": a.batch_size * seq_len / a.times[-1],
                    }
                    self._jsonl.write(json.dumps(rec) + "\n")
                if interval and a.step % interval == 0 and not a.done:
                    self.save(a)
                if eval_every and a.step % eval_every == 0 and not a.done:
                    self.heldout(a)
        summary: dict[str, Any] = {"schedule": self.schedule, "adapters": {}}
        skip = self.recipe.metrics.summary_skip_steps
        for a in self.adapters:
            self.save(a)
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
                "export": self.export(a) if export else None,
            }
        summary["world_size"] = self.world
        if self.rank == 0:
            with open(os.path.join(self.out, "adapters_summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
        self._jsonl.close()
        return summary
