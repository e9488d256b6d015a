"""Plain data passed between the HTTP layer, the scheduler and a backend (numpy, no torch).

These are the service's own shapes, decoded from the SDK's wire format by `service.wire`;
a backend never sees JSON or protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

# The losses a backend implements, named as the SDK names them (tinker.types.LossFnType).
LOSSES = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
    "custom",
)
# loss_fn_inputs each loss reads, besides target_tokens (all per-token, float32).
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
    # the sampler's logprobs come from the server's record (provenance spans); a client's
    # `logprobs` is accepted and not used
    "stable_reinforce": ("advantages", "logprobs"),
    "custom": (),
}
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "gspo": ("sequence_ratio_mask",),  # default: the tokens with a nonzero advantage
    "stable_reinforce": ("logprobs",),
}


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's shape (tinker.types.LoraConfig)."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "seed": self.seed,
            "train_mlp": self.train_mlp,
            "train_attn": self.train_attn,
            "train_unembed": self.train_unembed,
        }


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's hyper-parameters (tinker.types.AdamParams: AdamW, decoupled decay)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class Datum:
    """One training sequence: input tokens [T] and per-token loss inputs ([T] each)."""

    tokens: np.ndarray  # int64 [T]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FwdBwdResult:
    """Per-datum outputs (`logprobs` [T] float32, ...) and metrics named `name:reduction`."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: tuple[int, ...] | None = None  # None: stop at the tokenizer's EOS if any
    # (Tinker's `stop`: None = EOS; [] = nothing, not even EOS; a list = it and EOS)
    stop_strings: tuple[str, ...] = ()  # matched on the decoded completion (server tokenizer)
    stop_eos: bool = True  # False only for stop=[]


@dataclass
class SampledSeq:
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    stop_reason: Literal["stop", "length"]


@dataclass
class SampleResult:
    sequences: list[SampledSeq]
    prompt_logprobs: np.ndarray | None = None  # float32 [P], NaN at position 0
    # top-k prompt logprobs: (token ids int32 [P, k], logprobs float32 [P, k]); row 0 (and
    # rows not scored) hold token 0 / -99999.0, the SDK's empty cell
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None
