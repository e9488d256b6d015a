"""KV-cache generator against the model's own full forward (fp32), sampling controls,
versioned weight updates and the mismatch metric's two regimes."""

from __future__ import annotations

import pytest
import torch

from rl.generator import Generator, SamplingParams, vllm_generator
from rl.mismatch import mismatch_stats
from rl.policy import forward_logits, full_state_dict, token_logprobs
from tests.helpers.tiny_llama import tiny_llama

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def full_forward_logprobs(model, prompt, completion, temperature):
    toks = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = token_logprobs(model, toks, temperature=temperature)[0]
    return lp[len(prompt) - 1 :].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cached_decoding_matches_full_forward(model, temperature):
    gen = Generator.from_model(model)
    samples = gen.generate(
        PROMPTS, SamplingParams(max_tokens=12, n=2, temperature=temperature, seed=1)
    )
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    worst = 0.0
    for s in samples:
        assert len(s.tokens) == 12 and s.finish_reason == "length"
        ref = full_forward_logprobs(model, PROMPTS[s.prompt_index], s.tokens, temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)))
    assert worst < 1e-5, worst
    # the two samples of a prompt differ (they are sampled, not copied)
    assert samples[0].tokens != samples[1].tokens


def test_top_p_tiny_is_greedy_and_stop_tokens(model):
    gen = Generator.from_model(model)
    greedy = gen.generate(PROMPTS[:1], SamplingParams(max_tokens=8, top_p=1e-6, seed=3))[0]
    # greedy: each token is the argmax of the full forward's next-token distribution
    toks = torch.tensor([PROMPTS[0] + greedy.tokens])
    with torch.no_grad():
        lp_all = torch.log_softmax(forward_logits(model, toks), -1)
    argmax = lp_all[0, len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()
    assert greedy.tokens == argmax
    stop = greedy.tokens[3]
    first = greedy.tokens.index(stop)
    s = gen.generate(
        PROMPTS[:1], SamplingParams(max_tokens=8, top_p=1e-6, seed=3, stop_tokens=(stop,))
    )[0]
    assert s.tokens == greedy.tokens[: first + 1] and s.finish_reason == "stop"
    assert len(s.logprobs) == len(s.tokens)


def test_versioned_weight_updates(model):
    gen = Generator.from_model(model)
    p = SamplingParams(max_tokens=6, seed=5)
    before = gen.generate(PROMPTS, p)
    assert {s.version for s in before} == {0}
    sd = full_state_dict(model)
    sd = {k: v + 0.05 * torch.randn_like(v) for k, v in sd.items()}
    gen.update_weights(sd, version=3)
    after = gen.generate(PROMPTS, p)
    assert {s.version for s in after} == {3}
    assert [s.logprobs for s in before] != [s.logprobs for s in after]
    # a partial update (only some tensors, as a LoRA adapter would be) keeps the rest
    name = "norm.weight"
    gen.update_weights({name: torch.ones_like(sd[name]) * 2}, version=4)
    assert torch.equal(gen.model.state_dict()[name], torch.full_like(sd[name], 2.0))
    assert torch.equal(gen.model.state_dict()["lm_head.weight"], sd["lm_head.weight"])
    with pytest.raises(KeyError, match="not in the generator"):
        gen.update_weights({"nope.weight": torch.zeros(1)}, version=5)


def test_mismatch_zero_with_shared_numerics_and_nonzero_in_bf16(model):
    p = SamplingParams(max_tokens=10, n=2, seed=7)
    stats = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        gen = Generator.from_model(model, dtype=dtype)
        samples = gen.generate(PROMPTS, p)
        gen_lp, train_lp = [], []
        for s in samples:
            train_lp.append(full_forward_logprobs(model, PROMPTS[s.prompt_index], s.tokens, 1.0))
            gen_lp.append(s.logprobs)
        stats[name] = mismatch_stats(gen_lp, train_lp)
    assert stats["fp32"]["train_infer_max_abs_diff"] < 1e-5
    assert abs(stats["fp32"]["train_infer_kl"]) < 1e-6
    assert stats["bf16"]["train_infer_max_abs_diff"] > 1e-3
    assert stats["bf16"]["train_infer_kl"] > 100 * max(abs(stats["fp32"]["train_infer_kl"]), 1e-9)


def test_sampling_params_and_vllm_errors():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises((RuntimeError, NotImplementedError), match="native"):
        vllm_generator()


def test_trainable_only_update_carries_just_the_adapter_like_parameters(model):
    """With a frozen base (as under LoRA), the update holds only the trainable tensors."""
    import copy

    trainer_model = copy.deepcopy(model)
    for n, p in trainer_model.named_parameters():
        p.requires_grad_(n in ("norm.weight", "lm_head.weight"))
    with torch.no_grad():
        trainer_model.lm_head.weight.mul_(1.5)
    sd = full_state_dict(trainer_model, trainable_only=True)
    assert sorted(sd) == ["lm_head.weight", "norm.weight"]
    gen = Generator.from_model(model)
    gen.update_weights(sd, version=1)
    p = SamplingParams(max_tokens=5, seed=11)
    s = gen.generate(PROMPTS[:1], p)[0]
    ref = full_forward_logprobs(trainer_model, PROMPTS[0], s.tokens, 1.0)
    assert max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)) < 1e-5


def test_teacher_forced_score_equals_sampling_logprobs(model):
    gen = Generator.from_model(model)
    samples = gen.generate(PROMPTS, SamplingParams(max_tokens=6, n=2, seed=13, temperature=0.8))
    scored = gen.score([PROMPTS[s.prompt_index] for s in samples], [s.tokens for s in samples], 0.8)
    worst = max(
        abs(a - b)
        for s, sc in zip(samples, scored, strict=True)
        for a, b in zip(s.logprobs, sc, strict=True)
    )
    assert worst < 1e-5, worst
