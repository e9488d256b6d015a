"""RL losses against plain-numpy references written from each paper's formula.

The references below do not import rl.losses: they restate the published objective per token
(float64), aggregate it the way the docstring says, and (for the surrogate losses) give the
analytic gradient with respect to the logprobs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl.losses import (
    LossBatch,
    LossConfig,
    aggregate,
    backward_from_logprob_grads,
    get_loss,
    group_advantages,
)

B, T, G = 6, 5, 3
rng = np.random.default_rng(0)
LP = np.log(rng.uniform(0.05, 0.95, (B, T)))  # current policy
MU = LP + rng.normal(0, 0.3, (B, T))  # behaviour (generator) policy
OLD = LP + rng.normal(0, 0.3, (B, T))  # trainer's proximal policy
REF = LP + rng.normal(0, 0.2, (B, T))
MASK = (rng.uniform(size=(B, T)) > 0.25).astype(np.float64)
MASK[:, 0] = 1
REWARDS = np.array([1.0, 0.0, 0.5, 0.2, 0.2, 0.9])
ADV_SEQ = rng.normal(size=B)


def np_group_adv(r: np.ndarray, g: int) -> np.ndarray:
    out = []
    for grp in r.reshape(-1, g):
        out.extend((grp - grp.mean()) / (grp.std() + 1e-6))
    return np.array(out)


def np_token_mean(x: np.ndarray) -> float:
    return float((x * MASK).sum() / MASK.sum())


def np_ppo_terms(lp, prox, adv, lo, hi):
    r = np.exp(lp - prox)
    unclipped, clipped = r * adv, np.clip(r, 1 - lo, 1 + hi) * adv
    loss = -np.minimum(unclipped, clipped)
    # d/dlp: the unclipped branch is the active minimum -> -r*adv, else 0 (clip is flat).
    grad = np.where(unclipped <= clipped, -r * adv, 0.0)
    return loss, grad


def torch_batch(**kw) -> LossBatch:
    t = {k: torch.tensor(v) for k, v in kw.items()}
    return LossBatch(mask=torch.tensor(MASK), **t)


def run(name: str, cfg: LossConfig, batch: LossBatch):
    lp = torch.tensor(LP, requires_grad=True)
    loss = get_loss(name, cfg)(lp, batch)
    loss.backward()
    return float(loss.detach()), lp.grad.numpy()


def test_group_advantages_match_numpy():
    got = group_advantages(torch.tensor(REWARDS), G).numpy()
    np.testing.assert_allclose(got, np_group_adv(REWARDS, G), rtol=1e-12)
    mean_only = group_advantages(torch.tensor(REWARDS), G, normalize_std=False).numpy()
    np.testing.assert_allclose(mean_only, REWARDS - REWARDS.reshape(-1, G).mean(1).repeat(G))


def test_aggregations():
    x = rng.normal(size=(B, T))
    assert float(aggregate(torch.tensor(x), torch.tensor(MASK), "token_mean")) == pytest.approx(
        np_token_mean(x)
    )
    seq = ((x * MASK).sum(1) / MASK.sum(1)).mean()
    assert float(aggregate(torch.tensor(x), torch.tensor(MASK), "sequence_mean")) == pytest.approx(
        seq
    )
    assert float(aggregate(torch.tensor(x), torch.tensor(MASK), "sum")) == pytest.approx(
        (x * MASK).sum()
    )


def test_cross_entropy():
    loss, grad = run("cross_entropy", LossConfig(), torch_batch())
    assert loss == pytest.approx(np_token_mean(-LP), rel=1e-12)
    np.testing.assert_allclose(grad, -MASK / MASK.sum(), rtol=1e-12)


def test_importance_sampling():
    adv = ADV_SEQ[:, None].repeat(T, 1)
    loss, grad = run(
        "importance_sampling", LossConfig(), torch_batch(advantages=ADV_SEQ, sampling_logprobs=MU)
    )
    ratio = np.exp(LP - MU)
    assert loss == pytest.approx(np_token_mean(-ratio * adv), rel=1e-12)
    np.testing.assert_allclose(grad, -ratio * adv * MASK / MASK.sum(), rtol=1e-10)


@pytest.mark.parametrize("lo,hi", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo(lo, hi):
    adv = rng.normal(size=(B, T))
    b = torch_batch(advantages=adv, sampling_logprobs=MU, old_logprobs=OLD)
    loss, grad = run("ppo", LossConfig(clip_low=lo, clip_high=hi), b)
    ref, g = np_ppo_terms(LP, OLD, adv, lo, hi)
    assert loss == pytest.approx(np_token_mean(ref), rel=1e-12)
    np.testing.assert_allclose(grad, g * MASK / MASK.sum(), rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_grpo_with_kl(aggregation):
    adv = np_group_adv(REWARDS, G)[:, None].repeat(T, 1)
    beta = 0.04
    cfg = LossConfig(kl_coef=beta, aggregation=aggregation)
    b = torch_batch(
        advantages=group_advantages(torch.tensor(REWARDS), G).numpy(),
        sampling_logprobs=MU,
        ref_logprobs=REF,
    )
    loss, grad = run("grpo", cfg, b)
    # GRPO (DeepSeekMath eq. 3): ratio against pi_old (here the sampler's: no old_logprobs),
    # KL by the unbiased k3 estimator pi_ref/pi - log(pi_ref/pi) - 1.
    surr, g = np_ppo_terms(LP, MU, adv, 0.2, 0.2)
    kl = np.exp(REF - LP) - (REF - LP) - 1
    g = g + beta * (1 - np.exp(REF - LP))
    per_tok = surr + beta * kl
    if aggregation == "token_mean":
        want, gw = np_token_mean(per_tok), g * MASK / MASK.sum()
    else:
        n = MASK.sum(1, keepdims=True)
        want = float(((per_tok * MASK).sum(1) / n[:, 0]).mean())
        gw = g * MASK / n / B
    assert loss == pytest.approx(want, rel=1e-12)
    np.testing.assert_allclose(grad, gw, rtol=1e-10, atol=1e-15)


def test_cispo():
    lo, hi = 1.0, 0.5  # MiniMax-M1: no lower clip in effect, upper eps_high
    adv = ADV_SEQ[:, None].repeat(T, 1)
    b = torch_batch(advantages=ADV_SEQ, sampling_logprobs=MU, old_logprobs=OLD)
    loss, grad = run("cispo", LossConfig(clip_low=lo, clip_high=hi), b)
    w = np.clip(np.exp(LP - OLD), 1 - lo, 1 + hi)
    assert loss == pytest.approx(np_token_mean(-w * adv * LP), rel=1e-12)
    # stop-gradient weight: every token keeps gradient -w*A, clipped or not.
    np.testing.assert_allclose(grad, -w * adv * MASK / MASK.sum(), rtol=1e-10)


@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_dppo(cap):
    adv = rng.normal(size=(B, T))
    b = torch_batch(advantages=adv, sampling_logprobs=MU, old_logprobs=OLD)
    loss, grad = run("dppo", LossConfig(tis_cap=cap), b)
    # Hilton et al. 2021, eq. 6: E_mu[ pi_prox/mu * min(r A, clip(r) A) ], r = pi / pi_prox.
    behav = np.exp(OLD - MU)
    if cap:
        behav = np.minimum(behav, cap)
    surr, g = np_ppo_terms(LP, OLD, adv, 0.2, 0.2)
    assert loss == pytest.approx(np_token_mean(behav * surr), rel=1e-12)
    np.testing.assert_allclose(grad, behav * g * MASK / MASK.sum(), rtol=1e-10, atol=1e-15)


def test_truncated_importance_weights_on_grpo():
    adv = np_group_adv(REWARDS, G)[:, None].repeat(T, 1)
    b = torch_batch(
        advantages=group_advantages(torch.tensor(REWARDS), G).numpy(),
        sampling_logprobs=MU,
        old_logprobs=OLD,
    )
    loss, _ = run("grpo", LossConfig(tis_cap=2.0), b)
    surr, _ = np_ppo_terms(LP, OLD, adv, 0.2, 0.2)
    w = np.minimum(np.exp(OLD - MU), 2.0)
    assert loss == pytest.approx(np_token_mean(w * surr), rel=1e-12)


def test_outside_gradients_equal_builtin_gradient():
    b = torch_batch(advantages=ADV_SEQ, sampling_logprobs=MU, old_logprobs=OLD)
    _, grad = run("grpo", LossConfig(), b)
    # The "client" differentiates the loss on a detached copy and sends d loss / d logprobs.
    client_lp = torch.tensor(LP, requires_grad=True)
    get_loss("grpo")(client_lp, b).backward()
    lp = torch.tensor(LP, requires_grad=True)
    backward_from_logprob_grads(lp * 1.0, client_lp.grad)
    np.testing.assert_array_equal(lp.grad.numpy(), grad)
    with pytest.raises(ValueError, match="shape"):
        backward_from_logprob_grads(lp * 1.0, client_lp.grad[:, :2])


def test_dro():
    # Tinker's docs: loss = -sum(lp * A - beta/2 (lp - q)^2), per token.
    adv = rng.normal(size=(B, T))
    beta = 0.3
    b = torch_batch(advantages=adv, sampling_logprobs=MU)
    loss, grad = run("dro", LossConfig(beta=beta), b)
    per_tok = -(LP * adv - 0.5 * beta * (LP - MU) ** 2)
    assert loss == pytest.approx(np_token_mean(per_tok), rel=1e-12)
    np.testing.assert_allclose(grad, -(adv - beta * (LP - MU)) * MASK / MASK.sum(), rtol=1e-10)


def test_gspo_sequence_ratio_over_its_mask():
    # Tinker's GSPO-token: s = exp(mean_{t in M} log p/q) per sequence; every token carries s's
    # value and d(ratio)/d(lp_t) = s; PPO's min/clip on it. M differs from the loss mask here.
    adv = rng.normal(size=(B, T))
    rmask = MASK.copy()
    rmask[:, 1] = 0.0
    lo, hi = 0.1, 0.1
    b = torch_batch(advantages=adv, sampling_logprobs=MU, ratio_mask=rmask)
    loss, grad = run("gspo", LossConfig(clip_low=lo, clip_high=hi), b)
    s = np.array([np.exp((LP[i] - MU[i])[rmask[i] != 0].mean()) for i in range(B)])[:, None]
    s = np.broadcast_to(s, (B, T))
    unclipped, clipped = s * adv, np.clip(s, 1 - lo, 1 + hi) * adv
    assert 0 < np.mean(unclipped > clipped) < 1  # both branches occur: the test can fail
    per_tok = -np.minimum(unclipped, clipped)
    g = np.where(unclipped <= clipped, -s * adv, 0.0)
    assert loss == pytest.approx(np_token_mean(per_tok), rel=1e-12)
    np.testing.assert_allclose(grad, g * MASK / MASK.sum(), rtol=1e-10, atol=1e-15)


def test_stable_reinforce_masks_tokens_outside_the_ratio_band():
    adv = rng.normal(size=(B, T))
    lo, hi = 0.2, 0.25
    b = torch_batch(advantages=adv, sampling_logprobs=MU)
    loss, grad = run("stable_reinforce", LossConfig(clip_low=lo, clip_high=hi), b)
    r = np.exp(LP - MU)
    keep = ((r >= 1 - lo) & (r <= 1 + hi)).astype(np.float64)
    assert 0 < (keep * MASK).sum() < MASK.sum()  # some tokens masked, some kept
    assert loss == pytest.approx(np_token_mean(-keep * r * adv * LP), rel=1e-12)
    np.testing.assert_allclose(grad, -keep * r * adv * MASK / MASK.sum(), rtol=1e-10, atol=1e-15)
