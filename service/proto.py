"""The SDK's protobuf payloads, through its own schema (`service.tinker_proto`).

The SDK posts `/api/v1/forward_backward` as a `tinker_public.ForwardBackwardRequest` and
asks for `ForwardBackwardOutput` and `SampleResponse` results as protobuf
(`Accept: application/x-protobuf`). Parsing and serialising are protobuf's (the generated
message classes of the SDK's descriptor); this module only turns messages into numpy arrays
and checks what protobuf cannot: dtypes, shapes, CSR indices, provenance spans.
Unit tests check it against the SDK's own encoder and decoder in both directions.

Decoding never raises anything but `ServiceError` (400 naming the message and field, 413
naming the limit) and does work bounded by the body and the model: `Bounds` are checked
before anything is allocated for them (the datum count before any datum is decoded, a
datum's tokens before they are joined, a tensor's declared shape before a sparse one is
expanded: a 10 MB CSR body declaring [500000, 1024] used to allocate 2 GiB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from google.protobuf.message import DecodeError

from service import tinker_proto as pb
from service.errors import ServiceError, bad_request

STOP_REASON = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
TOPK_EMPTY_LOGPROB = -99999.0  # the SDK's sentinel for an empty top-k cell (MASK_LOGPROB)


@dataclass(frozen=True)
class Span:
    """One provenance run (tinker.types.{Prompt,Sampled}ProvenanceSpan): `length`
    consecutive datum positions are positions [offset, offset + length) of the named
    sequence's request prompt ("prompt") or of its sampled tokens ("sampled")."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Bounds:
    """What one decoded request may hold: `max_data` datums, `max_len` tokens per datum
    (the served context) and, per tensor, `max_len` elements (every loss input is one value
    per input token). None: unbounded (tests of the codec alone)."""

    max_data: int | None = None
    max_len: int | None = None


def _too_large(where: str, what: str) -> ServiceError:
    return ServiceError(413, what, field=where)


@dataclass
class FwdBwdRequest:
    """A decoded `ForwardBackwardRequest` (tokens and tensors as numpy arrays)."""

    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    data: list[tuple[np.ndarray, dict[str, np.ndarray]]] = field(default_factory=list)
    # Per datum: the runs tiling its loss_fn_inputs positions, or None (no provenance).
    spans: list[list[Span] | None] = field(default_factory=list)
    # Why the datums were refused (the header above was read: the refusal can still take
    # the request's seq_id place), or None.
    error: ServiceError | None = None


# --- decoding -------------------------------------------------------------------------------


