"""User hooks behind one guard: environments (factory, tasks), rewards and custom losses.

A hook is user code named in the recipe (`rl.env = "module:factory"`, `rl.reward`,
`rl.custom_loss`). Whatever it does wrong ends in one `HookError` line naming the recipe
key, the hook and the task it was given, never a traceback, a silent exit or a NaN that
reaches the weights:

- an exception, `sys.exit` (SystemExit) or a syntax/import error in its module;
- a wrong return: a factory returning None, a string or an object without tasks/reward;
  tasks() returning no tasks or things that are not Tasks; a reward that is not a number
  (None, '1.0', a list), or not finite in float32 (NaN, inf, 1e308), or beyond MAX_REWARD;
  a custom loss that is not a scalar floating tensor;
- a hang: tasks() and reward() run in a worker thread and are abandoned after
  `rl.hook_timeout_s` (default DEFAULT_TIMEOUT_S; 0 = no limit, called inline).

`rl.envs.make_env` returns every environment wrapped (`GuardedEnv`), so the RL loop calls
the guarded methods without knowing; a HookError is an Exception, so the loop's
`rl.on_error` applies to reward failures as before (skip the group and count it, or stop),
and `check_env` runs the factory, tasks() and one reward before any process group.

Costs and limits: one thread hand-off per call (tens of microseconds; a reward is called
once per sample). A hook that hangs keeps its (daemon) thread: Python cannot stop a
thread, so it is abandoned, not killed, and a hook that calls os._exit or crashes the
interpreter cannot be guarded. Hooks run off the main thread (signal handlers cannot be
installed there). Custom losses run inline (autograd's grad mode is per thread): no timeout.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from core.errors import ConfigError, one_line, shown

DEFAULT_TIMEOUT_S = 60.0
# Rewards become float32 advantages; a group's mean and the loss's sum of advantage x ratio
# over its tokens must stay finite in float32 (3.4e38): 1e30 leaves 8 orders of magnitude.
MAX_REWARD = 1e30
FLOAT32_MAX = 3.4028234663852886e38
EXPECTED_ENV = (
    "an object with tasks(split, n, seed) -> list[Task] and reward(task, completion) (or, "
    "multi-turn, reply(task, turns) -> Reply)"
)


class HookError(ConfigError):
    """A user hook failed; the message names the key, the hook and the task."""


def _what(value: Any) -> str:
    """A returned value as a message may show it: a string quoted, anything else as its
    type and a bounded repr."""
    if isinstance(value, str):
        return shown(value)
    try:
        r = one_line(repr(value))
    except Exception:  # a repr that raises: the type is enough
        return type(value).__name__
    return f"{type(value).__name__} {r if len(r) <= 60 else r[:56] + '...'}"


def _failure(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        code = e.code if e.code is None or isinstance(e.code, int) else shown(str(e.code), 40)
        return f"called sys.exit({code if code is not None else ''})"
    text = str(e).strip().splitlines()
    return f"raised {type(e).__name__}" + (f": {shown(text[0], 160)[1:-1]}" if text else "")


class _Worker:
    """One daemon thread that runs calls in turn; abandoned (a new one started) when a call
    overruns its deadline, since a running Python thread cannot be stopped."""

    def __init__(self) -> None:
        self._q: queue.Queue[tuple[Callable[[], Any], list[Any], threading.Event]] = queue.Queue()
        threading.Thread(target=self._loop, name="rl-hook", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, box, done = self._q.get()
            try:
                box.append((True, fn()))
            except BaseException as e:  # SystemExit included: reported, never exits
                box.append((False, e))
            done.set()

    def call(self, fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any] | None:
        """(ok, value or exception), or None when `timeout_s` passed first."""
        box: list[Any] = []
        done = threading.Event()
        self._q.put((fn, box, done))
        return box[0] if done.wait(timeout_s) else None


class Guard:
    """Calls into user code with the guard's rules (module docstring)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._worker: _Worker | None = None
        self._lock = threading.Lock()  # the async generator thread and the trainer share it

    def call(self, fn: Callable[[], Any], *, key: str, what: str) -> Any:
        if not self.timeout_s:
            try:
                return fn()
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                raise HookError(f"{what} {_failure(e)}", key=key) from None
        with self._lock:
            if self._worker is None:
                self._worker = _Worker()
            result = self._worker.call(fn, self.timeout_s)
            if result is None:
                self._worker = None  # the hung call keeps that thread; the next gets a new one
                raise HookError(
                    f"{what} did not return within {self.timeout_s:g} s (rl.hook_timeout_s)",
                    key=key,
                )
        ok, value = result
        if not ok:
            if isinstance(value, KeyboardInterrupt):
                raise value
            raise HookError(f"{what} {_failure(value)}", key=key) from None
        return value


