"""Policy-gradient losses as pure functions of (logprobs, batch) -> scalar.

`logprobs` (B, T) are the trainer's log-probabilities of the sampled tokens under the current
weights (with gradient). `LossBatch` holds everything else, per token, aligned with them.
Every loss aggregates per-token terms with `aggregate` over `mask` (completion tokens only).

The losses (formulas in docs/rl.md; each has a numpy reference in tests/unit/test_rl_losses.py):
- cross_entropy: -log pi(y) (SFT on sampled or given tokens).
- importance_sampling: -(pi / mu) A, the ratio differentiated (Tinker's `importance_sampling`).
- ppo: -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r = pi / pi_old (Schulman et al. 2017).
- grpo: the PPO surrogate on group-normalised advantages plus beta * KL(pi || pi_ref) with
  the k3 estimator (Shao et al. 2024, DeepSeekMath).
- cispo: -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi: clipped, stop-gradient importance
  weights, every token keeps a gradient (MiniMax-M1, 2025).
- dppo: decoupled PPO (Hilton et al. 2021): the PPO surrogate against the proximal policy
  (the trainer's weights before this update) times the behaviour weight pi_prox / mu of the
  policy that sampled (an older version, in asynchronous RL), which corrects the lag.
- dro: direct reward optimisation (Richemond et al. 2024), Tinker's `dro`:
  -(A log pi - beta/2 (log pi - log mu)^2).
- gspo: GSPO-token (Zheng et al. 2025), Tinker's `gspo`: every token carries the sequence's
  ratio s = exp(mean over `ratio_mask` of log pi/mu) (value stopped, its own gradient) in
  the PPO surrogate.
- stable_reinforce: REINFORCE with masked importance weights, -sg(m r) A log pi with
  r = pi / mu and m = 1 inside [1 - clip_low, 1 + clip_high], 0 outside: tokens whose
  sampler and learner disagree too much (stale or low-precision samples) carry no gradient.
  Tinker's `stable_reinforce` (alpha) does not publish its objective; this is ours
  (docs/from_tinker.md says what differs).

`mu` is the generator (behaviour) policy: `sampling_logprobs`. `pi_old` is `old_logprobs`,
the trainer's own recomputation under the weights that produced the sample (equal to mu when
the numerics match); when set, `tis_cap` > 0 multiplies each token's term by the truncated
importance weight min(pi_old / mu, tis_cap) (Yao et al. 2025), the train/inference-mismatch
correction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "sequence_mean", "sum"]


@dataclass
class LossBatch:
    """Per-token tensors of shape (B, T) (advantages may be (B,), one per sequence)."""

    mask: torch.Tensor
    advantages: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None  # mu: the generator's, at sampling time
    old_logprobs: torch.Tensor | None = None  # pi_old: the trainer's, same weights as mu
    ref_logprobs: torch.Tensor | None = None  # pi_ref: the reference policy (KL)
    ratio_mask: torch.Tensor | None = None  # gspo: tokens of the sequence ratio (else mask)

    def token_advantages(self) -> torch.Tensor:
        if self.advantages is None:
            raise ValueError("this loss needs advantages")
        a = self.advantages
        return a.unsqueeze(-1).expand_as(self.mask) if a.dim() == 1 else a

    def behaviour(self) -> torch.Tensor:
        if self.sampling_logprobs is None:
            raise ValueError("this loss needs sampling_logprobs")
        return self.sampling_logprobs

    def proximal(self) -> torch.Tensor:
        """pi_old when the trainer recomputed it, else the generator's logprobs."""
        return self.old_logprobs if self.old_logprobs is not None else self.behaviour()


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    tis_cap: float = 0.0  # 0 = no truncated importance weights
    beta: float = 0.05  # dro: weight of the quadratic penalty (Tinker's docs' example value)
    aggregation: Aggregation = "token_mean"


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's advantages: (r - mean of its group) / (std of its group + eps), one per sample.

    `rewards` is (n_groups * group_size,), groups contiguous. std is the population std
    (numpy's default). normalize_std=False gives Dr. GRPO's mean-only centring.
    """
    r = rewards.reshape(-1, group_size)
    a = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        a = a / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: Aggregation) -> torch.Tensor:
    """token_mean: sum over all tokens / number of tokens (DAPO); sequence_mean: the mean
    over each sequence's tokens, then over sequences (the GRPO paper); sum: Tinker's."""
    m = mask.to(per_token.dtype)
    if how == "token_mean":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    if how == "sequence_mean":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_seq.mean()
    if how == "sum":
        return (per_token * m).sum()
    raise ValueError(f"unknown aggregation {how!r}")


def _tis_weight(batch: LossBatch, cfg: LossConfig) -> torch.Tensor | None:
    if cfg.tis_cap <= 0 or batch.old_logprobs is None or batch.sampling_logprobs is None:
        return None
    return torch.exp(batch.old_logprobs - batch.sampling_logprobs).clamp(max=cfg.tis_cap)


def _finish(per_token: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> torch.Tensor:
    w = _tis_weight(batch, cfg)
    if w is not None:
        per_token = per_token * w.detach()
    return aggregate(per_token, batch.mask, cfg.aggregation)


def _clipped_surrogate(
    logprobs: torch.Tensor, prox: torch.Tensor, adv: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    ratio = torch.exp(logprobs - prox)
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    return -torch.minimum(ratio * adv, clipped * adv)


def cross_entropy_loss(
    logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    return aggregate(-logprobs, batch.mask, cfg.aggregation)


def importance_sampling_loss(
    logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    ratio = torch.exp(logprobs - batch.behaviour())
    return aggregate(-ratio * batch.token_advantages(), batch.mask, cfg.aggregation)


def ppo_loss(
    logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    per_token = _clipped_surrogate(logprobs, batch.proximal(), batch.token_advantages(), cfg)
    return _finish(per_token, batch, cfg)


def grpo_loss(
    logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    per_token = _clipped_surrogate(logprobs, batch.proximal(), batch.token_advantages(), cfg)
    if cfg.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("grpo with kl_coef > 0 needs ref_logprobs")
        d = batch.ref_logprobs - logprobs
        per_token = per_token + cfg.kl_coef * (torch.exp(d) - d - 1)
    return _finish(per_token, batch, cfg)


def cispo_loss(
    logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    ratio = torch.exp(logprobs - batch.proximal()).detach()
    w = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    return _finish(-w * batch.token_advantages() * logprobs, batch, cfg)


def dppo_loss(
    logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    if batch.old_logprobs is None:
        raise ValueError("dppo needs old_logprobs (the proximal policy's)")
    behav = torch.exp(batch.old_logprobs - batch.behaviour())
    if cfg.tis_cap > 0:
        behav = behav.clamp(max=cfg.tis_cap)
    surr = _clipped_surrogate(logprobs, batch.old_logprobs, batch.token_advantages(), cfg)
    # The behaviour weight is already the (truncated) correction: no second TIS factor.
    return aggregate(behav.detach() * surr, batch.mask, cfg.aggregation)


def dro_loss(
    logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    d = logprobs - batch.behaviour()
    per_token = -(logprobs * batch.token_advantages() - 0.5 * cfg.beta * d * d)
    return _finish(per_token, batch, cfg)


def gspo_loss(
    logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    rmask = (batch.ratio_mask if batch.ratio_mask is not None else batch.mask) != 0
    lr = (logprobs.detach() - batch.behaviour()) * rmask
    # each row's mean log-ratio over its ratio tokens (a row with none: ratio 1)
    seq = lr.sum(-1, keepdim=True) / rmask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(seq + logprobs - logprobs.detach())
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    adv = batch.token_advantages()
    return _finish(-torch.minimum(ratio * adv, clipped * adv), batch, cfg)


def stable_reinforce_loss(
    logprobs: torch.Tensor, batch: LossBatch, cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    r = torch.exp(logprobs.detach() - batch.behaviour())
    keep = (r >= 1 - cfg.clip_low) & (r <= 1 + cfg.clip_high)
    w = torch.where(keep, r, torch.zeros_like(r))
    return _finish(-w * batch.token_advantages() * logprobs, batch, cfg)


LossFn = Callable[[torch.Tensor, LossBatch], torch.Tensor]

BUILTIN_LOSSES: dict[str, Callable[[torch.Tensor, LossBatch, LossConfig], torch.Tensor]] = {
    "cross_entropy": cross_entropy_loss,
    "importance_sampling": importance_sampling_loss,
    "ppo": ppo_loss,
    "grpo": grpo_loss,
    "cispo": cispo_loss,
    "dppo": dppo_loss,
    "dro": dro_loss,
    "gspo": gspo_loss,
    "stable_reinforce": stable_reinforce_loss,
}


def get_loss(name: str, cfg: LossConfig = LossConfig()) -> LossFn:
    """A built-in loss bound to its settings: a function of (logprobs, batch) -> scalar."""
    fn = BUILTIN_LOSSES[name]
    return lambda logprobs, batch: fn(logprobs, batch, cfg)


def backward_from_logprob_grads(logprobs: torch.Tensor, grads: torch.Tensor) -> None:
    """'Gradients from outside': the user computed d loss / d logprobs per token (e.g. on a
    client, from logprobs the trainer sent); backpropagate them through the model. Equivalent
    to loss = sum(logprobs * grads) with grads constant."""
    if grads.shape != logprobs.shape:
        raise ValueError(f"gradient shape {tuple(grads.shape)} != logprobs {tuple(logprobs.shape)}")
    logprobs.backward(gradient=grads.to(logprobs.dtype))
