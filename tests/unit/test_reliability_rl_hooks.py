"""RL user hooks (environments, rewards, custom losses) behind one guard (rl/hooks.py).

Before: a reward of NaN, inf or 1e308 trained (loss nan, NaN optimizer state saved); a
reward calling sys.exit ended the run silently; a hanging reward hung it; an environment
with no tasks gave loss nan; a factory that raised, returned None or a string, and a
reward module with a syntax or import error were tracebacks; a factory raising KeyError was
reported as "unknown environment". Now each is one line naming the recipe key, the hook
and the task: through `rl.loop.check` (what train.py runs before any process group), the
guarded environment `rl.envs.make_env` returns, and the loop's own `make_batch` (a group
with a bad reward is skipped and counted, or stops the run under on_error = "fail").
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import ConfigError
from recipe.loader import load_recipe
from rl.envs import make_env
from rl.hooks import HookError, find_hook_error, hook_errors_as_config_errors, load_loss
from tests.helpers.guards import alarm_guard
from tools.reliability_report import record_case

H = "tests.helpers.rl_hooks"


def hang_guard(seconds: float = 20.0):
    """The old code hangs on a hanging hook: fail instead of waiting forever."""
    return alarm_guard(seconds)


def check(overrides: list[str]) -> None:
    from rl.loop import check as rl_check

    rl_check(SimpleNamespace(recipe=load_recipe("recipes/rl_debug.toml", overrides)))


def refused(overrides: list[str], key: str, *needles: str, kind: str) -> str:
    with hang_guard(), pytest.raises(ConfigError) as e:
        check(overrides)
    msg = str(e.value)
    assert e.value.key == key and "\n" not in msg, msg
    assert msg.startswith("--set ") or msg.startswith("recipes/rl_debug.toml"), msg
    for n in needles:
        assert n in msg, (n, msg)
    record_case("RL hooks", kind)
    return msg


@pytest.mark.parametrize(
    "name,needles",
    [
        ("nan_reward", ["returned nan", "task '"]),
        ("inf_reward", ["returned -inf"]),
        ("huge_reward", ["1e+308", "float32"]),
        ("str_reward", ["returned '1.0'", "expected a number"]),
        ("none_reward", ["returned NoneType"]),
        ("raising_reward", ["raised ValueError: the grader is down"]),
        ("exit_reward", ["called sys.exit(3)"]),
        ("two_args_only", ["raised TypeError"]),
    ],
)
def test_bad_reward_refused_before_the_process_group(name, needles):
    refused([f"rl.reward={H}:{name}"], "rl.reward", f"{H}:{name}", *needles,
            kind=f"reward: {name}")  # fmt: skip


def test_hanging_reward_times_out():
    msg = refused([f"rl.reward={H}:hang_reward", "rl.hook_timeout_s=0.5"], "rl.reward",
                  "did not return within 0.5 s (rl.hook_timeout_s)", kind="reward: hang")  # fmt: skip
    assert "task '" in msg


@pytest.mark.parametrize(
    "name,needles",
    [
        ("raising_factory", ["raised RuntimeError: cannot reach the task server"]),
        ("keyerror_factory", ["raised KeyError"]),
        ("none_factory", ["returned NoneType", "tasks(split, n, seed)"]),
        ("str_factory", ["returned 'arithmetic'"]),
        ("exit_factory", ["called sys.exit(0)"]),
        ("empty_env", ["returned no tasks"]),
        ("dict_tasks_env", ["returned dict", "as task 0"]),
        ("no_reward_env", ["no reward(task, completion) method"]),
    ],
)
def test_bad_environment_refused_before_the_process_group(name, needles):
    msg = refused([f"rl.env={H}:{name}"], "rl.env", *needles, kind=f"environment: {name}")
    assert "unknown environment" not in msg  # a KeyError inside a factory is not a name


def test_hanging_tasks_time_out():
    refused([f"rl.env={H}:hanging_tasks_env", "rl.hook_timeout_s=0.5"], "rl.env",
            "tasks('train'", "did not return within 0.5 s", kind="environment: hang")  # fmt: skip


def test_hook_modules_that_do_not_import(tmp_path, monkeypatch):
    (tmp_path / "rl_syntax_bad.py").write_text("def reward(task, completion):\n    return (\n")
    (tmp_path / "rl_import_bad.py").write_text("import no_such_package_q\n")
    (tmp_path / "rl_raises_bad.py").write_text("raise RuntimeError('config missing')\n")
    (tmp_path / "rl_exits_bad.py").write_text("import sys\nsys.exit(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    refused(["rl.reward=rl_syntax_bad:reward"], "rl.reward", "SyntaxError", "line 2",
            kind="module: syntax error")  # fmt: skip
    refused(["rl.reward=rl_import_bad:reward"], "rl.reward", "no_such_package_q",
            kind="module: import error")  # fmt: skip
    refused(["rl.env=rl_raises_bad:make"], "rl.env", "RuntimeError: config missing",
            kind="module: raises on import")  # fmt: skip
    refused(["rl.loss=custom", "rl.custom_loss=rl_exits_bad:loss"], "rl.custom_loss",
            "SystemExit", kind="module: sys.exit on import")  # fmt: skip
    refused(["rl.env=nothing_such"], "rl.env", "unknown environment", kind="unknown name")
    for m in ("rl_syntax_bad", "rl_import_bad", "rl_raises_bad", "rl_exits_bad"):
        sys.modules.pop(m, None)


# -- the loop: a bad reward mid-run is skipped and counted, or stops in one line ---------------
class _Tok:
    eos_id = 2

    def encode(self, text, add_bos=True, add_eos=False):
        return [1] + [3 + ord(c) % 200 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 3) for i in ids if i > 2)


class _Gen:
    """Samples without a model: each completion is the digits '7' then EOS."""

    def generate(self, prompts, params):
        from rl.generator import Sample

        return [Sample(i // params.n, [3 + ord("7"), 2], [-1.0, -1.0], "stop", 0)
                for i in range(len(prompts) * params.n)]  # fmt: skip


def _run(reward: str, on_error: str):
    from rl.generator import SamplingParams
    from rl.loop import RLRun

    rl = load_recipe("recipes/rl_debug.toml", [f"rl.reward={H}:{reward}",
                     f"rl.on_error={on_error}", "rl.prompts_per_step=3"]).rl  # fmt: skip
    r = object.__new__(RLRun)
    r.rl, r.rank, r.tok, r.eos, r.generator = rl, 0, _Tok(), 2, _Gen()
    r.microbatch_tokens = 1 << 20  # generation in one chunk (the loop splits by this budget)
    r.env = make_env(rl.env, rl.reward, timeout_s=rl.hook_timeout_s)
    r.sampling = SamplingParams(max_tokens=2, n=rl.group_size)
    return r


@pytest.mark.parametrize("reward", ["nan_reward", "huge_reward", "exit_reward", "str_reward"])
def test_bad_reward_mid_run_is_skipped_and_named(reward):
    batch = _run(reward, "skip").make_batch(1)
    assert batch.rollouts == [] and len(batch.errors) == 3  # every group skipped, counted
    assert all(f"rl.reward: reward '{H}:{reward}' on task " in e for e in batch.errors)
    record_case("RL hooks", "bad reward mid-run (skipped)")


@pytest.mark.parametrize("reward", ["nan_reward", "exit_reward"])
def test_bad_reward_mid_run_fails_in_one_line(reward):
    from rl.loop import RolloutFailure

    with pytest.raises(RolloutFailure) as e:
        _run(reward, "fail").make_batch(1)
    assert isinstance(find_hook_error(e.value), HookError)
    with pytest.raises(HookError) as h, hook_errors_as_config_errors("r.toml"):
        raise e.value
    msg = str(h.value)
    assert msg.startswith("r.toml: rl.reward: reward ") and "\n" not in msg, msg
    record_case("RL hooks", "bad reward mid-run (fail)")


# -- custom losses ------------------------------------------------------------------------------
def loss_float(logprobs, batch):
    return 0.5


def loss_vector(logprobs, batch):
    return logprobs.sum(-1)


def loss_detached(logprobs, batch):
    return logprobs.detach().sum()


def loss_raises(logprobs, batch):
    raise ZeroDivisionError("division by zero")


def loss_exits(logprobs, batch):
    sys.exit(0)


def loss_ok(logprobs, batch):
    return -(logprobs * batch).sum()


@pytest.mark.parametrize(
    "name,needle",
    [
        ("loss_float", "returned float"),
        ("loss_vector", "of shape [2]"),
        ("loss_detached", "without a gradient"),
        ("loss_raises", "raised ZeroDivisionError"),
        ("loss_exits", "called sys.exit(0)"),
    ],
)
def test_custom_loss_guard(name, needle):
    fn = load_loss(f"{__name__}:{name}")
    logprobs = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(HookError) as e:
        fn(logprobs, torch.ones(2, 3))
    assert e.value.key == "rl.custom_loss" and needle in str(e.value), str(e.value)
    record_case("RL hooks", f"custom loss: {name}")
    good = load_loss(f"{__name__}:loss_ok")(logprobs, torch.ones(2, 3))
    good.backward()
    assert torch.equal(logprobs.grad, -torch.ones(2, 3))  # d/dx of -sum(x): the loss is intact


# -- fuzzed reward values -------------------------------------------------------------------------
REWARDS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**1100), max_value=2**1100),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.lists(st.floats(), max_size=2),
    st.sampled_from([np.float32("nan"), np.float64(1e308), np.int64(7), np.float16(0.5)]),
)


@settings(max_examples=200, deadline=None)
@given(value=REWARDS)
def test_fuzzed_reward_values(value):
    """Whatever a reward returns: a float equal to it (a real number, finite in float32, at
    most 1e30 in size; reference: Python's own float and math.isfinite), or one HookError
    line naming the reward."""
    import math
    import numbers

    from rl.hooks import MAX_REWARD, check_reward

    try:
        got = check_reward(value, key="rl.reward", what="reward 'm:f' on task '1+1='")
    except HookError as e:
        assert e.key == "rl.reward" and "\n" not in str(e) and "reward 'm:f'" in str(e)
        if isinstance(value, numbers.Real):
            try:
                f = float(value)
            except OverflowError:
                f = math.inf
            assert not math.isfinite(f) or abs(f) > MAX_REWARD, value
        record_case("RL hooks", "fuzzed reward value (refused)")
        return
    assert isinstance(value, numbers.Real) and got == float(value) and abs(got) <= MAX_REWARD
    record_case("RL hooks", "fuzzed reward value")
