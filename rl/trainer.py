"""The trainer's side of RL on one model: rollouts -> padded rows -> loss -> update.

`PolicyTrainer` puts a (possibly FSDP-sharded) torchtitan model and its optimizer and
LR-scheduler containers on the post-training step layer (runtime.steps.StepEngine:
microbatches under the token budget, gradient accumulation, the non-finite guard). Three
ways to get gradients, all through the same forward:
- `forward_backward(c, batch, loss_fn)`: a built-in or user loss of (logprobs, batch);
- `forward_backward_on_policy(c, loss_fn)`: a built-in loss whose pi_old is the training
  forward's own logprobs (sync RL, lag 0): no separate scoring pass;
- `forward_backward_grads(c, batch, grads_fn)`: "gradients from outside": the user gets the
  detached logprobs and returns d loss / d logprobs per token, which are backpropagated;
- then `optim_step()` (clipping, the guard, optimizer, scheduler, zero_grad).

MoE policies: rollouts carry the generator's expert ids (rl.generator `Sample.routing`);
with `routing_replay` every forward of the trainer (scoring and training) replays them
(Rollout Routing Replay, runtime.routing); `routing_metrics` measures the router agreement
and the train/inference KL with and without replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from rl.losses import LossBatch, LossFn
from runtime.rows import Rows, shifted_rows
from runtime.steps import StepEngine


@dataclass
class Rollout:
    """One sampled completion with everything the losses need. A multi-turn episode is one
    rollout: prompt = its first prompt, completion = the rest of the conversation, and
    `completion_mask` True at the model's own tokens (the environment's replies are context:
    never trained on, never in a loss's token count); sampling_logprobs then holds the
    model's tokens' logprobs only, in order."""

    prompt: list[int]
    completion: list[int]
    sampling_logprobs: list[float]
    advantage: float = 0.0
    reward: float = 0.0
    version: int = 0  # generator weight version that sampled it
    group: int = 0
    # MoE: (len(prompt) + len(completion) - 1, n_moe_layers, top_k) generator expert ids
    routing: torch.Tensor | None = None
    completion_mask: list[bool] | None = None  # None: every completion token is trained

    def trained(self) -> list[int]:
        """Indices into `completion` of the trained (model) tokens."""
        if self.completion_mask is None:
            return list(range(len(self.completion)))
        return [j for j, m in enumerate(self.completion_mask) if m]


@dataclass
class Collated:
    rows: Rows  # (B, L-1) inputs/targets: prompt + completion, right-padded
    mask: torch.Tensor  # (B, L-1) 1 on trained completion tokens (as predicted positions)
    sampling_logprobs: torch.Tensor  # (B, L-1), 0 off the mask
    advantages: torch.Tensor  # (B,)
    versions: torch.Tensor  # (B,)
    routing: torch.Tensor | None = None  # (B, L-1, n_moe_layers, K) generator expert ids
    routing_known: torch.Tensor | None = None  # (B, L-1) positions with recorded ids


def _routing(rollouts: Sequence[Rollout], L: int, device: torch.device):
    """The rollouts' recorded expert ids as (B, L, n, K) int64 and the (B, L) positions that
    have them (None when no rollout has any)."""
    have = [r.routing for r in rollouts if r.routing is not None]
    if not have:
        return None, None
    n, k = have[0].shape[1:]
    ids = torch.zeros(len(rollouts), L, n, k, dtype=torch.long)
    known = torch.zeros(len(rollouts), L, dtype=torch.bool)
    for b, r in enumerate(rollouts):
        if r.routing is not None:
            m = min(L, r.routing.shape[0])
            ids[b, :m] = r.routing[:m].long()
            known[b, :m] = True
    return ids.to(device), known.to(device)


def collate(
    rollouts: Sequence[Rollout], pad_id: int, device: torch.device, *, replay: bool = False
) -> Collated:
    """`replay`: the rows carry the recorded routing (every forward over them replays it)."""
    lengths = [len(r.prompt) + len(r.completion) for r in rollouts]
    B, L = len(rollouts), max(lengths)
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros(B, L - 1)
    slp = torch.zeros(B, L - 1)
    for b, r in enumerate(rollouts):
        p, c = len(r.prompt), len(r.completion)
        tokens[b, : p + c] = torch.tensor(r.prompt + r.completion)
        # logprob index t scores token t+1: completion token j sits at p - 1 + j
        if r.completion_mask is None:
            mask[b, p - 1 : p - 1 + c] = 1.0
            slp[b, p - 1 : p - 1 + c] = torch.tensor(r.sampling_logprobs, dtype=torch.float32)
        else:
            if len(r.completion_mask) != c or sum(r.completion_mask) != len(r.sampling_logprobs):
                raise ValueError("completion_mask must cover the completion and mark one token "
                                 "per sampling logprob")  # fmt: skip
            at = torch.tensor([p - 1 + j for j in r.trained()], dtype=torch.long)
            mask[b, at] = 1.0
            slp[b, at] = torch.tensor(r.sampling_logprobs, dtype=torch.float32)
    rows = shifted_rows(tokens.to(device), lengths)
    ids, known = _routing(rollouts, L - 1, device)
    if replay and ids is not None:
        rows.routing, rows.routing_known = ids, known
    return Collated(
        rows,
        mask.to(device),
        slp.to(device),
        torch.tensor([r.advantage for r in rollouts], dtype=torch.float32, device=device),
        torch.tensor([r.version for r in rollouts], device=device),
        ids,
        known,
    )


class PolicyTrainer:
    """A policy on the step layer; `engine_kw`: StepEngine's max_norm, temperature,
    microbatch_rows, dp_group."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Any,
        lr_schedulers: Any = None,
        *,
        pad_id: int = 0,
        reference: torch.nn.Module | None = None,
        microbatch_tokens: int = 2**62,  # default: one microbatch
        routing_replay: bool = False,
        **engine_kw: Any,
    ) -> None:
        self.model, self.pad_id, self.reference = model, pad_id, reference
        self.routing_replay = routing_replay
        self.engine = StepEngine(model, optimizers, lr_schedulers,
                                 microbatch_tokens=microbatch_tokens, label="rl", **engine_kw)  # fmt: skip

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def score(self, rollouts: Sequence[Rollout]) -> tuple[Collated, torch.Tensor]:
        """The trainer's logprobs of the sampled tokens under the current weights (pi_old)."""
        c = collate(rollouts, self.pad_id, self.device, replay=self.routing_replay)
        return c, self.engine.logprobs(c.rows)

    def routing_metrics(self, c: Collated, logprobs: torch.Tensor) -> dict[str, float]:
        """MoE rollouts only ({} otherwise): `logprobs` are the trainer's under the current
        weights with this trainer's replay setting; one more no-grad scoring pass gives the
        other setting's. Returns train_infer_kl_replay / train_infer_kl_no_replay (k3 on the
        sampled tokens, rl.mismatch; meaningful when the samples' weights are the trainer's)
        and router_agreement: the share of (token, MoE layer) pairs, over the positions the
        generator recorded, whose top-k expert set under the trainer's own router equals the
        generator's (counted by the seam in the extra pass)."""
        from rl.mismatch import mismatch_stats
        from runtime import routing

        if c.routing is None:
            return {}
        seam = routing.seam(self.model)
        assert seam is not None
        # the other setting's pass; it also counts the agreement (replaying, or comparing)
        other = replace(c.rows, routing=c.routing, routing_known=c.routing_known,
                        replay=not self.routing_replay)  # fmt: skip
        seam.reset_agreement()
        lp_other = self.engine.logprobs(other)
        agreement = seam.agreement()
        with_r, without = (logprobs, lp_other) if self.routing_replay else (lp_other, logprobs)
        routing.set_replay(self.model, None)
        kl_r = mismatch_stats(c.sampling_logprobs, with_r, c.mask)["train_infer_kl"]
        kl_n = mismatch_stats(c.sampling_logprobs, without, c.mask)["train_infer_kl"]
        return {
            "router_agreement": float(agreement if agreement is not None else 1.0),
            "train_infer_kl_replay": kl_r,
            "train_infer_kl_no_replay": kl_n,
        }

    def loss_batch(self, c: Collated, old_logprobs: torch.Tensor | None) -> LossBatch:
        ref = None
        if self.reference is not None:
            ref = self.engine.logprobs(c.rows, model=self.reference)
        return LossBatch(
            mask=c.mask,
            advantages=c.advantages,
            sampling_logprobs=c.sampling_logprobs,
            old_logprobs=old_logprobs,
            ref_logprobs=ref,
        )

    def forward_backward(
        self, c: Collated, batch: LossBatch, loss_fn: LossFn, *, logprobs: Any = None
    ) -> float:
        """`logprobs`: the rows' logprobs under the current weights if already scored (the
        loop's pi_old): the engine then skips its first pass."""
        fn = lambda lp: loss_fn(lp, batch)  # noqa: E731
        return self.engine.forward_backward(c.rows, fn, logprobs=logprobs)[0]

    def forward_backward_on_policy(
        self, c: Collated, loss_fn: LossFn
    ) -> tuple[float, torch.Tensor]:
        """The update when pi_old is the training forward's own logprobs, detached: samples
        drawn by the current weights (policy lag 0), one optimizer step per batch, no KL
        reference, a loss whose rows are separable (the built-ins). One forward per
        microbatch instead of a scoring pass plus a training pass
        (StepEngine.forward_backward_on_policy). Returns (loss, pi_old (B, L))."""
        return self.engine.forward_backward_on_policy(
            c.rows, lambda lp, old: loss_fn(lp, self.loss_batch(c, old))
        )

    def forward_backward_grads(
        self,
        c: Collated,
        batch: LossBatch,
        grads_fn: Callable[[torch.Tensor, LossBatch], torch.Tensor],
    ) -> None:
        grads = grads_fn(self.engine.logprobs(c.rows).clone(), batch)
        self.engine.backward_logprob_grads(c.rows, grads)

    def optim_step(self) -> float:
        return self.engine.optim_step()
