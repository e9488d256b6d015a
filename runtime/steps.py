"""The post-training step engine: rows of tokens -> logprobs -> loss -> gradients -> update.

One implementation for the three loops that are not torchtitan's Trainer loop: the
[[adapters]] jobs (posttrain.adapters), RL (rl.trainer / rl.loop) and the service's backend
(service.titan_backend). What each gets from `StepEngine`:

- Microbatches: `Rows` split under a token budget (runtime.rows.split_rows), the same
  count on every rank of a sharded model (FSDP's all-gathers are collectives: a rank with
  fewer microbatches would hang the others; the short rank runs zero-gradient repeats of
  its first row); logprobs by runtime.logprobs.token_logprobs (chunked float32).
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

Around it, each in its own module: rows and their split (runtime.rows), the logprob
function (runtime.logprobs), the step guard (runtime.step_guard), the loops' optimizer,
scheduler and checkpointer from the recipe (runtime.build), their Stateful counters
(runtime.stateful), metrics averaged over ranks (runtime.rank_mean) and the token budget
(runtime.budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from core.errors import ConfigError
from runtime.logprobs import token_logprobs
from runtime.rows import Rows, split_rows


class NonFiniteError(ConfigError):
    """A loss or gradient that is NaN or infinite: the step is refused before the optimizer
    runs (weights and optimizer state unchanged). One line naming where it came from."""


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
