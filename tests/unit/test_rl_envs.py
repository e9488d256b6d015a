"""Built-in environments, held-out split, rewards and user callables."""

from __future__ import annotations

import zlib

import pytest

from rl.envs import Arithmetic, LetterSort, Task, is_held_out, load_callable, make_env


def test_arithmetic_and_letter_sort_answers_are_right():
    for t in Arithmetic().tasks("train", 50, seed=0):
        a, b = t.prompt[:-1].split("+")
        assert int(t.answer) == int(a) + int(b)
    for t in LetterSort().tasks("eval", 20, seed=0):
        letters = t.prompt.removeprefix("sort: ").split(" ")
        assert t.answer == " ".join(sorted(letters)) and 3 <= len(letters) <= 5
        assert zlib.crc32(t.prompt.encode()) % 1000 < 100  # the SFT task's held-out rule


def test_held_out_split_is_disjoint_and_deterministic():
    env = Arithmetic()
    train = {t.prompt for t in env.tasks("train", 300, seed=1)}
    ev = {t.prompt for t in env.tasks("eval", 30, seed=1)}
    assert not train & ev
    assert all(is_held_out(p) for p in ev) and not any(is_held_out(p) for p in train)
    assert [t.prompt for t in env.tasks("eval", 30, seed=1)] == [
        t.prompt for t in env.tasks("eval", 30, seed=1)
    ]


def test_reward():
    env = Arithmetic()
    t = Task("12+30=", "42")
    assert env.reward(t, " 42 ") == 1.0
    assert env.reward(t, "41") == pytest.approx(0.25)
    assert env.reward(t, "") == 0.0


def exact_reward(task: Task, completion: str) -> float:
    return 2.0 if completion == task.answer else -1.0


def test_user_reward_and_errors():
    env = make_env("letter_sort", "tests.unit.test_rl_envs:exact_reward")
    t = Task("sort: c b a", "a b c")
    assert env.reward(t, "a b c") == 2.0 and env.reward(t, "a b") == -1.0
    with pytest.raises(ValueError, match="module:function"):
        load_callable("nocolon")
    with pytest.raises(ValueError, match="cannot import"):
        load_callable("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no callable"):
        load_callable("rl.envs:nothing_here")


def test_eval_prompts_are_distinct_and_capped_by_the_task_space():
    ev = Arithmetic(max_operand=20).tasks("eval", 500, seed=0)
    prompts = [t.prompt for t in ev]
    assert len(prompts) == len(set(prompts)) == 55  # every held-out a+b with a, b < 20
