"""Request bodies of the SDK's JSON endpoints, validated into `service.types`.

Every model ignores fields it does not know (newer SDKs add some) and rejects a wrong type
or value with `ServiceError(400)` naming the dotted field, e.g.
`optim_params.learning_rate: Input should be a valid number`. Types are strict: an integer
field refuses 1.0 and "1", a boolean refuses 0/1, a number refuses NaN and infinity, and every
integer is bounded (ids below 2**62, tokens below 2**31, seeds within int64), so nothing a
client sends can overflow a conversion further down (decoding never ends in a 500).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.jsonio import loads_line
from service.errors import ServiceError, bad_request
from service.types import LOSS_INPUTS, LOSSES, OPTIONAL_INPUTS, AdamParams, Datum, LoraSpec


class _Body(BaseModel):
    model_config = ConfigDict(
        extra="ignore", protected_namespaces=(), strict=True, allow_inf_nan=False
    )


Id = Annotated[int, Field(ge=0, lt=2**62)]  # seq ids, model / sampler counters
Token = Annotated[int, Field(ge=0, lt=2**31)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]  # what torch.Generator.manual_seed takes
# Log-probabilities below this cannot come from a float32 sampler (e^-88 is below the
# smallest normal float32), and an importance weight exp(logp - logprobs) with logp <= 0
# stays finite in float32 only while logprobs >= -88.7: refused rather than trained as inf/NaN.
MIN_LOGPROB = -88.0
# The smallest positive AdamW eps that float32 arithmetic keeps (a smaller one rounds to 0 in
# sqrt(v) + eps, and 0/0 makes the adapter NaN).
MIN_EPS = float(np.finfo(np.float32).tiny)


class LoraConfigBody(_Body):
    rank: int = Field(ge=1, le=1024)
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(_Body):
    type: str = "adamw"


class CreateSessionBody(_Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionIdBody(_Body):
    session_id: str


class CreateModelBody(_Body):
    session_id: str
    model_seq_id: Id
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody = OptimizerConfigBody()


class GetInfoBody(_Body):
    model_id: str


class AdamParamsBody(_Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepBody(_Body):
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None
    model_id: str
    seq_id: Id


class SaveWeightsBody(_Body):
    model_id: str
    path: str | None = None
    seq_id: Id
    ttl_seconds: int | None = Field(default=None, ge=1, lt=2**40)
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveForSamplerBody(_Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: Id | None = None
    kind: str = "snapshot"
    seq_id: Id
    ttl_seconds: int | None = Field(default=None, ge=1, lt=2**40)
    user_metadata: dict[str, str] | None = None


class LoadWeightsBody(_Body):
    model_id: str | None = None
    seq_id: Id | None = None
    session_id: str | None = None
    model_seq_id: Id | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfigBody | None = None


class CreateSamplingSessionBody(_Body):
    session_id: str
    sampling_session_seq_id: Id
    base_model: str | None = None
    model_path: str | None = None


class JoinSamplingSessionBody(_Body):
    sampling_session_id: str


class ChunkBody(_Body):
    type: str = "encoded_text"
    tokens: list[Token] = []


class ModelInputBody(_Body):
    chunks: list[ChunkBody]


class SamplingParamsBody(_Body):
    max_tokens: int | None = Field(default=None, ge=1, lt=2**31)
    seed: Seed | None = None
    # Stop token ids are checked against the vocabulary by sampling.sample_request (one clear
    # "token id -1 outside the vocabulary" instead of the union's three type errors).
    stop: str | list[str] | list[Seed] | None = None
    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=-1, ge=-1, lt=2**31)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)


class SampleBody(_Body):
    num_samples: int = Field(default=1, ge=1, lt=2**31)
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: Id | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, lt=2**31)
    topk_sample_logprobs: int = Field(default=0, ge=0, lt=2**31)
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = Field(default=0, ge=0, lt=2**31)
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1, lt=2**31)
    record_stability_info: bool | None = None


class RetrieveFutureBody(_Body):
    request_id: str
    allow_metadata_only: bool = False


class FinishBody(_Body):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class WeightsInfoBody(_Body):
    tinker_path: str


class TtlBody(_Body):
    ttl_seconds: int | None = Field(default=None, ge=1, lt=2**40)


B = TypeVar("B", bound=BaseModel)


def parse(model: type[B], body: bytes) -> B:
    """`body` (JSON) as `model`, or ServiceError(400) naming the first bad field."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        raise bad_request(loc, err["msg"]) from None


