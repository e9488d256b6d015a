"""The post-training step layer: rows of tokens -> logprobs -> loss -> gradients -> update.

One implementation for the three loops that are not torchtitan's Trainer loop: the
[[adapters]] jobs (posttrain.adapters), RL (rl.trainer / rl.loop) and the service's backend
(service.titan_backend). What each gets from here:

- `Rows` -> microbatches under a token budget (`split_rows`: at most `max_tokens` padded
  tokens and `max_rows` rows each, at least one row), the same count on every rank of a
  sharded model (FSDP's all-gathers are collectives: a rank with fewer microbatches would
  hang the others; the short rank runs zero-gradient repeats of its first row).
- `token_logprobs`: the model's own forward (document masks from positions), then
  log p(target) in float32 computed over CHUNK_TOKENS tokens at a time by one autograd
  function that keeps the logits in the model's dtype and recomputes each chunk's softmax
  in backward (`_ChunkedLogprobs`, the row-chunked form of torchtitan's chunked loss):
  float32 full-vocabulary logits exist for one chunk, never for the batch.
- `StepEngine.forward_backward(rows, loss_fn)`: any loss that is a function of the (B, L)
  logprob matrix (every rl.losses loss, a user's custom loss, Tinker's losses, SFT's
  cross-entropy). One microbatch: forward, loss, backward. Several: first every
  microbatch's logprobs without a graph (RL passes the pi_old it has just scored under the
  same weights, so this costs nothing there), then the loss and d loss / d logprobs on that
  small matrix, then each microbatch again with its graph, backpropagating its slice. By
  the chain rule that is the whole-batch gradient; only the summation order differs
  (tests/unit/test_post_steps.py: within 1e-5 in float32 for every loss).
- `StepEngine.optim_step`: gradients of replicated parameters summed over ranks (the
  adapters' data parallelism), torchtitan's `clip_grad_norm_` (DTensor-aware), the
  non-finite guard, torchtitan's OptimizersContainer and LRSchedulersContainer, zero_grad.
  A non-finite loss or gradient raises `NonFiniteError` (one line, exit 2 from train.py)
  before any optimizer step: weights and optimizer state stay exactly as they were, nothing
  is saved from it, and the last good checkpoint stays the resume point.
- `StepGuard`: what torchtitan's loop gets from TitanscaleTrainer, for these loops: the step
  watchdog (runtime.watchdog), the mid-step fault seam (runtime.faults) and the
  stop-request / requeue path (launch.stop_request).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX

from core.errors import ConfigError
from runtime import routing

# Tokens whose float32 log-softmax exists at once (forward and backward): 1024 x a 128K
# vocabulary is 0.5 GiB of float32; the model-dtype logits of the microbatch stay whole.
CHUNK_TOKENS = 1024


class NonFiniteError(ConfigError):
    """A loss or gradient that is NaN or infinite: the step is refused before the optimizer
    runs (weights and optimizer state unchanged). One line naming where it came from."""


# ---------------------------------------------------------------------------------- rows


@dataclass
class Rows:
    """A batch of rows: `inputs` (B, L) token ids, `targets` (B, L) the token each position
    predicts (IGNORE_INDEX where nothing is scored), optional `positions` (B, L) (packed
    documents restart at 0; None = 0..L-1 per row) and `lengths` (real tokens per row, for
    the budget; None = L). MoE: `routing` (B, L, n_moe_layers, K) expert ids to replay at
    the `routing_known` (B, L) positions (runtime.routing; None = the routers' own choice);
    `replay` False: only count the routers' agreement with them (runtime.routing.Seam)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    lengths: list[int] | None = None
    routing: torch.Tensor | None = None
    routing_known: torch.Tensor | None = None
    replay: bool = True

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def lens(self) -> list[int]:
        return self.lengths if self.lengths is not None else [self.inputs.shape[1]] * len(self)

    def span(self, lo: int, hi: int) -> Rows:
        """Rows lo..hi-1, cut to their longest real length (padding after it is dropped)."""
        n = max(self.lens()[lo:hi])
        pos = None if self.positions is None else self.positions[lo:hi, :n]
        lengths = None if self.lengths is None else self.lengths[lo:hi]
        route = known = None
        if self.routing is not None:
            route = self.routing[lo:hi, :n]
            known = None if self.routing_known is None else self.routing_known[lo:hi, :n]
        return Rows(self.inputs[lo:hi, :n], self.targets[lo:hi, :n], pos, lengths, route, known,
                    self.replay)  # fmt: skip


def shifted_rows(tokens: torch.Tensor, lengths: Sequence[int]) -> Rows:
    """(B, L) right-padded sequences -> rows predicting token t+1 from tokens 0..t; targets
    past each sequence's end are IGNORE_INDEX."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    L = inputs.shape[1]
    real = torch.as_tensor([max(n - 1, 0) for n in lengths], device=tokens.device)
    targets[torch.arange(L, device=tokens.device)[None, :] >= real[:, None]] = IGNORE_INDEX
    return Rows(inputs, targets, None, [max(n - 1, 1) for n in lengths])


def split_rows(lengths: Sequence[int], max_tokens: int, max_rows: int = 0) -> list[tuple[int, int]]:
    """Consecutive spans of rows, each at most `max_rows` rows (0 = no limit) and at most
    `max_tokens` padded tokens (rows x the span's longest row); a row longer than the budget
    is a span of its own. Pure."""
    spans: list[tuple[int, int]] = []
    lo, longest = 0, 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        rows = i - lo + 1
        if i > lo and (grown * rows > max_tokens or (max_rows and rows > max_rows)):
            spans.append((lo, i))
            lo, grown = i, n
        longest = grown
    if len(lengths) > lo:
        spans.append((lo, len(lengths)))
    return spans


# ------------------------------------------------------------------------------ logprobs


def forward_logits(
    model: torch.nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, L) -> (B, L, V) logits of a torchtitan decoder, each row one document from
    position 0 unless `positions` says where documents restart (document masks)."""
    B, L = inputs.shape
    if positions is None:
        positions = torch.arange(L, device=inputs.device).unsqueeze(0).expand(B, L)
    get_masks = getattr(model, "get_attention_masks", None)
    masks = None
    if get_masks is not None:
        # torchtitan builds masks with a torch.compile'd create_block_mask, which recompiles
        # for each new (rows, length) shape: seconds each on CPU, where microbatch shapes
        # vary. The CPU attention backend (dense) only evaluates the mask: eager is exact.
        eager = inputs.device.type == "cpu"
        with torch.compiler.set_stance("force_eager" if eager else "default"):
            masks = get_masks(positions=positions)
    # torchtitan's trainer sets `_skip_lm_head` when its chunked loss applies the head; these
    # loops need the logits, so the head runs inside this forward (FSDP unshards it there).
    skip = getattr(model, "_skip_lm_head", False)
    if skip:
        model._skip_lm_head = False  # type: ignore[assignment]
    try:
        out = model(inputs, positions, masks)
    finally:
        if skip:
            model._skip_lm_head = True  # type: ignore[assignment]
    return out


class _ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(x / T)[target] per row of (N, V) logits, float32, CHUNK_TOKENS rows at a
    time. Saves the logits (their own dtype) and one float32 logsumexp per row; backward
    recomputes each chunk's softmax: d lp / d x = (onehot(target) - softmax) / T."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        N = logits.shape[0]
        ok = targets != IGNORE_INDEX
        safe = torch.where(ok, targets, 0)
        out = torch.zeros(N, dtype=torch.float32, device=logits.device)
        lse = torch.zeros(N, dtype=torch.float32, device=logits.device)
        for s in range(0, N, CHUNK_TOKENS):
            x = logits[s : s + CHUNK_TOKENS].float() / temperature
            lse[s : s + CHUNK_TOKENS] = torch.logsumexp(x, dim=-1)
            picked = x.gather(-1, safe[s : s + CHUNK_TOKENS, None]).squeeze(-1)
            out[s : s + CHUNK_TOKENS] = picked - lse[s : s + CHUNK_TOKENS]
        out = torch.where(ok, out, 0.0)
        ctx.save_for_backward(logits, safe, ok, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        logits, safe, ok, lse = ctx.saved_tensors
        T = ctx.temperature
        g = torch.where(ok, grad, 0.0).float()
        out = torch.empty_like(logits)
        for s in range(0, logits.shape[0], CHUNK_TOKENS):
            e = s + CHUNK_TOKENS
            p = torch.exp(logits[s:e].float() / T - lse[s:e, None])
            d = -p * g[s:e, None]
            d.scatter_add_(-1, safe[s:e, None], g[s:e, None])
            out[s:e] = (d / T).to(out.dtype)
        return out, None, None


def logprobs_of(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """(B, L, V) logits, (B, L) targets -> (B, L) float32 log p(target) at `temperature`
    (0 where the target is IGNORE_INDEX). Vocabulary-sharded (tensor-parallel) logits go
    through torchtitan's `compute_logprobs`, which gathers the vocabulary."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        from torchtitan.components.loss import compute_logprobs

        lp = compute_logprobs(logits / temperature, targets)
        assert isinstance(lp, torch.Tensor)
        return lp
    B, L, V = logits.shape
    flat = _ChunkedLogprobs.apply(logits.reshape(B * L, V), targets.reshape(B * L), temperature)
    return flat.view(B, L)


def token_logprobs(model: torch.nn.Module, rows: Rows, *, temperature: float = 1.0) -> torch.Tensor:
    """(B, L) float32 logprobs of `rows.targets` under `model` (0 at ignored targets).
    Rows with `routing` replay it (set before the forward and left set, so that an
    activation-checkpointed recompute in backward routes the same; rows without clear it)."""
    routing.set_replay(model, rows.routing, rows.routing_known, replay=rows.replay)
    return logprobs_of(
        forward_logits(model, rows.inputs, rows.positions), rows.targets, temperature
    )


# ------------------------------------------------------------------------------- engine


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class StepEngine:
    """Microbatched forward/backward and the optimizer step for one set of trainable
    parameters on one model (an adapter bound into a shared base, or a whole policy).

    `optimizers` / `lr_schedulers`: torchtitan's containers (lr_schedulers None: the caller
    sets the learning rate, as the service's clients do). `named_params`: the trainable
    parameters (default: the model's with requires_grad). `replicated_group`: a process
    group over which these parameters are replicated and their gradients summed before the
    step (their loss must already be normalised globally). `dp_group`: the group whose
    ranks run the model's collectives together (FSDP): every rank then runs the same number
    of microbatches. `microbatch_tokens` / `microbatch_rows`: the budget (0 rows = no cap).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Any,
        lr_schedulers: Any = None,
        *,
        microbatch_tokens: int,
        microbatch_rows: int = 0,
        max_norm: float = 1.0,
        temperature: float = 1.0,
        named_params: Sequence[tuple[str, torch.nn.Parameter]] | None = None,
        replicated_group: Any = None,
        dp_group: Any = None,
        label: str = "",
        guard_weights: bool = False,
    ) -> None:
        if microbatch_tokens < 1:
            raise ValueError(f"microbatch_tokens must be >= 1, got {microbatch_tokens}")
        self.model = model
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.microbatch_tokens = microbatch_tokens
        self.microbatch_rows = microbatch_rows
        self.max_norm = max_norm
        self.temperature = temperature
        self.named_params = list(
            named_params
            if named_params is not None
            else [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        )
        self.replicated_group = replicated_group
        self.dp_group = dp_group
        self.label = label
        # Check the weights after each step and roll a non-finite step back (`_guarded`):
        # costs one copy of the parameters and optimizer state per step, so it is for small
        # trainable sets (the service's adapters), not a whole model.
        self.guard_weights = guard_weights
        self.microbatches_run = 0  # forward passes with a graph (tests, metrics)

    # -- microbatches -------------------------------------------------------------------
    def spans(self, rows: Rows, *, collective: bool = True) -> list[tuple[int, int]]:
        spans = split_rows(rows.lens(), self.microbatch_tokens, self.microbatch_rows)
        if collective and self.dp_group is not None:
            n = torch.tensor([len(spans)], dtype=torch.int64, device=rows.inputs.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX, group=self.dp_group)
            # A zero-gradient repeat of the first row: same collectives, no contribution.
            spans += [(0, 0)] * (int(n.item()) - len(spans))
        return spans

    def _part(self, rows: Rows, lo: int, hi: int) -> Rows:
        return rows.span(0, 1) if hi == lo else rows.span(lo, hi)

    @torch.no_grad()
    def logprobs(self, rows: Rows, model: torch.nn.Module | None = None) -> torch.Tensor:
        """(B, L) logprobs under `model` (default: the trained one), no graph, microbatched.
        Another model (a frozen reference) is rank-local: no collective count."""
        m = model if model is not None else self.model
        out = torch.zeros(rows.targets.shape, dtype=torch.float32, device=rows.inputs.device)
        for lo, hi in self.spans(rows, collective=m is self.model):
            part = self._part(rows, lo, hi)
            lp = token_logprobs(m, part, temperature=self.temperature)
            if hi > lo:
                out[lo:hi, : lp.shape[1]] = lp
        return out

    def forward_backward(
        self,
        rows: Rows,
        loss_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        logprobs: torch.Tensor | None = None,
        backward: bool = True,
    ) -> tuple[float, torch.Tensor]:
        """Add d loss / d parameters to the gradients; returns (loss, logprobs (B, L)).

        `loss_fn(logprobs) -> scalar`, a function of the whole batch's logprob matrix.
        `logprobs`: this batch's logprobs under the current weights when the caller already
        has them (RL's pi_old), which saves the first pass. NonFiniteError before any
        backward when the loss is NaN or infinite. `backward=False`: the loss only."""
        if not backward:
            lp = self.logprobs(rows) if logprobs is None else logprobs
            return float(self.check_loss(loss_fn(lp))), lp
        spans = self.spans(rows)
        if len(spans) == 1 and logprobs is None:
            self.microbatches_run += 1
            lp = token_logprobs(self.model, rows, temperature=self.temperature)
            loss = self.check_loss(loss_fn(lp))
            loss.backward()
            return float(loss.detach()), lp.detach()
        if logprobs is None:
            logprobs = self.logprobs(rows)
        leaf = logprobs.detach().clone().requires_grad_(True)
        loss = self.check_loss(loss_fn(leaf))
        if loss.requires_grad:
            (g,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        else:
            g = None
        self.backward_logprob_grads(rows, g if g is not None else torch.zeros_like(leaf), spans)
        return float(loss.detach()), logprobs

    def forward_backward_on_policy(
        self, rows: Rows, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> tuple[float, torch.Tensor]:
        """`loss_fn(logprobs, old) -> scalar` where `old` is the logprobs under the current
        weights, detached (on-policy RL's pi_old: sampled by these weights, one optimizer
        step per batch): one forward per microbatch, with its graph, and no separate pass
        for `old`. Returns (loss, old (B, L)).

        Only for losses whose gradient with respect to a row's logprobs depends on that row
        alone (every rl.losses built-in: per-token terms, per-row ratios, normalisers that
        depend on the mask only). Microbatch k's gradient is that of the whole-batch loss at
        a matrix equal to `old` on the rows already run and to 0 (logprobs = old = 0) on the
        rows not yet run: for such a loss the other rows' values do not enter it, so it is
        the whole-batch gradient at logprobs = old exactly (tests/unit/test_rl_on_policy.py:
        within 1e-6 of the two-pass update). The filler rows' own terms may be anything
        (exp(0 - mu) can overflow): only this microbatch's slice of the gradient is used and
        checked, and the loss is checked once, the whole batch's at `old`, at the end. A
        non-finite loss or gradient raises NonFiniteError with every gradient zeroed
        (earlier microbatches have already backpropagated; RL's update starts from zero)."""
        old = torch.zeros(rows.targets.shape, dtype=torch.float32, device=rows.inputs.device)
        try:
            for lo, hi in self.spans(rows):
                part = self._part(rows, lo, hi)
                self.microbatches_run += 1
                lp = token_logprobs(self.model, part, temperature=self.temperature)
                if hi == lo:  # a zero-gradient repeat (same collectives as the other ranks)
                    lp.backward(gradient=torch.zeros_like(lp))
                    continue
                old[lo:hi, : lp.shape[1]] = lp.detach()
                leaf = old.clone().requires_grad_(True)
                loss = loss_fn(leaf, old)
                if not loss.requires_grad:
                    continue
                (g,) = torch.autograd.grad(loss, leaf, allow_unused=True)
                if g is None:
                    continue
                g = g[lo:hi, : lp.shape[1]]
                bad = ~torch.isfinite(g)
                if bool(bad.any()):
                    raise NonFiniteError(self._where("d loss / d logprobs", g[bad][0].item()))
                lp.backward(gradient=g.to(lp.dtype))
            loss = self.check_loss(loss_fn(old, old))
        except NonFiniteError:
            self.optimizers.zero_grad()
            raise
        return float(loss.detach()), old

    def backward_logprob_grads(
        self, rows: Rows, grads: torch.Tensor, spans: list[tuple[int, int]] | None = None
    ) -> None:
        """Backpropagate d loss / d logprobs (B, L) through the model, microbatch by
        microbatch ("gradients from outside": the caller computed them)."""
        if grads.shape != rows.targets.shape:
            raise ValueError(
                f"gradient shape {tuple(grads.shape)} != logprobs {tuple(rows.targets.shape)}"
            )
        bad = ~torch.isfinite(grads)
        if bool(bad.any()):
            raise NonFiniteError(self._where("d loss / d logprobs", grads[bad][0].item()))
        for lo, hi in spans if spans is not None else self.spans(rows):
            part = self._part(rows, lo, hi)
            self.microbatches_run += 1
            lp = token_logprobs(self.model, part, temperature=self.temperature)
            g = torch.zeros_like(lp) if hi == lo else grads[lo:hi, : lp.shape[1]]
            lp.backward(gradient=g.to(lp.dtype))

    def check_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` if it is a finite scalar; NonFiniteError (one line) if not."""
        if loss.dim() != 0:
            raise ValueError(f"the loss must be a scalar, got shape {tuple(loss.shape)}")
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteError(self._where("the loss", value))
        return loss

    def _where(self, what: str, value: float) -> str:
        head = f"{self.label}: " if self.label else ""
        return (
            f"{head}{what} is {value}; the step was refused before the optimizer ran "
            "(weights and optimizer state unchanged, nothing saved from it)"
        )

    # -- the update -----------------------------------------------------------------------
    def _sum_replicated_grads(self) -> None:
        params = [p for _, p in self.named_params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.flatten() for g in grads])
        torch.distributed.all_reduce(flat, group=self.replicated_group)
        off = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[off : off + g.numel()].view_as(g).clone()
            off += g.numel()

    def optim_step(self) -> float:
        """Clip, check, step, schedule, zero; returns the gradient norm before clipping."""
        from torchtitan.distributed import utils as dist_utils

        if self.replicated_group is not None:
            self._sum_replicated_grads()
        params = [p for _, p in self.named_params]
        with_grad = [(n, p.grad) for n, p in self.named_params if p.grad is not None]
        # Per-parameter norms of the local gradients before clipping scales them all by a
        # NaN coefficient: names the source of a non-finite norm (one read of the grads).
        own = torch._foreach_norm([_local(g) for _, g in with_grad]) if with_grad else []
        # max_norm <= 0: no clipping, the norm is still needed for the guard.
        limit = self.max_norm if self.max_norm > 0 else math.inf
        norm = float(_full(dist_utils.clip_grad_norm_(params, limit, foreach=True)))
        if not math.isfinite(norm):
            bad = [n for (n, _), v in zip(with_grad, own, strict=True) if not torch.isfinite(v)]
            name = bad[0] if bad else "a parameter sharded on another rank"
            self.optimizers.zero_grad()
            raise NonFiniteError(self._where(f"the gradient norm (first non-finite: {name})", norm))
        if self.guard_weights:
            self._guarded_step()
        else:
            self.optimizers.step()
        if self.lr_schedulers is not None:
            self.lr_schedulers.step()
        self.optimizers.zero_grad()
        return norm

    def _guarded_step(self) -> None:
        """The optimizer step, undone when a parameter's L2 norm is not finite afterwards
        (NaN, inf, or entries so large that their squares overflow: a learning rate of 1e30
        gives finite weights whose next forward is inf). Parameters and optimizer state are
        restored exactly; the gradients are dropped, as for a non-finite gradient."""
        params = [p for _, p in self.named_params]
        saved = [p.detach().clone() for p in params]
        states = [
            {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
             for p, st in opt.state.items()}
            for opt in self.optimizers.optimizers
        ]  # fmt: skip
        self.optimizers.step()
        norms = torch._foreach_norm([_local(p.detach()) for p in params]) if params else []
        bad = [
            n for (n, _), v in zip(self.named_params, norms, strict=True) if not torch.isfinite(v)
        ]
        if not bad:
            return
        with torch.no_grad():
            for p, old in zip(params, saved, strict=True):
                p.copy_(old)
        for opt, st in zip(self.optimizers.optimizers, states, strict=True):
            for p in list(opt.state):
                if p not in st:
                    del opt.state[p]
            for p, old_state in st.items():
                for k, v in old_state.items():
                    cur = opt.state[p].get(k)
                    if torch.is_tensor(v) and torch.is_tensor(cur):
                        cur.copy_(v)
                    else:
                        opt.state[p][k] = v
        self.optimizers.zero_grad()
        head = f"{self.label}: " if self.label else ""
        raise NonFiniteError(
            f"{head}the weights after the optimizer step are not finite (first: {bad[0]}); "
            "the step was undone (weights and optimizer state as before it): lower the "
            "learning rate"
        )

    def lr(self) -> float:
        return float(self.optimizers.optimizers[0].param_groups[0]["lr"])


# --------------------------------------------------------------------------------- guard


class StepGuard:
    """The step watchdog, the mid-step fault seam and the stop-request check around a loop's
    steps (what TitanscaleTrainer gives torchtitan's loop), with the recipe's timeouts.
    `groups`: mesh name -> ranks, named in a collective-timeout diagnosis."""

    def __init__(
        self, recipe: Any, *, groups: dict[str, list[int]] | None = None, device: Any = None
    ) -> None:
        from core.launch_env import launch_env
        from launch.stop_request import StopRequest
        from recipe.loader import first_step_timeout_s
        from runtime.watchdog import StepWatchdog, default_store

        dist = torch.distributed
        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if on else 1
        self.device = device
        self.watchdog = StepWatchdog(
            rank=dist.get_rank() if on else 0,
            world_size=self.world,
            timeout_s=recipe.job.collective_timeout_s,
            first_timeout_s=first_step_timeout_s(recipe),
            groups=groups or {"world": list(range(self.world))},
            store=default_store(),
            attempt=launch_env().restart_count,
        ).start()
        self.stop_request = StopRequest()

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """One step under the watchdog; the fault seam fires first (tests only)."""
        from runtime import faults

        with watched_step(self.watchdog, n, self.world):
            faults.inject("step", n)
            yield

    def stop_here(self, n: int, save: Callable[[], bool]) -> bool:
        """At a step boundary (collective when it checks: every rank, every boundary): if
        the launcher asked to stop and `save()` wrote a resumable checkpoint, record it for
        the job script (<stop file>.saved: requeue) and return True."""
        req = self.stop_request
        if not (req.enabled and req.requested(self.device)) or not save():
            return False
        req.acknowledge(n)
        return True

    def close(self) -> None:
        self.watchdog.stop()


@contextlib.contextmanager
def watched_step(watchdog: Any, n: int, world_size: int) -> Iterator[None]:
    """Mark step `n` for the watchdog; a collective timeout on several ranks becomes a
    RankTimeoutError naming the rank that stopped answering (runtime.watchdog)."""
    from runtime.watchdog import RankTimeoutError, looks_like_timeout

    watchdog.begin(n)
    try:
        yield
    except Exception as e:
        watchdog.disarm()  # an exception is on its way: not a hang
        if world_size > 1 and looks_like_timeout(e):
            msg = watchdog.collective_failed(n, e)
            from torchtitan.tools.logging import logger

            logger.error(msg)
            raise RankTimeoutError(msg) from e
        raise
    watchdog.end()


# ------------------------------------------------------------------------- job plumbing


class Attrs:
    """Some attributes of an object as a Stateful (a loop's counters in its checkpoint);
    `json_of`: an attribute holding an object whose own state dict is stored as JSON (a data
    stream's position); `on_load` runs after a load."""

    def __init__(
        self, obj: Any, *names: str, json_of: str = "", on_load: Callable[[], None] | None = None
    ) -> None:
        self.obj, self.names, self.json_of, self.on_load = obj, names, json_of, on_load

    def state_dict(self) -> dict[str, Any]:
        import json

        from data.loader import _plain  # the loader's JSON encoding of its own state

        sd = {n: getattr(self.obj, n) for n in self.names}
        if self.json_of:
            state = getattr(self.obj, self.json_of).state_dict()
            sd["json"] = json.dumps(state, default=_plain)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        import json

        for n in self.names:
            setattr(self.obj, n, sd[n])
        if self.json_of:
            getattr(self.obj, self.json_of).load_state_dict(json.loads(sd["json"]))
        if self.on_load is not None:
            self.on_load()


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


def recipe_optimizer(
    recipe: Any, module: torch.nn.Module, *, lr: float, warmup_steps: int = -1, steps: int = 0
) -> tuple[Any, Any]:
    """torchtitan's AdamW container over `module`'s trainable parameters with the recipe's
    settings at `lr`, and (steps > 0) its LR schedule (lr_schedule, min_lr_ratio,
    decay_ratio) over `steps` with `warmup_steps`; None: a constant learning rate."""
    import dataclasses

    from torchtitan.components.optimizer import default_adamw

    from runtime.build import lr_scheduler_config

    opt = default_adamw(lr=lr, weight_decay=recipe.training.weight_decay).build(
        model_parts=[module]
    )
    if steps <= 0:
        return opt, None
    cfg = dataclasses.replace(lr_scheduler_config(recipe), warmup_steps=max(warmup_steps, 0))
    return opt, cfg.build(optimizers=opt, training_steps=steps)


def recipe_checkpointer(recipe: Any, folder: str, *, steps: int, **states: Any) -> Any:
    """The verified checkpoint manager (runtime.checkpoint) for one state of a post-training
    loop over `folder` (step-N subfolders): the recipe's interval (0: `steps`), keep_latest,
    checksums and async mode (async needs a process group). `states`: model_parts,
    optimizers, lr_schedulers, dataloader and states, as torchtitan's manager takes them."""
    from runtime.checkpoint import AtomicCheckpointManager

    ck = recipe.checkpoint
    dist = torch.distributed
    async_ok = dist.is_available() and dist.is_initialized()
    return AtomicCheckpointManager.Config(
        enable=True,
        folder=folder,
        interval=ck.interval or steps,
        keep_latest_k=ck.keep_latest,
        last_save_model_only=False,  # every save resumes
        async_mode=ck.async_mode if async_ok else "disabled",
        checksums=ck.checksums,
        recipe_file=recipe.source or "",
    ).build(sd_adapter=None, **states)


def check_posttrain_keys(recipe: Any, layout: Any) -> None:
    """Keys a job's path cannot honour: one line each, never ignored. RL trains
    prompts_per_step x group_size rollouts per rank per update (local_batch_size is its
    microbatch's row limit); an adapter steps on its local_batch_size rows per process."""
    path = "rl" if recipe.rl.enabled else "[[adapters]]"
    f = recipe.source
    if not recipe.rl.enabled and not recipe.adapters:
        return  # (training.microbatch_tokens there: recipe.loader.check_finetune)
    if recipe.validation.enable:
        raise ConfigError(
            f"{path} has no validator (torchtitan's runs in the pretraining/SFT Trainer); "
            "held-out scores come from eval_source / rl.eval_prompts; set "
            "validation.enable = false",
            file=f,
            key="validation.enable",
        )
    dp = layout.dp if layout is not None else 1
    # [[adapters]]: local_batch_size rows per process and step, no accumulation.
    gbs, ok = recipe.training.global_batch_size, recipe.training.local_batch_size * dp
    if recipe.rl.enabled:
        if recipe.finetune.mode != "off" or recipe.adapters:
            raise ConfigError(
                "rl trains the full policy (its generator takes full weights); set "
                "finetune.mode = 'off' and no [[adapters]]",
                file=f,
                key="finetune.mode",
            )
        for axis in ("tp", "pp", "cp"):
            if layout is not None and getattr(layout, axis) != 1:
                # Every rank samples its own prompts: tp/cp peers would see other rows.
                raise ConfigError(
                    f"rl runs data parallel only (each rank samples and trains its own "
                    f"rollouts); {axis} = {getattr(layout, axis)} is not supported, set it to 1",
                    file=f,
                    key=f"parallel.{axis}",
                )
        ok = recipe.rl.prompts_per_step * recipe.rl.group_size * dp
    if gbs not in (-1, ok):
        raise ConfigError(
            f"{path} steps on its own batch (rl: prompts_per_step x group_size rollouts per "
            "rank, in microbatches of at most local_batch_size rows; [[adapters]]: "
            f"local_batch_size rows per process); set -1 or {ok}, got {gbs}",
            file=f,
            key="training.global_batch_size",
        )


# -------------------------------------------------------------------------------- budget


def device_memory_bytes(platform: Any) -> tuple[float, str]:
    """(bytes one rank may use, the memory model's device kind): the GPU's memory, or on
    CPU the host's memory shared by the local processes."""
    import os

    from core.launch_env import launch_env

    if platform.is_cpu:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return ram / max(launch_env().local_world_size, 1), "cpu"
    local = launch_env().local_rank
    return float(torch.cuda.get_device_properties(local).total_memory), platform.device_name


def choose_microbatch_tokens(recipe: Any, layout: Any, platform: Any) -> int:
    """The job's token budget: training.microbatch_tokens, or the largest that fits this
    device by the memory model (parallel.memory: the trainer's states and one microbatch,
    the generator's copies and KV cache; on CPU the dense attention's scores). ConfigError
    (before any process group) when the job does not fit, saying what it needs. `layout`
    None: one process. (The service's budget is its resource plan's: parallel/serve.py.)"""
    from dataclasses import replace

    from core.axes import Layout
    from parallel.memory import fit_microbatch_tokens, posttrain_load, posttrain_memory
    from parallel.workload import workload_from_recipe

    pt = posttrain_load(recipe)
    assert pt is not None, "a post-training recipe (rl or [[adapters]])"
    if platform.is_cpu:
        pt = replace(pt, dense_attention_len=recipe.training.seq_len)
    w = workload_from_recipe(recipe, layout or Layout())
    device, kind = device_memory_bytes(platform)
    chosen = recipe.training.microbatch_tokens
    tokens = chosen or fit_microbatch_tokens(w, pt, device, kind)
    est = posttrain_memory(w, replace(pt, microbatch_tokens=tokens or pt.microbatch_tokens))
    if tokens and est.required_gib_on(kind) * 2**30 <= device:
        return tokens
    what = "this GPU" if kind != "cpu" else "this machine's share per process"
    hint = (
        "lower training.microbatch_tokens"
        if chosen
        else "use more GPUs (FSDP shards the states), a smaller model"
        + (" or a bfloat16 generator (rl.generator_dtype)" if recipe.rl.enabled else "")
    )
    raise ConfigError(
        f"the job needs {est.describe(kind)}; {what} has {device / 2**30:.1f} GiB: {hint}",
        file=recipe.source,
        key="training.microbatch_tokens" if chosen else "model.flavor",
    )
