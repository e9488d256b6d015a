"""Greedy decoding takes an argmax (rl.generator `_one_token`), not a sort of the vocabulary
and a multinomial draw, and returns what the sampling path returns: the same tokens and the
same reported logprobs, bit for bit, for both ways greedy is asked for (top_p = 1e-9, the RL
loop's held-out evaluation; temperature 1e-6, the service's temperature 0)."""

from __future__ import annotations

import pytest
import torch

import rl.generator
from rl.generator import Generator, SamplingParams
from tests.helpers.tiny_llama import tiny_llama

PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13], [300, 1, 2]]


@pytest.fixture(scope="module")
def gen():
    return Generator.from_model(tiny_llama(seed=2))


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(SamplingParams(max_tokens=16, top_p=1e-9, seed=4), id="top_p"),
        pytest.param(SamplingParams(max_tokens=16, temperature=1e-6, seed=4), id="temperature"),
    ],
)
def test_greedy_takes_the_argmax_with_the_sampling_paths_outputs(gen, params, monkeypatch):
    draws = []
    multinomial = torch.multinomial
    monkeypatch.setattr(
        torch, "multinomial", lambda *a, **k: draws.append(1) or multinomial(*a, **k)
    )
    fast = gen.generate(PROMPTS, params)
    assert draws == []  # no draw (and so no nucleus sort) at any step
    monkeypatch.setattr(rl.generator, "_one_token", lambda *a: False)  # the sampling path
    slow = gen.generate(PROMPTS, params)
    assert len(draws) == params.max_tokens  # it really sampled, once per step
    assert [s.tokens for s in fast] == [s.tokens for s in slow]
    assert [s.logprobs for s in fast] == [s.logprobs for s in slow]
    assert len({tuple(s.tokens) for s in fast}) > 1  # prompts steer it: not a constant


def test_sampling_is_unchanged_where_more_than_one_token_can_be_drawn(gen, monkeypatch):
    """top_p that keeps several tokens, and temperature 1: the draw stays (same seed, same
    samples as with the argmax check switched off)."""
    params = SamplingParams(max_tokens=8, top_p=0.9, n=3, seed=7)
    ours = gen.generate(PROMPTS, params)
    monkeypatch.setattr(rl.generator, "_one_token", lambda *a: False)
    assert [s.tokens for s in gen.generate(PROMPTS, params)] == [s.tokens for s in ours]
    assert len({tuple(s.tokens) for s in ours[:3]}) > 1  # sampled, not greedy
