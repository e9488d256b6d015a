"""The post-training step layer (runtime.steps): microbatched updates equal the whole batch's
for every RL loss, chunked float32 logprobs equal log_softmax, microbatches respect the
budget, and a non-finite loss or gradient leaves weights and optimizer state untouched.

The whole-batch reference is written here from torch primitives (one forward of every row,
`log_softmax` of the full float32 logits, gather, loss, backward): the path the engine
replaces, not a call into it."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import ConfigError
from rl.losses import LossBatch, LossConfig, get_loss
from rl.trainer import PolicyTrainer, Rollout, collate
from runtime import logprobs as lpmod
from runtime import steps
from runtime.rows import Rows, split_rows
from runtime.steps import NonFiniteError
from tests.helpers.tiny_llama import tiny_llama

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def base():
    return tiny_llama(seed=3)


def rollouts(n: int = 12, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(1, 2000) for _ in range(rng.randint(2, 6))]
        c = [rng.randrange(1, 2000) for _ in range(rng.randint(1, 9))]
        mu = [-rng.uniform(4.0, 9.0) for _ in c]  # a generator's logprobs (not the trainer's)
        out.append(Rollout(p, c, mu, advantage=rng.gauss(0, 1), group=i // 4))
    return out


def reference_logprobs(model, c, temperature=TEMPERATURE):
    """Every row in one forward; full float32 log_softmax (what the engine avoids)."""
    x, y = c.rows.inputs, c.rows.targets
    B, L = x.shape
    pos = torch.arange(L).unsqueeze(0).expand(B, L)
    with torch.compiler.set_stance("force_eager"):  # one compile per shape otherwise
        masks = model.get_attention_masks(positions=pos)
    logits = model(x, pos, masks).float() / temperature
    lp = F.log_softmax(logits, -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(y >= 0, lp, 0.0)


def user_loss(logprobs: torch.Tensor, batch: LossBatch) -> torch.Tensor:
    """A custom loss with a non-linear, non-decomposable aggregate (sequence mean, then a
    softplus of each sequence's mean ratio term)."""
    ratio = (logprobs - batch.sampling_logprobs).exp()
    per_seq = (ratio * batch.advantages[:, None] * batch.mask).sum(-1) / batch.mask.sum(-1)
    return F.softplus(-per_seq).mean()


LOSSES = {
    "grpo": get_loss("grpo", LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.05)),
    "cispo": get_loss("cispo", LossConfig(tis_cap=2.0)),
    "dppo": get_loss("dppo", LossConfig(tis_cap=2.0)),
    "ppo": get_loss("ppo", LossConfig(aggregation="sequence_mean")),
    "importance_sampling": get_loss("importance_sampling"),
    "custom": user_loss,
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_microbatched_update_equals_whole_batch(base, name):
    loss_fn = LOSSES[name]
    rs = rollouts()
    ref_model = copy.deepcopy(base)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # a KL reference that differs from the policy

    # Reference: the whole batch at once, from torch primitives.
    model = copy.deepcopy(base)
    c = collate(rs, 0, torch.device("cpu"))
    with torch.no_grad():
        old = reference_logprobs(model, c)
        ref = reference_logprobs(ref_model, c)
    # pi_old slightly off the current weights' values: ratios are not all 1 (clips engage).
    old = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    batch = LossBatch(c.mask, c.advantages, c.sampling_logprobs, old * c.mask, ref)
    lp = reference_logprobs(model, c)
    want_loss = loss_fn(lp, batch)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    # The engine: microbatches of at most 2 rows and 24 padded tokens.
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pt = PolicyTrainer(model, opt, temperature=TEMPERATURE, microbatch_tokens=24,
                       microbatch_rows=2, reference=ref_model)  # fmt: skip
    c2, _ = pt.score(rs)
    b2 = pt.loss_batch(c2, old * c2.mask)
    assert torch.allclose(b2.ref_logprobs * c2.mask, ref * c.mask, atol=1e-5)
    got_loss = pt.forward_backward(c2, b2, loss_fn)
    assert pt.engine.microbatches_run >= 6  # really split (12 rows, <= 2 per microbatch)
    assert got_loss == pytest.approx(float(want_loss.detach()), abs=1e-5)
    worst = max((p.grad - want[n]).abs().max().item() for n, p in model.named_parameters())
    scale = max(g.abs().max().item() for g in want.values())
    assert scale > 1e-3  # the gradient is real
    assert worst <= 1e-5, (name, worst)


def test_outside_gradients_microbatched(base):
    """Gradients from outside (the client's d loss / d logprobs) give the built-in update."""
    rs = rollouts(seed=4)
    grads = {}
    for how in ("builtin", "outside"):
        model = copy.deepcopy(base)
        pt = PolicyTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                           microbatch_tokens=20, microbatch_rows=3)  # fmt: skip
        c, old = pt.score(rs)
        batch = pt.loss_batch(c, old)
        if how == "builtin":
            pt.forward_backward(c, batch, LOSSES["cispo"])
        else:

            def client(lp, b):
                lp = lp.requires_grad_(True)
                (g,) = torch.autograd.grad(LOSSES["cispo"](lp, b), lp)
                return g

            pt.forward_backward_grads(c, batch, client)
        grads[how] = [p.grad.clone() for p in model.parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(*grads.values(), strict=True)) < 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_logprobs_equal_log_softmax(monkeypatch, temperature):
    monkeypatch.setattr(lpmod, "CHUNK_TOKENS", 5)  # several chunks and a ragged last one
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    targets[1, 4:] = -100
    w = torch.randn(3, 7, generator=g)
    lp = lpmod.logprobs_of(logits, targets, temperature)
    (lp * w).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    want = F.log_softmax(logits / temperature, -1).gather(-1, targets.clamp(min=0)[..., None])
    want = torch.where(targets >= 0, want.squeeze(-1), 0.0)
    (want * w).sum().backward()
    assert torch.allclose(lp, want, atol=1e-6)
    assert torch.allclose(got, logits.grad, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=30),
    st.integers(1, 120),
    st.integers(0, 5),
)
def test_split_rows_budget(lengths, budget, max_rows):
    spans = split_rows(lengths, budget, max_rows)
    assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(len(lengths)))
    for lo, hi in spans:
        assert hi > lo
        if hi - lo > 1:
            assert max(lengths[lo:hi]) * (hi - lo) <= budget
        if max_rows:
            assert hi - lo <= max_rows
    # greedy: a span could not have taken the next row
    for (lo, hi), _ in zip(spans, spans[1:], strict=False):
        rows = hi - lo + 1
        assert max(lengths[lo : hi + 1]) * rows > budget or (max_rows and rows > max_rows)


