"""Reward functions for the RL integration tests (named in recipes as module:function)."""

from __future__ import annotations

import os

from rl.envs import Task, positional_match

_calls = 0


def flaky(task: Task, completion: str) -> float:
    """Raises for prompts containing a 7: those groups must be counted and skipped."""
    if "7" in task.prompt:
        raise ValueError(f"reward service unavailable for {task.prompt}")
    return positional_match(task.answer, completion)


def fails_after(task: Task, completion: str) -> float:
    """Works for RL_TEST_FAIL_AFTER calls, then raises (a reward service going down)."""
    global _calls
    _calls += 1
    if _calls > int(os.environ.get("RL_TEST_FAIL_AFTER", "1000000")):
        raise RuntimeError("reward service went down")
    return positional_match(task.answer, completion)


_nan_calls = 0


def nan_after(task: Task, completion: str) -> float:
    """Works for RL_TEST_NAN_AFTER calls, then returns NaN (a broken reward model)."""
    global _nan_calls
    _nan_calls += 1
    if _nan_calls > int(os.environ.get("RL_TEST_NAN_AFTER", "1000000")):
        return float("nan")
    return positional_match(task.answer, completion)


def by_length(task: Task, completion: str) -> float:
    """A reward that varies within every group (so advantages, and the loss, are not 0)."""
    return len(completion) / 10.0
