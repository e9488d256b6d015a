"""Environments: prompt -> completion(s) -> reward.

An environment is any object with `tasks(split, n, seed) -> list[Task]` and
`reward(task, completion) -> float` (single-turn; the completion is decoded text without
the stop token). Built in, generated here (no downloads):
- arithmetic: "23+58=" -> "81"
- letter_sort: "sort: d a c" -> "a c d"
Both split deterministically into train and held-out prompts by a hash of the prompt, so the
evaluation prompts are never trained on. A user environment or reward is a Python callable
named in the recipe as "module:function" (rl.env = a factory returning an environment;
rl.reward = a function (task, completion) -> float that replaces the environment's reward).

Multi-turn environments (`MultiTurnEnv`) have `reply(task, turns) -> Reply` instead of
`reward`: given the model's turns so far (decoded text), the environment's next message (None
ends the episode) and the episode's reward so far; rl.multiturn drives the episodes. Built in:
- chain_sum: "3+4=" -> "7", then "+5=" -> "12", ... for `turns` turns; reward: the fraction
  of turns whose answer was the running sum.
"""

from __future__ import annotations

import importlib
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rl.hooks import DEFAULT_TIMEOUT_S, GuardedEnv, HookError, make_guarded

HELD_OUT_EVERY = 8  # one prompt in 8 is held out for evaluation


@dataclass(frozen=True)
class Task:
    prompt: str
    answer: str
    info: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


class Environment(Protocol):
    name: str

    def tasks(self, split: str, n: int, seed: int) -> list[Task]: ...

    def reward(self, task: Task, completion: str) -> float: ...


def is_held_out(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % HELD_OUT_EVERY == 0


def positional_match(answer: str, completion: str) -> float:
    """1.0 for an exact answer, else the fraction of characters in the right place (over the
    longer of the two): a dense signal that a tiny model can climb."""
    c = completion.strip()
    if c == answer:
        return 1.0
    n = max(len(answer), len(c), 1)
    return 0.5 * sum(a == b for a, b in zip(answer, c, strict=False)) / n


@dataclass(frozen=True)
class Reply:
    message: str | None  # the environment's next message; None: the episode is over
    reward: float  # the episode's reward so far (the last reply's is the episode's)


class MultiTurnEnv(Protocol):
    name: str

    def tasks(self, split: str, n: int, seed: int) -> list[Task]: ...

    def reply(self, task: Task, turns: list[str]) -> Reply: ...


class _Generated:
    name = "generated"

    @staticmethod
    def held_out(prompt: str) -> bool:
        return is_held_out(prompt)

    def make(self, rng: random.Random) -> Task:
        raise NotImplementedError

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be train or eval, got {split!r}")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        out: list[Task] = []
        seen: set[str] = set()
        # Distinct prompts; a small task space may hold fewer than n (all of them returned).
        for _ in range(200 * n):
            t = self.make(rng)
            if t.prompt not in seen and self.held_out(t.prompt) == (split == "eval"):
                seen.add(t.prompt)
                out.append(t)
                if len(out) == n:
                    break
        if not out:
            raise RuntimeError(f"{self.name}: no {split} prompts")
        return out

    def reward(self, task: Task, completion: str) -> float:
        return positional_match(task.answer, completion)


class Arithmetic(_Generated):
    """a+b= with operands below `max_operand`."""

    name = "arithmetic"

    def __init__(self, max_operand: int = 20) -> None:
        self.max_operand = max_operand

    def make(self, rng: random.Random) -> Task:
        a, b = rng.randrange(self.max_operand), rng.randrange(self.max_operand)
        return Task(f"{a}+{b}=", str(a + b))


class LetterSort(_Generated):
    """Sort 3-5 distinct letters of a..h: "sort: d a c" -> "a c d" (the format and held-out
    rule of the SFT task on branch `sft`, posttrain/tasks.py, so an SFT checkpoint trained
    there starts RL on the same prompts and never sees these held-out ones)."""

    name = "letter_sort"

    def make(self, rng: random.Random) -> Task:
        letters = rng.sample("abcdefgh", rng.randint(3, 5))
        return Task("sort: " + " ".join(letters), " ".join(sorted(letters)))

    @staticmethod
    def held_out(prompt: str) -> bool:
        return zlib.crc32(prompt.encode()) % 1000 < 100


class ChainSum:
    """Running sums over several turns: the built-in multi-turn task. `reference_turns` gives
    a task's right answers, turn by turn (the supervised warmup trains on them)."""

    name = "chain_sum"

    def __init__(self, turns: int = 3, hi: int = 9) -> None:
        self.turns, self.hi = turns, hi

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        rng = random.Random(f"{self.name}:{split}:{seed}")
        out: list[Task] = []
        for _ in range(200 * n):
            xs = [rng.randint(1, self.hi) for _ in range(self.turns + 1)]
            prompt = f"{xs[0]}+{xs[1]}="
            if is_held_out(prompt + str(xs)) == (split == "eval"):
                sums = [sum(xs[: i + 2]) for i in range(self.turns)]
                out.append(Task(prompt, str(sums[-1]), {"xs": xs, "sums": sums}))
                if len(out) == n:
                    break
        return out

    def reply(self, task: Task, turns: list[str]) -> Reply:
        sums, xs = task.info["sums"], task.info["xs"]
        right = sum(t.strip() == str(s) for t, s in zip(turns, sums, strict=False))
        reward = right / self.turns
        k = len(turns)
        if k >= self.turns:
            return Reply(None, reward)
        return Reply(f"+{xs[k + 1]}=", reward)

    def reference_turns(self, task: Task) -> list[str]:
        return [str(s) for s in task.info["sums"]]


BUILTIN_ENVS: dict[str, Callable[[], Any]] = {
    "arithmetic": Arithmetic,
    "letter_sort": LetterSort,
    "chain_sum": ChainSum,  # multi-turn
}


def load_callable(spec: str) -> Callable[..., Any]:
    """'package.module:function' -> the function (ValueError with the reason otherwise: a
    module that does not import, for any reason, is one line, not its traceback)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"cannot import {mod_name!r}: {e}") from None
    except SyntaxError as e:  # where in the file: the line the user must fix
        raise ValueError(
            f"cannot import {mod_name!r}: SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
        ) from None
    except (Exception, SystemExit) as e:  # the module's own code failed while importing
        raise ValueError(f"cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise ValueError(f"{mod_name!r} has no callable {attr!r}")
    return fn


def make_env(env: str, reward: str = "", *, timeout_s: float = DEFAULT_TIMEOUT_S) -> GuardedEnv:
    """A built-in name or 'module:factory', optionally with a 'module:function' reward; its
    tasks() and reward() run behind rl.hooks' guard (HookError: one line naming the key)."""
    if env in BUILTIN_ENVS:
        factory: Callable[[], Any] = BUILTIN_ENVS[env]
    elif ":" in env:
        try:
            factory = load_callable(env)
        except ValueError as e:
            raise HookError(str(e), key="rl.env") from None
    else:
        raise HookError(
            f"unknown environment {env!r}: expected arithmetic, letter_sort, chain_sum or "
            "'module:factory'",
            key="rl.env",
        )
    fn = None
    if reward:
        try:
            fn = load_callable(reward)
        except ValueError as e:
            raise HookError(str(e), key="rl.reward") from None
    return make_guarded(factory, env, reward=fn, reward_spec=reward, timeout_s=timeout_s)