def _state(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {
        n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
    }
    return params, state


@pytest.mark.parametrize("where", ["loss", "logprob_gradient", "parameter_gradient"])
def test_non_finite_step_leaves_weights_and_optimizer_untouched(base, where):
    from torchtitan.components.optimizer import default_adamw

    model = copy.deepcopy(base)
    opt = default_adamw(lr=1e-3).build(model_parts=[model])
    pt = PolicyTrainer(model, opt, microbatch_tokens=16, microbatch_rows=2)
    c, old = pt.score(rollouts(6))
    batch = pt.loss_batch(c, old)
    pt.forward_backward(c, batch, LOSSES["ppo"])
    pt.optim_step()  # one good step: the optimizer has state to protect
    params, state = _state(model, opt)
    if where == "loss":
        bad = LossBatch(batch.mask, batch.advantages * float("nan"), batch.sampling_logprobs)
        with pytest.raises(NonFiniteError) as e:
            pt.forward_backward(c, bad, LOSSES["importance_sampling"])
        assert "the loss is nan" in str(e.value)
    elif where == "logprob_gradient":
        # A finite value (0) with an undefined derivative: sqrt at 0 times sign at 0.
        def sharp(lp, b):
            return torch.sqrt(((lp - lp.detach()) * b.mask).abs().sum())

        with pytest.raises(NonFiniteError) as e:
            pt.forward_backward(c, batch, sharp)
        assert "d loss / d logprobs is nan" in str(e.value)
    else:
        # What an overflow inside the model's backward leaves: one NaN in one gradient.
        pt.forward_backward(c, batch, LOSSES["ppo"])
        name, p = list(model.named_parameters())[3]
        p.grad.view(-1)[0] = float("nan")
        with pytest.raises(NonFiniteError) as e:
            pt.optim_step()
        assert f"the gradient norm (first non-finite: {name}) is nan" in str(e.value)
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)
    assert "optimizer state unchanged" in str(e.value)
    after_params, after_state = _state(model, opt)
    for n in params:
        assert torch.equal(params[n], after_params[n]), n
        for k in state[n]:
            assert torch.equal(state[n][k], after_state[n][k]), (n, k)
    assert all(p.grad is None for p in model.parameters())


def test_microbatch_count_is_shared_across_ranks(monkeypatch):
    """With a dp group every rank runs the same number of microbatches: the short rank
    pads with zero-gradient repeats (a rank with fewer forwards would hang FSDP's
    all-gathers)."""
    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append(int(t.item()))
        t.fill_(5)

    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    model = tiny_llama(layers=1)
    eng = steps.StepEngine(model, torch.optim.SGD(model.parameters(), lr=0.0),
                           microbatch_tokens=10, dp_group=object())  # fmt: skip
    x = torch.randint(1, 100, (3, 4))
    rows = Rows(x, x.clone())
    spans = eng.spans(rows)
    assert calls == [2] and len(spans) == 5 and spans[2:] == [(0, 0)] * 3
    lp = eng.logprobs(rows)  # the repeats write nothing
    ref = lpmod.token_logprobs(model, rows)
    assert torch.allclose(lp, ref, atol=1e-6)
