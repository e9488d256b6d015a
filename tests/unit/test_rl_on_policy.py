"""On-policy RL updates without a scoring pass (PolicyTrainer.forward_backward_on_policy):
when the samples come from the current weights, pi_old is the training forward's own
logprobs, and one forward per microbatch gives the same update as scoring pi_old first and
training on it (the two-pass path, the reference here) for every built-in loss.
"""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from core.errors import ConfigError
from rl.losses import BUILTIN_LOSSES, LossConfig, get_loss
from rl.trainer import PolicyTrainer, Rollout, collate
from runtime.steps import NonFiniteError
from tests.helpers.tiny_llama import tiny_llama

TEMPERATURE = 0.8
# Each built-in with settings that make its options matter (truncated importance weights,
# each aggregation); clips do not engage on-policy (ratio 1), which is the point.
CONFIGS = {
    "cross_entropy": LossConfig(),
    "importance_sampling": LossConfig(aggregation="sum"),
    "ppo": LossConfig(aggregation="sequence_mean"),
    "grpo": LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=2.0),
    "cispo": LossConfig(tis_cap=2.0),
    "dppo": LossConfig(tis_cap=2.0),
    "dro": LossConfig(),
    "gspo": LossConfig(aggregation="sequence_mean"),
    "stable_reinforce": LossConfig(clip_low=0.5, clip_high=0.5),
}


@pytest.fixture(scope="module")
def base():
    return tiny_llama(seed=5)


def rollouts(n: int = 10, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(1, 2000) for _ in range(rng.randint(2, 6))]
        c = [rng.randrange(1, 2000) for _ in range(rng.randint(1, 8))]
        mu = [-rng.uniform(6.5, 8.5) for _ in c]  # near the tiny model's (vocab 2048) values
        out.append(Rollout(p, c, mu, advantage=rng.gauss(0, 1), group=i // 5))
    return out


def _trainer(model, **kw):
    from torchtitan.components.optimizer import default_adamw

    opt = default_adamw(lr=1e-3).build(model_parts=[model])
    return PolicyTrainer(model, opt, temperature=TEMPERATURE, **kw)


def _count_forwards(model) -> list[int]:
    n = [0]
    model.register_forward_pre_hook(lambda *_: n.__setitem__(0, n[0] + 1))
    return n


def test_every_builtin_loss_is_covered():
    assert set(CONFIGS) == set(BUILTIN_LOSSES)


MICRO = {"microbatch_tokens": 24, "microbatch_rows": 2}


# Every loss over several microbatches; one microbatch (the whole batch) once.
@pytest.mark.parametrize(
    "name, budget",
    [pytest.param(n, MICRO, id=n) for n in sorted(CONFIGS)]
    + [pytest.param("grpo", {}, id="grpo-one-microbatch")],
)
def test_one_forward_update_equals_scored_update(base, name, budget):
    loss_fn = get_loss(name, CONFIGS[name])
    rs = rollouts()
    out = {}
    for how in ("scored", "on_policy"):
        model = copy.deepcopy(base)
        forwards = _count_forwards(model)
        pt = _trainer(model, **budget)
        if how == "scored":  # rl.loop's general path: score pi_old, then train on it
            c, old = pt.score(rs)
            loss = pt.forward_backward(c, pt.loss_batch(c, old), loss_fn, logprobs=old)
        else:
            c = collate(rs, pt.pad_id, pt.device)
            loss, old = pt.forward_backward_on_policy(c, loss_fn)
        grads = [p.grad.clone() for p in model.parameters()]
        pt.optim_step()
        out[how] = (loss, old * c.mask, grads, [p.detach().clone() for p in model.parameters()],
                    forwards[0])  # fmt: skip
    (l1, o1, g1, p1, f1), (l2, o2, g2, p2, f2) = out["scored"], out["on_policy"]
    assert f2 * 2 == f1, (f1, f2)  # one forward per microbatch instead of two
    if budget:
        assert f2 >= 5  # really microbatched
    assert abs(l1 - l2) <= 1e-6 * max(1.0, abs(l1)), (l1, l2)
    assert (o1 - o2).abs().max().item() <= 1e-6
    scale = max(g.abs().max().item() for g in g1)
    assert scale > 1e-4  # the gradient is real
    assert max((a - b).abs().max().item() for a, b in zip(g1, g2, strict=True)) <= 1e-6 * scale
    assert max((a - b).abs().max().item() for a, b in zip(p1, p2, strict=True)) <= 1e-6


def test_non_finite_late_microbatch_leaves_no_gradient(base):
    """A NaN that reaches only the last microbatch: the earlier ones have backpropagated when
    it is found; the step is refused with every gradient cleared and the weights and
    optimizer state untouched."""
    model = copy.deepcopy(base)
    pt = _trainer(model, microbatch_tokens=24, microbatch_rows=2)
    rs = rollouts()
    loss_fn = get_loss("grpo")
    c = collate(rs, pt.pad_id, pt.device)
    pt.forward_backward_on_policy(c, loss_fn)
    pt.optim_step()  # one good step: the optimizer has state to protect
    opt = pt.engine.optimizers
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.optimizers[0].state[p].items()}
             for n, p in model.named_parameters()}  # fmt: skip
    rs[-1].advantage = float("nan")
    c = collate(rs, pt.pad_id, pt.device)
    runs = pt.engine.microbatches_run
    with pytest.raises(NonFiniteError) as e:
        pt.forward_backward_on_policy(c, loss_fn)
    assert pt.engine.microbatches_run - runs >= 5  # found in the last microbatch, not before
    assert isinstance(e.value, ConfigError) and "d loss / d logprobs is nan" in str(e.value)
    assert all(p.grad is None for p in model.parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
        for k, v in opt.optimizers[0].state[p].items():
            assert torch.equal(v, state[n][k]), (n, k)


@pytest.mark.parametrize(
    "change, lag, expected",
    [
        ({}, 0, True),
        ({}, 1, False),  # an older version sampled: pi_old is not the current weights
        ({"mode": "async"}, 0, False),
        ({"kl_coef": 0.1}, 0, False),  # the reference-KL path keeps its scoring pass
        ({"loss": "custom"}, 0, False),  # a custom loss may couple rows
    ],
)
def test_loop_takes_the_one_forward_path_only_on_policy(change, lag, expected):
    from rl.loop import RLRun

    r = object.__new__(RLRun)
    rl = {"mode": "sync", "kl_coef": 0.0, "loss": "grpo", **change}
    r.rl, r.probe = SimpleNamespace(**rl), (object() if rl["mode"] == "async" else None)
    assert r.on_policy(torch.tensor([0, lag, 0])) is expected
