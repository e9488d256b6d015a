"""Multi-turn episodes: the model's turn, the environment's reply appended, repeat.

A multi-turn environment has `tasks(split, n, seed) -> list[Task]` (the first prompt and the
episode's data), and `reply(task, turns) -> Reply`: given the model's completions so far
(decoded text, one per turn), the environment's next message (None ends the episode) and the
episode's reward so far. `run_episodes` drives any generator with the `Generator` interface
(our KV-cache one or rl.vllm_engine.VllmGenerator): every turn sends each live episode's
whole conversation as token ids (first prompt, then each completion followed by the reply's
tokens), so with vLLM the engine's prefix cache holds the conversation's keys and values and a
turn prefills only what was appended (`VllmGenerator.cached_prompt_tokens` counts the reused
positions). An episode's trained tokens are the model's own turns (`Episode.model_mask`).

Built in: `ChainSum`, "3+4=" -> "7", then "+5=" -> "12", ... for `turns` turns; reward: the
fraction of turns whose answer was the running sum.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rl.envs import Task, is_held_out


@dataclass(frozen=True)
class Reply:
    message: str | None  # the environment's next message; None: the episode is over
    reward: float


class MultiTurnEnv(Protocol):
    name: str

    def tasks(self, split: str, n: int, seed: int) -> list[Task]: ...

    def reply(self, task: Task, turns: list[str]) -> Reply: ...


@dataclass
class Episode:
    task: Task
    tokens: list[int]  # the whole conversation
    model_mask: list[bool]  # True at the model's own tokens
    logprobs: list[float]  # the model's tokens' sampling logprobs, in order
    turns: list[str] = field(default_factory=list)
    reward: float = 0.0
    versions: list[int] = field(default_factory=list)  # weight version of each turn


class ChainSum:
    """Running sums over several turns: a built-in multi-turn task for tests."""

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


def run_episodes(
    generator: Any,
    env: MultiTurnEnv,
    tasks: list[Task],
    *,
    encode: Callable[[str], list[int]],
    encode_reply: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    params: Any,
    max_turns: int = 8,
) -> list[Episode]:
    """One episode per task (params.n must be 1): each turn samples every live episode's next
    completion in one `generate` call, then asks the environment for its reply."""
    if params.n != 1:
        raise ValueError("multi-turn episodes sample one completion per turn (n = 1)")
    eps = []
    for t in tasks:
        first = encode(t.prompt)
        eps.append(Episode(t, list(first), [False] * len(first), []))
    live = list(range(len(eps)))
    for _ in range(max_turns):
        if not live:
            break
        samples = generator.generate([eps[i].tokens for i in live], params)
        still = []
        for i, s in zip(live, samples, strict=True):
            ep = eps[i]
            ep.tokens += s.tokens
            ep.model_mask += [True] * len(s.tokens)
            ep.logprobs += s.logprobs
            ep.versions.append(s.version)
            ep.turns.append(decode(s.tokens))
            r = env.reply(ep.task, ep.turns)
            ep.reward = r.reward
            if r.message is not None:
                msg = encode_reply(r.message)
                ep.tokens += msg
                ep.model_mask += [False] * len(msg)
                still.append(i)
        live = still
    return eps