def _frombuffer(data: bytes, dtype: Any, where: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise bad_request(where, f"{len(data)} bytes is not a whole number of {np.dtype(dtype)}")
    return np.frombuffer(data, dtype=dtype).copy()


def _values(data: bytes, dtype: int, where: str) -> np.ndarray:
    if dtype == pb.DTYPE_BFLOAT16:  # the top half of a float32: widen exactly
        raw = _frombuffer(data, np.uint16, where)
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return _frombuffer(data, _NP[dtype], where)


def decode_tensor(msg: Any, where: str, max_elements: int | None = None) -> np.ndarray:
    """A `Tensor` (dense or sparse CSR) as a dense numpy array of its declared dtype; a
    declared shape over `max_elements` is refused (413) before anything is allocated."""
    dtype = msg.dtype
    if dtype not in _NP and dtype != pb.DTYPE_BFLOAT16:
        raise bad_request(where + ".dtype", f"unsupported tensor dtype {dtype}")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise bad_request(where + ".shape", f"negative dimension in {shape}")
    if max_elements is not None:
        n = 1
        for s in shape:  # Python integers: a product of huge dimensions cannot wrap
            n *= s
        if n > max_elements:
            raise _too_large(
                where + ".shape",
                f"{shape} declares {n} elements; at most {max_elements} (one per token of "
                "the model's context) are accepted",
            )
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = _values(csr.values, dtype, where + ".sparse_csr.values")
        crow = _frombuffer(csr.crow_indices, np.int64, where + ".sparse_csr.crow_indices")
        col = _frombuffer(csr.col_indices, np.int64, where + ".sparse_csr.col_indices")
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise bad_request(where + ".sparse_csr", f"inconsistent CSR tensor of shape {shape}")
        if len(values) and (
            crow[0] != 0
            or crow[-1] != len(values)
            or np.any(np.diff(crow) < 0)
            or col.min() < 0
            or col.max() >= shape[1]
        ):
            raise bad_request(where + ".sparse_csr", "CSR indices out of range")
        out = np.zeros(shape, dtype=values.dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        out[rows, col] = values
        return out
    arr = _values(msg.dense, dtype, where + ".dense")
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise bad_request(where + ".shape", f"{shape} does not match {arr.size} elements")
        arr = arr.reshape(shape)
    return arr


def _decode_spans(msgs: Any, where: str) -> list[Span] | None:
    if not len(msgs):
        return None
    out = []
    for j, s in enumerate(msgs):
        kind = s.WhichOneof("span")
        if kind is None:
            raise bad_request(f"{where}[{j}]", "empty provenance span")
        arm = getattr(s, kind)
        if not arm.sequence_id or arm.offset < 0 or arm.length < 0:
            raise bad_request(f"{where}[{j}]", "needs a sequence_id, offset >= 0, length >= 0")
        out.append(
            Span(
                "prompt" if kind == "prompt_tokens" else "sampled",
                arm.sequence_id,
                int(arm.offset),
                int(arm.length),
            )
        )
    return out


def _decode_datum(d: Any, where: str, bounds: Bounds) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    tokens: list[np.ndarray] = []
    if bounds.max_len is not None:  # 4 bytes per int32 token: count before decoding any
        n = sum(len(c.encoded_text.tokens) // 4 for c in d.model_input)
        if n > bounds.max_len:  # 400 as before: the sequence does not fit the model
            raise bad_request(
                where + ".model_input", f"{n} tokens exceed the model's {bounds.max_len}"
            )
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise bad_request(
                where + ".model_input", f"{kind} chunks are not supported by this service"
            )
        tokens.append(
            _frombuffer(chunk.encoded_text.tokens, np.int32, where + ".model_input.tokens")
        )
    inputs = {
        key: decode_tensor(t, f"{where}.loss_fn_inputs.{key}", bounds.max_len)
        for key, t in d.loss_fn_inputs.items()
    }
    toks = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
    return toks, inputs


def decode_forward_backward_request(buf: bytes, bounds: Bounds = Bounds()) -> FwdBwdRequest:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(buf)
    except (DecodeError, ValueError, RuntimeError):
        raise bad_request("forward_backward", "malformed protobuf body") from None
    req = FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        forward_only=bool(msg.forward_only),
    )
    try:
        if bounds.max_data is not None and len(msg.data) > bounds.max_data:
            raise _too_large(
                "data", f"{len(msg.data)} datums exceed the limit of {bounds.max_data}"
            )
        for i, d in enumerate(msg.data):
            req.data.append(_decode_datum(d, f"data[{i}]", bounds))
            req.spans.append(_decode_spans(d.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans"))
    except ServiceError as e:
        req.data, req.spans, req.error = [], [], e
    req.loss_fn_config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # the SDK dual-writes; v2 wins (it has strings)
        which = v.WhichOneof("value")
        if which is not None:
            req.loss_fn_config[k] = float(v.number) if which == "number" else str(v.text)
    return req


# --- encoding -------------------------------------------------------------------------------


def _batched_tensor(msg: Any, arrays: list[np.ndarray]) -> None:
    """Per-datum arrays (same dtype and trailing shape) into one `BatchedTensor`."""
    integer = arrays[0].dtype.kind in "iu"
    np_dtype = np.int64 if integer else np.float32
    parts = [np.ascontiguousarray(a, dtype=np_dtype).tobytes() for a in arrays]
    msg.data = b"".join(parts)
    msg.offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64).tobytes()
    msg.dtype = pb.DTYPE_INT64 if integer else pb.DTYPE_FLOAT32
    msg.trailing_shape.extend(int(s) for s in arrays[0].shape[1:])


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """`ForwardBackwardOutput` with one `ArrayRecord` holding every datum's outputs."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    if outputs:
        for name in outputs[0]:
            _batched_tensor(record.fields[name], [o[name] for o in outputs])
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    return msg.SerializeToString()


def _topk(msg: Any, ids: np.ndarray, logprobs: np.ndarray) -> None:
    n, k = ids.shape
    msg.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(logprobs, dtype=np.float32).tobytes()
    msg.k, msg.length = k, n


def encode_sample_response(
    sequences: Sequence[tuple[np.ndarray, np.ndarray, str]],
    prompt_logprobs: np.ndarray | None,
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """`SampleResponse`: (tokens, logprobs, stop reason) per sequence, optional prompt
    logprobs (NaN where not scored) and top-k prompt logprobs ((P, k) token ids and
    logprobs; rows not scored hold the SDK's empty-cell sentinel)."""
    msg = pb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        msg.sequences.add(
            stop_reason=STOP_REASON[stop],
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        _topk(msg.topk_prompt_logprobs, *topk_prompt)
    return msg.SerializeToString()