def sequence_key(raw: bytes) -> tuple[str, int] | None:
    """(model_id, seq_id) of a JSON training request whose body failed validation, when both
    are readable: the refused request still takes its place in the model's order."""
    try:
        obj = loads_line(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    mid, seq = obj.get("model_id"), obj.get("seq_id")
    if isinstance(mid, str) and type(seq) is int and 0 <= seq < 2**62:
        return mid, seq
    return None


def adam_params(body: OptimStepBody) -> AdamParams:
    if body.adam_params is None:
        kind = (body.optimizer_params or {}).get("type", "?")
        raise bad_request("optim_params", f"optimizer {kind!r} is not served; use AdamParams")
    p = body.adam_params
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        v = getattr(p, name)
        if not math.isfinite(v) or v < 0:
            raise bad_request(f"adam_params.{name}", f"expected a finite number >= 0, got {v}")
    for name in ("beta1", "beta2"):
        if getattr(p, name) >= 1:
            raise bad_request(f"adam_params.{name}", "expected a value in [0, 1)")
    if p.eps < MIN_EPS:
        raise bad_request(
            "adam_params.eps",
            f"expected eps >= {MIN_EPS:.3g} (0 or a smaller value makes AdamW divide 0 by 0 "
            f"and the adapter NaN), got {p.eps}",
        )
    return AdamParams(**p.model_dump())


def lora_spec(body: LoraConfigBody | None, *, max_rank: int) -> LoraSpec:
    if body is None:
        raise bad_request("lora_config", "required: this service trains LoRA adapters only")
    if body.rank > max_rank:
        raise bad_request("lora_config.rank", f"{body.rank} exceeds this service's {max_rank}")
    if not (body.train_mlp or body.train_attn or body.train_unembed):
        raise bad_request("lora_config", "at least one of train_mlp/attn/unembed must be true")
    return LoraSpec(**body.model_dump())


def prompt_tokens(body: ModelInputBody, *, vocab: int, field: str = "prompt") -> np.ndarray:
    toks: list[int] = []
    for i, c in enumerate(body.chunks):
        if c.type != "encoded_text":
            raise bad_request(f"{field}.chunks[{i}].type", f"{c.type!r} chunks are not supported")
        toks.extend(c.tokens)
    arr = np.asarray(toks, dtype=np.int64)
    check_tokens(arr, vocab=vocab, field=field)
    return arr


def check_tokens(arr: np.ndarray, *, vocab: int, field: str) -> None:
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        bad = int(arr[(arr < 0) | (arr >= vocab)][0])
        raise bad_request(field, f"token id {bad} outside the vocabulary [0, {vocab})")


def fwdbwd_data(
    data: list[tuple[np.ndarray, dict[str, np.ndarray]]],
    loss_fn: str,
    *,
    vocab: int,
    max_len: int,
    max_data: int,
) -> list[Datum]:
    """Check a decoded forward_backward batch against the loss and the model's limits."""
    if loss_fn not in LOSSES:
        raise bad_request("loss_fn", f"unknown loss {loss_fn!r}; served: {', '.join(LOSSES)}")
    if loss_fn == "custom":
        raise ServiceError(
            400,
            "server-side custom losses are not served; forward_backward_custom runs the loss "
            "in the client and sends its gradients as cross_entropy weights",
            field="loss_fn",
        )
    if not data:
        raise bad_request("data", "empty batch")
    if len(data) > max_data:
        raise bad_request("data", f"{len(data)} datums exceed the limit of {max_data}")
    out = []
    for i, (tokens, inputs) in enumerate(data):
        where = f"data[{i}]"
        n = tokens.size
        if n == 0:
            raise bad_request(f"{where}.model_input", "no tokens")
        if n > max_len:
            raise bad_request(f"{where}.model_input", f"{n} tokens exceed the model's {max_len}")
        check_tokens(tokens, vocab=vocab, field=f"{where}.model_input")
        if "target_tokens" not in inputs:
            raise bad_request(f"{where}.loss_fn_inputs.target_tokens", "required")
        clean: dict[str, np.ndarray] = {}
        for key in ("target_tokens", *LOSS_INPUTS[loss_fn]):
            f = f"{where}.loss_fn_inputs.{key}"
            if key not in inputs:
                if key in OPTIONAL_INPUTS.get(loss_fn, ()):
                    continue
                raise bad_request(f, f"required by loss {loss_fn!r}")
            arr = inputs[key]
            if arr.ndim != 1 or arr.size != n:
                raise bad_request(
                    f, f"expected shape [{n}] (one per input token), got {list(arr.shape)}"
                )
            if key == "target_tokens":
                if arr.dtype.kind not in "iu":
                    raise bad_request(f, f"expected integer token ids, got {arr.dtype} values")
                arr = arr.astype(np.int64)
                check_tokens(arr, vocab=vocab, field=f)
            else:
                arr = arr.astype(np.float32)
                if not np.all(np.isfinite(arr)):
                    raise bad_request(f, "contains NaN or infinity")
                if key == "logprobs" and arr.size and float(arr.min()) < MIN_LOGPROB:
                    raise bad_request(
                        f,
                        f"log-probability {float(arr.min()):.4g} below {MIN_LOGPROB}: no "
                        "sampler produces it, and its importance weight overflows",
                    )
            clean[key] = arr
        out.append(Datum(tokens=tokens, inputs=clean))
    return out


# The loss_fn_config keys each loss takes. Ratio thresholds are Tinker's (clip_low_threshold
# <= 1 <= clip_high_threshold); dro's beta weighs its quadratic penalty.
RATIO_LOSSES = ("ppo", "cispo", "gspo", "stable_reinforce")
LOSS_SETTINGS: dict[str, set[str]] = {
    **{k: {"clip_low_threshold", "clip_high_threshold"} for k in RATIO_LOSSES},
    "dro": {"beta"},
}


def check_loss_config(loss_fn: str, cfg: dict[str, float | str]) -> None:
    """Each key a setting of `loss_fn` (LOSS_SETTINGS), each value a positive number, and
    clip_low_threshold <= 1 <= clip_high_threshold where given."""
    allowed = LOSS_SETTINGS.get(loss_fn, set())
    for k, v in cfg.items():
        if k not in allowed:
            raise bad_request(f"loss_fn_config.{k}", f"not a setting of loss {loss_fn!r}")
        if not isinstance(v, float) or not math.isfinite(v) or v <= 0:
            raise bad_request(f"loss_fn_config.{k}", f"expected a positive number, got {v!r}")
    low = float(cfg.get("clip_low_threshold", 1.0))
    high = float(cfg.get("clip_high_threshold", 1.0))
    if not low <= 1.0 <= high:
        raise bad_request("loss_fn_config", "need clip_low_threshold <= 1 <= clip_high_threshold")
