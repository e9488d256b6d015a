"""User hooks that misbehave, named in recipes as 'tests.helpers.rl_hooks:NAME' by the RL
reliability tests (rl/hooks.py guards them)."""

from __future__ import annotations

import os
import sys
import time

from rl.envs import Arithmetic, Task, positional_match

_calls = 0


def _after() -> bool:
    """True once RL_HOOK_BAD_AFTER calls have passed (default: from the first call), and
    only on rank RL_HOOK_BAD_RANK when that is set (the other ranks stay good)."""
    global _calls
    _calls += 1
    only = os.environ.get("RL_HOOK_BAD_RANK")
    if only is not None and os.environ.get("RANK", "0") != only:
        return False
    return _calls > int(os.environ.get("RL_HOOK_BAD_AFTER", "0"))


def good(task: Task, completion: str) -> float:
    return positional_match(task.answer, completion)


def nan_reward(task: Task, completion: str) -> float:
    return float("nan") if _after() else good(task, completion)


def inf_reward(task: Task, completion: str) -> float:
    return float("-inf")


def huge_reward(task: Task, completion: str) -> float:
    return 1e308  # finite in Python, inf in float32


def str_reward(task: Task, completion: str) -> str:
    return "1.0"


def none_reward(task: Task, completion: str) -> None:
    return None


def raising_reward(task: Task, completion: str) -> float:
    raise ValueError("the grader is down")


def exit_reward(task: Task, completion: str) -> float:
    if _after():
        sys.exit(3)
    return good(task, completion)


def hang_reward(task: Task, completion: str) -> float:
    time.sleep(3600)
    return 0.0


def two_args_only(task: Task) -> float:  # a wrong signature: TypeError when called
    return 0.0


def raising_factory():
    raise RuntimeError("cannot reach the task server")


def keyerror_factory():
    return {"a": 1}["missing"]


def none_factory():
    return None


def str_factory():
    return "arithmetic"


def exit_factory():
    sys.exit(0)


class _Empty(Arithmetic):
    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        return []


def empty_env():
    return _Empty()


class _Dicts(Arithmetic):
    def tasks(self, split: str, n: int, seed: int):  # type: ignore[override]
        return [{"prompt": "1+1=", "answer": "2"}]


def dict_tasks_env():
    return _Dicts()


class _NoReward:
    name = "no_reward"

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        return [Task("1+1=", "2")]


def no_reward_env():
    return _NoReward()


class _HangingTasks(Arithmetic):
    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        time.sleep(3600)
        return []


def hanging_tasks_env():
    return _HangingTasks()


def raising_after(task: Task, completion: str) -> float:
    """Scores as `good` for RL_HOOK_BAD_AFTER calls (the pre-run check), then always raises:
    with rl.on_error = "skip" every rollout of the run fails."""
    if _after():
        raise ValueError("the grader is down")
    return good(task, completion)
