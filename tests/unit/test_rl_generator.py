"""KV-cache generator against the model's own full forward (fp32; Llama 3 and Qwen3's q/k
norms), one prefill per prompt shared by its samples, sampling controls (top-p, top-k, stop
tokens and strings), a private RNG, versioned weight updates and the mismatch metric."""

from __future__ import annotations

import pytest
import torch

from rl.generator import Generator, SamplingParams
from rl.mismatch import mismatch_stats
from rl.policy import forward_logits, full_state_dict, token_logprobs
from tests.helpers.tiny_llama import tiny_llama, tiny_qwen3

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


def test_sampling_params_errors():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


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


def _worst_gap(model, samples, prompts, temperature=1.0):
    worst = 0.0
    for s in samples:
        ref = full_forward_logprobs(model, prompts[s.prompt_index], s.tokens, temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)))
    return worst


def test_qwen3_qk_norm_path_matches_full_forward():
    model = tiny_qwen3()
    with torch.no_grad():  # non-trivial q/k norm weights: skipping them would show
        for layer in model.layers.values():
            layer.attention.q_norm.weight.uniform_(0.5, 1.5)
            layer.attention.k_norm.weight.uniform_(0.5, 1.5)
    gen = Generator.from_model(model)
    samples = gen.generate(PROMPTS, SamplingParams(max_tokens=10, n=2, temperature=0.9, seed=2))
    assert _worst_gap(model, samples, PROMPTS, 0.9) < 1e-5


def test_each_prompt_is_prefilled_once_for_all_its_samples(model):
    """4 samples of 3 prompts, decoded in batches of 3 rows: the embedding sees the prompts'
    prefill once (3 rows), never 12, and every sample is still the model's own forward."""
    prompts = [[5, 17, 99, 3], [42, 8], [7, 8, 9, 10, 11, 12, 13]]  # decode steps are 1 wide
    gen = Generator.from_model(model, max_batch=3)
    prefill_rows = []
    hook = gen.model.tok_embeddings.register_forward_hook(
        lambda m, args, out: prefill_rows.append(args[0].shape[0]) if args[0].shape[1] > 1 else None
    )
    try:
        samples = gen.generate(prompts, SamplingParams(max_tokens=6, n=4, seed=4))
        wide = Generator.from_model(model, max_batch=12)
        wide.model.tok_embeddings.register_forward_hook(
            lambda m, args, out: (
                prefill_rows.append(args[0].shape[0]) if args[0].shape[1] > 1 else None
            )
        )
        wide.generate(prompts, SamplingParams(max_tokens=6, n=4, seed=4))
    finally:
        hook.remove()
    # max_batch 3 < n 4: one prompt per prefill, its 4 samples in batches of 3 and 1;
    # max_batch 12: the three prompts in one prefill of 3 rows, then 12 sample rows.
    assert prefill_rows == [1, 1, 1, 3]
    assert [s.prompt_index for s in samples] == [i for i in range(3) for _ in range(4)]
    assert _worst_gap(model, samples, prompts) < 1e-5
    assert len({tuple(s.tokens) for s in samples[:4]}) > 1  # sampled, not copied


def test_sampling_leaves_the_global_rng_alone(model):
    gen = Generator.from_model(model)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = gen.generate(PROMPTS[:1], SamplingParams(max_tokens=8, n=4))
    b = gen.generate(PROMPTS[:1], SamplingParams(max_tokens=8, n=4))
    assert torch.equal(torch.get_rng_state(), state)
    assert [s.tokens for s in a] != [s.tokens for s in b]  # unseeded: fresh draws each time


def test_top_k_keeps_only_the_k_most_likely_tokens(model):
    gen = Generator.from_model(model)
    greedy = gen.generate(PROMPTS[:1], SamplingParams(max_tokens=6, top_k=1, seed=9))[0]
    toks = torch.tensor([PROMPTS[0] + greedy.tokens])
    with torch.no_grad():
        logits = forward_logits(model, toks)[0, len(PROMPTS[0]) - 1 : -1]
    assert greedy.tokens == logits.argmax(-1).tolist()
    k = 3
    samples = gen.generate(PROMPTS, SamplingParams(max_tokens=6, n=4, top_k=k, seed=10))
    for s in samples:
        p = PROMPTS[s.prompt_index]
        with torch.no_grad():
            lg = forward_logits(model, torch.tensor([p + s.tokens]))[0, len(p) - 1 : -1]
        top = lg.topk(k, dim=-1).indices
        assert all(t in top[i].tolist() for i, t in enumerate(s.tokens))
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)


def test_stop_strings_end_on_the_token_that_completes_them(model):
    """A toy decoder (token id -> one letter): the stop string is matched on the decoded
    completion, across token boundaries, and the sample keeps the completing token."""

    def decode(ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    gen = Generator.from_model(model, decode=decode)
    free = gen.generate(PROMPTS[:1], SamplingParams(max_tokens=12, top_k=1, seed=1))[0]
    text = decode(free.tokens)
    stop = text[4:6]  # two letters spanning tokens 4 and 5 of the greedy completion
    first = text.index(stop)
    s = gen.generate(
        PROMPTS[:1], SamplingParams(max_tokens=12, top_k=1, seed=1, stop_strings=(stop,))
    )[0]
    assert s.finish_reason == "stop" and s.tokens == free.tokens[: first + 2]
    assert decode(s.tokens).endswith(stop) and stop not in decode(s.tokens[:-1])
    with pytest.raises(ValueError, match="decode"):
        Generator.from_model(model).generate(
            PROMPTS[:1], SamplingParams(max_tokens=2, stop_strings=("x",))
        )
