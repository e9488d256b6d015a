"""Multi-turn RL's rows: an episode is one rollout whose loss sees only the model's tokens.

References are built by hand from the conversation (positions written out, numpy sums), not
from rl.trainer's collate: the environment's reply tokens must be in no loss term, in no
loss denominator and carry no sampling logprob; the model's tokens must be scored at the
position that predicts them (logprob index t scores token t + 1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from rl.envs import ChainSum, Reply, Task, make_env
from rl.hooks import HookError
from rl.losses import LossBatch, LossConfig, get_loss
from rl.multiturn import reference_episode, run_episodes
from rl.trainer import Rollout, collate

# A conversation written out: B = BOS, P = first prompt, M = model turn, E = environment reply.
#            B   P   P   M   M   E   E   M   E   M   M   M
TOKENS = [1, 10, 11, 20, 21, 30, 31, 22, 32, 23, 24, 25]
KIND = ["B", "P", "P", "M", "M", "E", "E", "M", "E", "M", "M", "M"]
MODEL_LP = [-0.5, -1.0, -0.25, -2.0, -0.1, -0.3]  # sampling logprobs of the 6 M tokens, in order


def _episode_rollout(adv: float = 1.5) -> Rollout:
    from rl.loop import RLRun
    from rl.multiturn import Episode

    ep = Episode(Task("x", "y"), list(TOKENS), [k == "M" for k in KIND], list(MODEL_LP))
    ep.versions, ep.reward = [3, 2, 3], 0.5
    return RLRun.episode_rollout(ep, adv, group=0)


def test_episode_rollout_masks_only_the_model_tokens():
    r = _episode_rollout()
    assert r.prompt == TOKENS[:3] and r.completion == TOKENS[3:]
    assert r.version == 2  # the oldest turn's weights: lag never understated
    c = collate([r, Rollout([1, 10], [40, 41], [-0.7, -0.9], 1.0)], pad_id=0,
                device=torch.device("cpu"))  # fmt: skip
    # by hand: token i (i >= 1) is predicted at logprob index i - 1
    want = np.zeros((2, len(TOKENS) - 1))
    slp = np.zeros_like(want)
    model_positions = [i - 1 for i, k in enumerate(KIND) if k == "M"]
    assert model_positions == [2, 3, 6, 8, 9, 10]
    want[0, model_positions] = 1
    slp[0, model_positions] = MODEL_LP
    want[1, [1, 2]] = 1  # a single-turn rollout: every completion token, as before
    slp[1, [1, 2]] = [-0.7, -0.9]
    np.testing.assert_array_equal(c.mask.numpy(), want)
    np.testing.assert_allclose(c.sampling_logprobs.numpy(), slp)
    # the rows are the whole conversation: the environment's tokens are the model's context
    assert c.rows.inputs[0].tolist() == TOKENS[:-1] and c.rows.targets[0].tolist() == TOKENS[1:]


@pytest.mark.parametrize("loss", ["grpo", "cross_entropy", "cispo"])
def test_loss_ignores_environment_tokens(loss):
    """The built-in losses on an episode row equal a numpy reference over the model's six
    tokens only (token_mean: their count is the denominator), and the gradient at every
    environment or prompt position is exactly zero."""
    c = collate([_episode_rollout(adv=1.5)], pad_id=0, device=torch.device("cpu"))
    T = c.mask.shape[1]
    g = torch.Generator().manual_seed(0)
    lp = (torch.rand(1, T, generator=g, dtype=torch.float64) * -2).requires_grad_(True)
    old = lp.detach() + torch.randn(1, T, generator=g, dtype=torch.float64) * 0.2
    batch = LossBatch(mask=c.mask.double(), advantages=c.advantages.double(),
                      sampling_logprobs=c.sampling_logprobs.double(), old_logprobs=old)  # fmt: skip
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    out = get_loss(loss, cfg)(lp, batch)
    out.backward()

    pos = [i - 1 for i, k in enumerate(KIND) if k == "M"]
    x, o, a = lp.detach().numpy()[0, pos], old.numpy()[0, pos], 1.5
    r = np.exp(x - o)
    if loss == "grpo":
        per = -np.minimum(r * a, np.clip(r, 0.8, 1.28) * a)
    elif loss == "cispo":
        per = -np.clip(r, 0.8, 1.28) * a * x
    else:
        per = -x
    assert float(out.detach()) == pytest.approx(per.sum() / 6, rel=1e-12)
    grad = lp.grad.numpy()[0]
    others = [t for t in range(T) if t not in pos]
    assert np.all(grad[others] == 0.0) and np.any(grad[pos] != 0.0)


class Scripted:
    """A generator stand-in that answers each turn with the given token lists."""

    def __init__(self, answers: list[list[int]], version: int = 0) -> None:
        self.answers, self.version, self.calls = answers, version, 0

    def generate(self, prompts, params):
        from rl.generator import Sample

        out = []
        for i, _ in enumerate(prompts):
            ids = self.answers[self.calls]
            out.append(Sample(i, list(ids), [-0.1] * len(ids), "stop", self.version))
        self.calls += 1
        return out


def _codec():
    enc = lambda s: [1, *(ord(ch) for ch in s)]  # noqa: E731
    reply = lambda s: [ord(ch) for ch in s]  # noqa: E731
    dec = lambda ids: "".join(chr(i) for i in ids if i != 2)  # noqa: E731  (2: the stop token)
    turn = lambda s: [*(ord(ch) for ch in s), 2]  # noqa: E731
    return enc, reply, dec, turn


def test_reference_episode_is_the_replay_of_right_answers():
    """The warmup's conversation (reference_episode) equals run_episodes driven by a
    generator that samples the right answers; the reward is 1 and the mask marks exactly the
    answers and their stop tokens."""
    from rl.generator import SamplingParams

    env = ChainSum(turns=3)
    task = env.tasks("train", 1, seed=4)[0]
    enc, reply, dec, turn = _codec()
    right = env.reference_turns(task)
    played = run_episodes(Scripted([turn(t) for t in right]), env, [task], encode=enc,
                          encode_reply=reply, decode=dec, params=SamplingParams(max_tokens=4))[0]  # fmt: skip
    ref = reference_episode(env, task, right, encode=enc, encode_turn=turn, encode_reply=reply)
    assert ref.tokens == played.tokens and ref.model_mask == played.model_mask
    assert played.reward == ref.reward == 1.0 and played.turns == right
    assert [t for t, m in zip(played.tokens, played.model_mask, strict=True) if m] == [
        x for t in right for x in turn(t)
    ]


def test_episodes_stop_before_outgrowing_max_len():
    from rl.generator import SamplingParams

    env = ChainSum(turns=3)
    task = env.tasks("train", 1, seed=4)[0]
    enc, reply, dec, _ = _codec()
    ep = run_episodes(Scripted([[50, 2]] * 3), env, [task], encode=enc, encode_reply=reply,
                      decode=dec, params=SamplingParams(max_tokens=4), max_len=len(enc(task.prompt)) + 8)  # fmt: skip
    assert len(ep[0].turns) == 1 and ep[0].reward == 0.0  # a second turn would pass max_len


def test_guarded_multi_turn_environment():
    env = make_env("chain_sum")
    assert env.multi_turn
    task = env.tasks("train", 1, seed=0)[0]
    assert env.reply(task, env.reference_turns(task)) == Reply(None, 1.0)

    class Bad(ChainSum):
        def reply(self, task, turns):
            return Reply("+1=", float("nan"))

    import rl.envs

    rl.envs.BUILTIN_ENVS["_bad_multi"] = Bad
    try:
        with pytest.raises(HookError, match="not finite") as e:
            make_env("_bad_multi").reply(task, ["3"])
        assert e.value.key == "rl.env" and "after turn 1" in str(e.value)
    finally:
        del rl.envs.BUILTIN_ENVS["_bad_multi"]
    with pytest.raises(HookError, match="single-turn") as e:
        make_env("chain_sum", "tests.integration._rl_rewards:flaky")
    assert e.value.key == "rl.reward"


def test_recipe_refuses_a_reward_for_chain_sum():
    from recipe.loader import load_recipe

    load_recipe("recipes/rl_multiturn_debug.toml", [])
    with pytest.raises(ConfigError, match="multi-turn") as e:
        load_recipe("recipes/rl_multiturn_debug.toml", ["rl.reward=a:b"])
    assert e.value.key == "rl.reward"
    with pytest.raises(ConfigError) as e:
        load_recipe("recipes/rl_multiturn_debug.toml", ["rl.max_turns=0"])
    assert e.value.key == "rl.max_turns"


class _NoReference(ChainSum):
    reference_turns = None  # type: ignore[assignment]  # a multi-turn env without it


def no_reference_env() -> _NoReference:
    return _NoReference()


def test_check_before_any_process_group():
    """rl.loop.check on the multi-turn recipe: the environment's reply to its reference turns
    is checked; a warmup with an environment that has no reference turns is one line naming
    rl.sft_warmup_steps; without a warmup that environment passes."""
    from types import SimpleNamespace

    from recipe.loader import load_recipe
    from rl.loop import check

    def run(overrides):
        check(SimpleNamespace(recipe=load_recipe("recipes/rl_multiturn_debug.toml", overrides)))

    run([])
    env = "rl.env=tests.unit.test_rl_multiturn:no_reference_env"
    with pytest.raises(ConfigError, match="reference_turns") as e:
        run([env])
    assert e.value.key == "rl.sft_warmup_steps"
    run([env, "rl.sft_warmup_steps=0"])