def check_reward(value: Any, *, key: str, what: str) -> float:
    """A reward as a float: a real number, finite in float32, at most MAX_REWARD in size."""
    if not isinstance(value, numbers.Real):
        raise HookError(f"{what} returned {_what(value)}; expected a number", key=key)
    try:
        r = float(value)
    except OverflowError:  # an int past float64 (found by the fuzzer)
        r = math.inf if isinstance(value, int) and value > 0 else -math.inf
    if not math.isfinite(r) or abs(r) > FLOAT32_MAX:
        why = "not finite" if not math.isfinite(r) else "infinite in float32"
        raise HookError(f"{what} returned {r!r} ({why}); expected a finite number", key=key)
    if abs(r) > MAX_REWARD:
        raise HookError(
            f"{what} returned {r!r}; rewards are at most {MAX_REWARD:g} in size (float32 "
            "advantages and loss sums must stay finite)",
            key=key,
        )
    return r


def check_tasks(value: Any, *, key: str, what: str) -> list[Any]:
    """tasks() must return a non-empty list of Tasks (objects with str prompt and answer)."""
    if not isinstance(value, (list, tuple)):
        raise HookError(f"{what} returned {_what(value)}; expected a list of rl.envs.Task", key=key)
    if not value:
        raise HookError(f"{what} returned no tasks; expected at least one rl.envs.Task", key=key)
    for i, t in enumerate(value):
        prompt, answer = getattr(t, "prompt", None), getattr(t, "answer", None)
        if not isinstance(prompt, str) or not isinstance(answer, str):
            raise HookError(
                f"{what} returned {_what(t)} as task {i}; expected rl.envs.Task(prompt: str, "
                "answer: str)",
                key=key,
            )
        if not prompt:
            raise HookError(f"{what} returned task {i} with an empty prompt", key=key)
    return list(value)


def _task_name(task: Any) -> str:
    return f"task {shown(str(getattr(task, 'prompt', task)), 60)}"


