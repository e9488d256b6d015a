"""The sampling side of the service: a `SampleRequest` as the backend's `SamplingParams`, and
the per-sequence records `stable_reinforce` trains on.

Tinker's sampling semantics (tinker.types.SamplingParams, and the cookbook's renderers,
which are their client): `stop=None` stops at end of text (the tokenizer's EOS), `stop=[]`
never stops early, a list of token ids or strings stops at any of them and at EOS; a
stopped sequence ends with the token that completed the stop (the cookbook's role-colon
renderer finds "\\n\\nUser:" in the returned text, its Qwen3 / Llama 3 renderers strip
their end-of-turn token). `max_tokens=None` samples up to the served context.

Stability records: a sampler created with `record_stability_info=True` keeps, for each
sequence it returns, the prompt, the sampled tokens and the sampler's logprobs, under the
`sequence_id` the SDK hands back (`sample_sequence_ids`). A `stable_reinforce` datum names
them through its provenance spans; the service takes the behaviour logprobs from the record
(the tokens must match), not from the client. Records are per session, live for a day after
their last use (as Tinker's), at most `MAX_RECORDS` per session (the oldest go first), and
go with the session.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from service import wire
from service.errors import bad_request
from service.proto import Span
from service.types import SamplingParams

RECORD_TTL_S = 24 * 3600.0
MAX_RECORDS = 100_000  # per session: ~100k sequences x (prompt + completion) x 8 bytes


@dataclass(frozen=True)
class SampleRequest:
    prompt: np.ndarray  # int64 [P]
    params: SamplingParams
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    prompt_logprobs_last_n: int | None
    record: bool


def sample_request(
    body: wire.SampleBody, *, vocab: int, max_context: int, max_samples: int, max_topk: int = 20
) -> SampleRequest:
    """Validate a SampleRequest body against the served model; every error names its field."""
    prompt = wire.prompt_tokens(body.prompt, vocab=vocab)
    if prompt.size == 0:
        raise bad_request("prompt", "no tokens")
    if body.num_samples > max_samples:
        raise bad_request("num_samples", f"{body.num_samples} exceeds {max_samples}")
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(body, name):
            raise bad_request(name, "not served by this service")
    if body.target_prompt_logprobs is not None:
        raise bad_request("target_prompt_logprobs", "not served by this service")
    k = body.topk_prompt_logprobs
    if not 0 <= k <= max_topk:
        raise bad_request("topk_prompt_logprobs", f"expected 0..{max_topk}, got {k}")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None:
        if not (body.prompt_logprobs or k):
            raise bad_request("prompt_logprobs_last_n", "needs prompt_logprobs or topk")
        if last_n > prompt.size - 1:
            raise bad_request(
                "prompt_logprobs_last_n", f"{last_n} exceeds the prompt's {prompt.size - 1}"
            )
    sp = body.sampling_params
    if sp.top_k == 0 or sp.top_k < -1:
        raise bad_request("sampling_params.top_k", f"expected -1 (off) or >= 1, got {sp.top_k}")
    room = max_context - int(prompt.size)
    if room < 1:
        raise bad_request("prompt", f"{prompt.size} tokens leave no room in {max_context}")
    max_tokens = sp.max_tokens if sp.max_tokens is not None else room
    if max_tokens > room:
        raise bad_request(
            "sampling_params.max_tokens",
            f"prompt {prompt.size} + max_tokens {max_tokens} exceed {max_context}",
        )
    stop_tokens: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    stop = sp.stop
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        strs = [x for x in stop if isinstance(x, str)]
        ids = [x for x in stop if not isinstance(x, str)]
        if strs and ids:
            raise bad_request("sampling_params.stop", "either token ids or strings, not both")
        if any(not x for x in strs):
            raise bad_request("sampling_params.stop", "empty stop string")
        if ids:
            arr = np.asarray(ids, dtype=np.int64)
            wire.check_tokens(arr, vocab=vocab, field="sampling_params.stop")
        stop_tokens, stop_strings = tuple(int(t) for t in ids), tuple(strs)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        seed=sp.seed,
        stop_tokens=stop_tokens,
        stop_strings=stop_strings,
        stop_eos=stop is None or len(stop) > 0,
    )
    return SampleRequest(
        prompt=prompt,
        params=params,
        prompt_logprobs=bool(body.prompt_logprobs),
        topk_prompt_logprobs=k,
        prompt_logprobs_last_n=last_n,
        record=bool(body.record_stability_info),
    )


@dataclass
class _Record:
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    expires: float


class StabilityRecords:
    """sequence_id -> what was sampled, per session (see the module docstring)."""

    def __init__(self, ttl_s: float = RECORD_TTL_S, max_per_session: int = MAX_RECORDS):
        self.ttl_s, self.max = ttl_s, max_per_session
        self._by_session: dict[str, OrderedDict[str, _Record]] = {}
        self._lock = threading.Lock()

    def add(
        self,
        session_id: str,
        sequence_id: str,
        prompt: np.ndarray,
        tokens: np.ndarray,
        logprobs: np.ndarray,
    ) -> None:
        rec = _Record(prompt, np.asarray(tokens, np.int64), np.asarray(logprobs, np.float32), 0.0)
        rec.expires = time.monotonic() + self.ttl_s
        with self._lock:
            recs = self._by_session.setdefault(session_id, OrderedDict())
            recs[sequence_id] = rec
            while len(recs) > self.max:
                recs.popitem(last=False)

    def get(self, session_id: str, sequence_id: str, field: str) -> _Record:
        now = time.monotonic()
        with self._lock:
            recs = self._by_session.get(session_id, OrderedDict())
            rec = recs.get(sequence_id)
            if rec is None or rec.expires < now:
                recs.pop(sequence_id, None)
                raise bad_request(
                    field,
                    f"no stability record of sequence {sequence_id!r} in this session (sample "
                    "with record_stability_info=True, in the session that trains)",
                )
            rec.expires = now + self.ttl_s  # each use restarts its day
            recs.move_to_end(sequence_id)
            return rec

    def drop_session(self, session_id: str) -> None:
        with self._lock:
            self._by_session.pop(session_id, None)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(r) for r in self._by_session.values())


def recorded_logprobs(
    records: StabilityRecords,
    session_id: str,
    spans: list[Span] | None,
    targets: np.ndarray,
    *,
    where: str,
) -> tuple[np.ndarray, np.ndarray]:
    """(behaviour logprobs [T], sampled mask [T]) of one datum from its loss_fn_input spans:
    positions in a sampled run take the record's logprobs (their target tokens must be the
    record's tokens); prompt runs are checked against the recorded prompt and get mask 0."""
    field = f"{where}.loss_fn_input_spans"
    if not spans:
        raise bad_request(field, "stable_reinforce needs provenance (Datum.with_provenance)")
    if sum(s.length for s in spans) != targets.size:
        raise bad_request(field, f"spans cover {sum(s.length for s in spans)} of {targets.size}")
    q = np.zeros(targets.size, np.float32)
    sampled = np.zeros(targets.size, np.float32)
    pos = 0
    for j, s in enumerate(spans):
        rec = records.get(session_id, s.sequence_id, f"{field}[{j}]")
        src = rec.tokens if s.kind == "sampled" else rec.prompt
        if s.offset + s.length > src.size:
            raise bad_request(f"{field}[{j}]", f"runs past the {s.kind} tokens ({src.size})")
        want = src[s.offset : s.offset + s.length]
        if not np.array_equal(targets[pos : pos + s.length], want):
            raise bad_request(f"{field}[{j}]", f"target tokens differ from the {s.kind} tokens")
        if s.kind == "sampled":
            q[pos : pos + s.length] = rec.logprobs[s.offset : s.offset + s.length]
            sampled[pos : pos + s.length] = 1.0
        pos += s.length
    if not sampled.any():
        raise bad_request(field, "no sampled tokens to train on")
    return q, sampled
