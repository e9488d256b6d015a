"""MoE decoding and Rollout Routing Replay on a tiny torchtitan qwen3 MoE (float32 experts):
the generator's KV-cache decode of MoE layers against the model's own full forward, its
recorded expert ids against the ids the full forward's routers choose, the trainer's
replayed logprobs equal to the generator's within 1e-5, and a perturbed router (the
load-balancing expert bias: it changes which experts are chosen, never the gate weights)
that makes them differ without replay and not with it."""

from __future__ import annotations

import copy

import pytest
import torch

from rl.generator import Generator, SamplingParams
from rl.policy import token_logprobs
from rl.trainer import PolicyTrainer, Rollout
from runtime import routing
from runtime.logprobs import token_logprobs as rows_logprobs
from tests.helpers.tiny_llama import tiny_qwen3_moe

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13]]
LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_moe(LAYERS, top_k=TOP_K)


@pytest.fixture(scope="module")
def samples(model):
    gen = Generator.from_model(model)
    return gen.generate(PROMPTS, SamplingParams(max_tokens=8, n=2, seed=1))


def _rollouts(samples) -> list[Rollout]:
    return [
        Rollout(PROMPTS[s.prompt_index], s.tokens, s.logprobs, routing=s.routing) for s in samples
    ]


def _max_diff(trainer_lp: torch.Tensor, c, samples) -> float:
    return float((trainer_lp - c.sampling_logprobs).abs().mul(c.mask).max())


def test_generator_decodes_moe_and_records_the_routers_choice(model, samples):
    worst = 0.0
    for s in samples:
        prompt = PROMPTS[s.prompt_index]
        seq = torch.tensor([prompt + s.tokens])
        # independent reference: the model's own full forward (no cache), its routers'
        # choice recorded on the positions the trainer feeds (all tokens but the last)
        with torch.no_grad(), routing.recorded(model) as seam:
            lp = token_logprobs(model, seq)[0, len(prompt) - 1 :]
            ids = seam.take()[0]
        worst = max(worst, float((lp - torch.tensor(s.logprobs)).abs().max()))
        assert s.routing is not None
        assert s.routing.shape == (len(prompt) + len(s.tokens) - 1, LAYERS, TOP_K)
        assert torch.equal(s.routing.long().sort(-1).values, ids.sort(-1).values)
    assert worst < 1e-5, worst


def test_replay_equals_generator_and_a_perturbed_router_differs(model, samples):
    rollouts = _rollouts(samples)
    same = PolicyTrainer(model, None, routing_replay=True)
    c, lp = same.score(rollouts)
    assert c.rows.routing is not None
    assert _max_diff(lp, c, samples) < 1e-5
    m = same.routing_metrics(c, lp)
    assert m["router_agreement"] == 1.0 and m["train_infer_kl_replay"] < 1e-9

    # A perturbed router: the expert bias moves the choice of experts, not the gate weights
    # (torchtitan adds it for the top-k only), so under replay nothing else differs.
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for layer in moved.layers.values():
            layer.moe.expert_bias_E.copy_(
                torch.linspace(-0.3, 0.3, layer.moe.expert_bias_E.numel())
            )
    off = PolicyTrainer(moved, None, routing_replay=False)
    c_off, lp_off = off.score(rollouts)
    assert c_off.rows.routing is None
    assert _max_diff(lp_off, c_off, samples) > 1e-3
    on = PolicyTrainer(moved, None, routing_replay=True)
    c_on, lp_on = on.score(rollouts)
    assert _max_diff(lp_on, c_on, samples) < 1e-5
    m = on.routing_metrics(c_on, lp_on)
    assert 0.0 < m["router_agreement"] < 1.0
    assert m["train_infer_kl_replay"] < 1e-9 < m["train_infer_kl_no_replay"]
    assert m == pytest.approx(off.routing_metrics(c_off, lp_off))


def test_replayed_router_still_gets_gradients(model, samples):
    """Replay fixes which experts, not the gate weights: the router's gate is trained through
    the replayed experts' weights."""
    m = copy.deepcopy(model).requires_grad_(True)
    c, _ = PolicyTrainer(m, None, routing_replay=True).score(_rollouts(samples))
    (rows_logprobs(m, c.rows) * c.mask).sum().backward()
    grad = m.layers["0"].moe.router.gate.weight.grad
    assert grad is not None and float(grad.abs().sum()) > 0


def test_replay_refused_on_dense_models_and_rl_on_mla():
    from core.errors import ConfigError
    from recipe.loader import load_recipe
    from recipe.model_checks import check_model

    with pytest.raises(ConfigError, match="routing replay needs MoE layers") as e:
        check_model(load_recipe("recipes/rl_debug.toml", ["rl.routing_replay=true"]))
    assert e.value.key == "rl.routing_replay"
    mla = ["model.family=deepseek_v3", "model.flavor=debugmodel"]
    with pytest.raises(ConfigError, match="uses MLA"):
        check_model(load_recipe("recipes/rl_moe_debug.toml", mla))
    check_model(load_recipe("recipes/rl_moe_debug.toml", ["rl.routing_replay=true"]))
