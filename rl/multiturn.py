"""Multi-turn episodes: the model's turn, the environment's reply appended, repeat.

A multi-turn environment (rl.envs.MultiTurnEnv: `tasks`, `reply(task, turns) -> Reply`; built
in: rl.envs.ChainSum) answers each of the model's turns. `run_episodes` drives any generator
with the `Generator` interface (our KV-cache one or rl.vllm_engine.VllmGenerator): every turn
sends each live episode's whole conversation as token ids (first prompt, then each completion
followed by the reply's tokens), so with vLLM the engine's prefix cache holds the
conversation's keys and values and a turn prefills only what was appended
(`VllmGenerator.cached_prompt_tokens` counts the reused positions). An episode's trained
tokens are the model's own turns (`Episode.model_mask`): the environment's tokens are context
only. `reference_episode` builds the conversation of a task's right answers (the supervised
warmup's rows) the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl.envs import MultiTurnEnv, Task


@dataclass
class Episode:
    task: Task
    tokens: list[int]  # the whole conversation
    model_mask: list[bool]  # True at the model's own tokens
    logprobs: list[float]  # the model's tokens' sampling logprobs, in order
    turns: list[str] = field(default_factory=list)
    reward: float = 0.0
    versions: list[int] = field(default_factory=list)  # weight version of each turn
    # MoE: the last turn's expert ids (its prompt was the conversation before it, so they
    # cover every input position up to that turn's last token; rl.generator Sample.routing)
    routing: Any = None

    @property
    def prompt_len(self) -> int:
        """Tokens before the model's first turn (the task's first prompt)."""
        return self.model_mask.index(True) if True in self.model_mask else len(self.tokens)


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
    max_len: int | None = None,
) -> list[Episode]:
    """One episode per task (params.n must be 1): each turn samples every live episode's next
    completion in one `generate` call, then asks the environment for its reply. `max_len`:
    an episode whose conversation could not take another turn of params.max_tokens within it
    ends there (its reward is the last reply's), so no row outgrows the model's context."""
    if params.n != 1:
        raise ValueError("multi-turn episodes sample one completion per turn (n = 1)")
    eps = []
    for t in tasks:
        first = encode(t.prompt)
        eps.append(Episode(t, list(first), [False] * len(first), []))
    live = list(range(len(eps)))
    for _ in range(max_turns):
        if max_len is not None:
            live = [i for i in live if len(eps[i].tokens) + params.max_tokens <= max_len]
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
            ep.routing = s.routing
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


def reference_episode(
    env: Any,
    task: Task,
    turns: list[str],
    *,
    encode: Callable[[str], list[int]],
    encode_turn: Callable[[str], list[int]],
    encode_reply: Callable[[str], list[int]],
) -> Episode:
    """The conversation in which the model answers `turns` (text; `encode_turn` adds the
    turn's stop token): the same layout as run_episodes', logprobs 0."""
    tokens = encode(task.prompt)
    ep = Episode(task, list(tokens), [False] * len(tokens), [])
    for k, text in enumerate(turns):
        ids = encode_turn(text)
        ep.tokens += ids
        ep.model_mask += [True] * len(ids)
        ep.logprobs += [0.0] * len(ids)
        ep.turns.append(text)
        r = env.reply(task, ep.turns)
        ep.reward = r.reward
        if r.message is None or k == len(turns) - 1:
            break
        msg = encode_reply(r.message)
        ep.tokens += msg
        ep.model_mask += [False] * len(msg)
    return ep