class GuardedEnv:
    """An environment whose tasks() and reward() (multi-turn: reply()) run behind a Guard
    (module docstring). `multi_turn`: the environment answers turns (rl.envs.MultiTurnEnv)."""

    def __init__(
        self,
        env: Any,
        *,
        spec: str,
        reward: Callable[[Any, str], Any] | None = None,
        reward_spec: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.env, self.spec = env, spec
        self._reward = reward
        self.reward_spec = reward_spec
        self.guard = Guard(timeout_s)
        name = getattr(env, "name", None)
        base = name if isinstance(name, str) and name else spec
        self.name = f"{base}+{getattr(reward, '__name__', 'reward')}" if reward else base
        self.multi_turn = callable(getattr(env, "reply", None))
        if self.multi_turn and reward is not None:
            raise HookError(
                f"environment {shown(spec)} is multi-turn (its reply() gives the episode's "
                "reward); rl.reward applies to single-turn environments only",
                key="rl.reward",
            )
        if reward is None and not self.multi_turn and not callable(getattr(env, "reward", None)):
            raise HookError(
                f"environment {shown(spec)} has no reward(task, completion) method and "
                "rl.reward is not set",
                key="rl.env",
            )

    def tasks(self, split: str, n: int, seed: int) -> list[Any]:
        what = f"environment {shown(self.spec)}: tasks({split!r}, {n}, seed={seed})"
        out = self.guard.call(lambda: self.env.tasks(split, n, seed), key="rl.env", what=what)
        return check_tasks(out, key="rl.env", what=what)

    def reward(self, task: Any, completion: str) -> float:
        fn = self._reward or self.env.reward
        key, spec = ("rl.reward", self.reward_spec) if self._reward else ("rl.env", self.spec)
        what = (
            f"reward {shown(spec)} on {_task_name(task)} (completion {shown(str(completion), 40)})"
        )
        value = self.guard.call(lambda: fn(task, completion), key=key, what=what)
        return check_reward(value, key=key, what=what)

    def reply(self, task: Any, turns: list[str]) -> Any:
        """Multi-turn: the environment's Reply to the model's `turns`, its message None or a
        non-empty string and its reward a finite number (check_reward)."""
        from rl.envs import Reply

        last = shown(turns[-1], 40) if turns else "none"
        what = (
            f"environment {shown(self.spec)}: reply on {_task_name(task)} after turn "
            f"{len(turns)} ({last})"
        )
        out = self.guard.call(lambda: self.env.reply(task, list(turns)), key="rl.env", what=what)
        msg = getattr(out, "message", 0)
        if not (msg is None or (isinstance(msg, str) and msg)):
            raise HookError(
                f"{what} returned {_what(out)}; expected rl.envs.Reply(message: str or None, "
                "reward: float)",
                key="rl.env",
            )
        reward = check_reward(getattr(out, "reward", None), key="rl.env", what=what)
        return Reply(msg, reward)

    def reference_turns(self, task: Any) -> list[str] | None:
        """Multi-turn: the task's right answers turn by turn, when the environment gives them
        (`reference_turns(task)`: the supervised warmup's targets), else None."""
        fn = getattr(self.env, "reference_turns", None)
        if not callable(fn):
            return None
        what = f"environment {shown(self.spec)}: reference_turns on {_task_name(task)}"
        out = self.guard.call(lambda: fn(task), key="rl.env", what=what)
        if (
            not isinstance(out, (list, tuple))
            or not out
            or not all(isinstance(t, str) for t in out)
        ):
            raise HookError(f"{what} returned {_what(out)}; expected a list of str", key="rl.env")
        return list(out)


def make_guarded(
    factory: Callable[[], Any],
    spec: str,
    *,
    reward: Callable[[Any, str], Any] | None,
    reward_spec: str,
    timeout_s: float,
) -> GuardedEnv:
    """Call an environment factory behind the guard and wrap what it returns."""
    what = f"environment factory {shown(spec)}"
    env = Guard(timeout_s).call(factory, key="rl.env", what=what)
    if (
        env is None
        or isinstance(env, (str, bytes, numbers.Number, list, tuple, dict))
        or not (callable(getattr(env, "tasks", None)))
    ):
        raise HookError(f"{what} returned {_what(env)}; expected {EXPECTED_ENV}", key="rl.env")
    return GuardedEnv(env, spec=spec, reward=reward, reward_spec=reward_spec, timeout_s=timeout_s)


def check_env(rl: Any, *, file: str | None) -> None:
    """Before any process group: the environment is made, gives tasks for the first update
    (and for evaluation), and its reward scores the first task's reference answer with a
    finite number (multi-turn: its reply to the reference turns, or to the answer, is a
    Reply). One ConfigError line naming rl.env / rl.reward otherwise."""
    from rl.envs import make_env

    try:
        env = make_env(rl.env, rl.reward, timeout_s=rl.hook_timeout_s)
        seed = (rl.seed * 1_000_003 + 1) * 64  # the first update's, rank 0 (rl.loop.RLRun)
        tasks = env.tasks("train", rl.prompts_per_step, seed)
        if rl.eval_prompts:
            env.tasks("eval", rl.eval_prompts, (rl.seed * 1_000_003 - 1) * 64)
        if not env.multi_turn:
            env.reward(tasks[0], tasks[0].answer)
        elif rl.sft_warmup_steps and env.reference_turns(tasks[0]) is None:
            raise HookError(
                f"rl.sft_warmup_steps = {rl.sft_warmup_steps} with multi-turn environment "
                f"{shown(rl.env)}, which has no reference_turns(task); expected 0",
                key="rl.sft_warmup_steps",
            )
        else:
            env.reply(tasks[0], env.reference_turns(tasks[0]) or [tasks[0].answer])
    except ConfigError as e:
        raise type(e)(e.detail, file=file, key=e.key) from None


def load_loss(spec: str) -> Callable[..., Any]:
    """rl.custom_loss = 'module:function', called behind the guard: an exception or
    sys.exit is a HookError, and so is a result that is not a scalar floating tensor."""
    import torch

    from rl.envs import load_callable

    fn = load_callable(spec)
    guard = Guard(timeout_s=0)  # inline: autograd's grad mode is per thread
    what = f"custom loss {shown(spec)}"

    def loss(logprobs: Any, batch: Any) -> Any:
        out = guard.call(lambda: fn(logprobs, batch), key="rl.custom_loss", what=what)
        ok = isinstance(out, torch.Tensor) and out.dim() == 0 and out.is_floating_point()
        if not ok:
            shape = f" of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else ""
            raise HookError(
                f"{what} returned {_what(out) if not shape else 'a tensor' + shape}; expected "
                "a scalar floating tensor (the loss to minimise)",
                key="rl.custom_loss",
            )
        if logprobs.requires_grad and not out.requires_grad:
            raise HookError(
                f"{what} returned a tensor without a gradient (detached from logprobs)",
                key="rl.custom_loss",
            )
        return out

    loss.__name__ = getattr(fn, "__name__", "custom_loss")
    return loss


def find_hook_error(exc: BaseException | None) -> HookError | None:
    """The HookError an exception was raised from (its __cause__ / __context__ chain)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, HookError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def hook_errors_as_config_errors(file: str | None = None) -> Iterator[None]:
    """Around an RL run: a failure whose cause is a hook (rl.on_error = "fail", a tasks()
    or evaluation reward that failed) leaves as that hook's one line (exit 2 through
    exit_on_config_error), not as the loop's traceback."""
    try:
        yield
    except BaseException as e:
        hook = find_hook_error(e)
        if hook is None:
            raise
        raise HookError(one_line(hook.detail), file=file or hook.file, key=hook.key) from None
