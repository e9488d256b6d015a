"""The few protobuf messages of the SDK's wire format, encoded and decoded by hand.

The SDK posts `/api/v1/forward_backward` as a `tinker_public.ForwardBackwardRequest` and
asks for `ForwardBackwardOutput` and `SampleResponse` results as protobuf
(`Accept: application/x-protobuf`). The schema (field numbers, types) is the SDK's
`tinker/proto/tinker_public_pb2.py`; this module depends on neither the SDK nor the
protobuf runtime, so the server runs without the client installed. Unit tests check it
against the SDK's own encoder and decoder in both directions.

Decoding never raises anything but `ServiceError(400)` naming the message and field.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from service.errors import bad_request

VARINT, I64, LEN, I32 = 0, 1, 2, 5
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
STOP_REASON = {"stop": 0, "length": 1}
_NP = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}


# --- decoding -------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int, where: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise bad_request(where, "truncated or overlong varint in protobuf body")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes, where: str) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) for every field of one message."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos, where)
        num, wt = key >> 3, key & 7
        value: int | bytes
        if wt == VARINT:
            value, pos = _varint(buf, pos, where)
        elif wt == I64:
            if pos + 8 > len(buf):
                raise bad_request(where, "truncated protobuf body")
            value, pos = buf[pos : pos + 8], pos + 8
        elif wt == I32:
            if pos + 4 > len(buf):
                raise bad_request(where, "truncated protobuf body")
            value, pos = buf[pos : pos + 4], pos + 4
        elif wt == LEN:
            n, pos = _varint(buf, pos, where)
            if pos + n > len(buf):
                raise bad_request(where, "truncated protobuf body")
            value, pos = buf[pos : pos + n], pos + n
        else:
            raise bad_request(where, f"unsupported protobuf wire type {wt}")
        yield num, wt, value


def _expect(wt: int, want: int, where: str) -> None:
    if wt != want:
        raise bad_request(where, f"wrong protobuf wire type {wt} (expected {want})")


def _str(v: int | bytes, wt: int, where: str) -> str:
    _expect(wt, LEN, where)
    assert isinstance(v, bytes)
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(where, "not valid UTF-8") from None


def _int(v: int | bytes, wt: int, where: str, bits: int = 64) -> int:
    _expect(wt, VARINT, where)
    assert isinstance(v, int)
    v &= (1 << 64) - 1
    if v >= 1 << 63:  # negative numbers are sign-extended to 64 bits on the wire
        v -= 1 << 64
    if not -(1 << (bits - 1)) <= v < 1 << (bits - 1):
        raise bad_request(where, f"out of range for int{bits}")
    return v


def _double(v: int | bytes, wt: int, where: str) -> float:
    _expect(wt, I64, where)
    assert isinstance(v, bytes)
    return float(struct.unpack("<d", v)[0])


def _bytes(v: int | bytes, wt: int, where: str) -> bytes:
    _expect(wt, LEN, where)
    assert isinstance(v, bytes)
    return v


def _packed_ints(v: int | bytes, wt: int, where: str) -> list[int]:
    if wt == VARINT:
        return [_int(v, wt, where)]
    data = _bytes(v, wt, where)
    out, pos = [], 0
    while pos < len(data):
        x, pos = _varint(data, pos, where)
        out.append(_int(x, VARINT, where))
    return out


def _frombuffer(data: bytes, dtype, where: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise bad_request(where, f"{len(data)} bytes is not a whole number of {np.dtype(dtype)}")
    return np.frombuffer(data, dtype=dtype).copy()


def decode_tensor(buf: bytes, where: str) -> np.ndarray:
    """A `Tensor` (dense or sparse CSR) as a dense numpy array of its declared dtype."""
    dense: bytes | None = None
    csr: tuple[bytes, bytes, bytes] | None = None
    dtype, shape = 0, []
    for num, wt, v in _fields(buf, where):
        if num == 1:
            dense = _bytes(v, wt, where + ".dense")
        elif num == 2:
            parts = {1: b"", 2: b"", 3: b""}
            for n2, wt2, v2 in _fields(_bytes(v, wt, where), where + ".sparse_csr"):
                if n2 in parts:
                    parts[n2] = _bytes(v2, wt2, where + ".sparse_csr")
            csr = (parts[1], parts[2], parts[3])
        elif num == 3:
            dtype = _int(v, wt, where + ".dtype")
        elif num == 4:
            shape.extend(_packed_ints(v, wt, where + ".shape"))
    if dtype not in _NP:
        raise bad_request(where + ".dtype", f"unsupported tensor dtype {dtype}")
    np_dtype = _NP[dtype]
    if any(s < 0 for s in shape):
        raise bad_request(where + ".shape", f"negative dimension in {shape}")
    if csr is not None:
        values = _frombuffer(csr[0], np_dtype, where + ".sparse_csr.values")
        crow = _frombuffer(csr[1], np.int64, where + ".sparse_csr.crow_indices")
        col = _frombuffer(csr[2], np.int64, where + ".sparse_csr.col_indices")
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
        out = np.zeros(shape, dtype=np_dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        out[rows, col] = values
        return out
    arr = _frombuffer(dense or b"", np_dtype, where + ".dense")
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise bad_request(where + ".shape", f"{shape} does not match {arr.size} elements")
        arr = arr.reshape(shape)
    return arr


@dataclass
class FwdBwdRequest:
    """A decoded `ForwardBackwardRequest` (tokens and tensors as numpy arrays)."""

    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    data: list[tuple[np.ndarray, dict[str, np.ndarray]]] = field(default_factory=list)


def _decode_datum(buf: bytes, where: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    tokens: list[np.ndarray] = []
    inputs: dict[str, np.ndarray] = {}
    for num, wt, v in _fields(buf, where):
        if num == 1:
            for n2, wt2, v2 in _fields(_bytes(v, wt, where), where + ".model_input"):
                if n2 == 1:
                    text = _bytes(v2, wt2, where + ".model_input")
                    for n3, wt3, v3 in _fields(text, where + ".model_input.encoded_text"):
                        if n3 == 1:
                            raw = _bytes(v3, wt3, where + ".model_input.encoded_text.tokens")
                            tokens.append(_frombuffer(raw, np.int32, where + ".model_input.tokens"))
                elif n2 in (2, 3):
                    raise bad_request(
                        where + ".model_input",
                        "image and audio chunks are not supported by this service",
                    )
        elif num == 2:
            key, tensor = "", b""
            for n2, wt2, v2 in _fields(_bytes(v, wt, where), where + ".loss_fn_inputs"):
                if n2 == 1:
                    key = _str(v2, wt2, where + ".loss_fn_inputs")
                elif n2 == 2:
                    tensor = _bytes(v2, wt2, where + ".loss_fn_inputs")
            inputs[key] = decode_tensor(tensor, f"{where}.loss_fn_inputs.{key}")
    toks = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
    return toks, inputs


def decode_forward_backward_request(buf: bytes) -> FwdBwdRequest:
    req = FwdBwdRequest()
    v2: dict[str, float | str] = {}
    for num, wt, v in _fields(buf, "forward_backward"):
        if num == 1:
            req.model_id = _str(v, wt, "model_id")
        elif num == 2:
            req.seq_id = _int(v, wt, "seq_id", bits=32)
        elif num == 3:
            req.data.append(_decode_datum(_bytes(v, wt, "data"), f"data[{len(req.data)}]"))
        elif num == 4:
            req.loss_fn = _str(v, wt, "loss_fn")
        elif num == 5:
            key, val = "", 0.0
            for n2, wt2, x in _fields(_bytes(v, wt, "loss_fn_config"), "loss_fn_config"):
                if n2 == 1:
                    key = _str(x, wt2, "loss_fn_config")
                elif n2 == 2:
                    val = _double(x, wt2, f"loss_fn_config.{key}")
            req.loss_fn_config[key] = val
        elif num == 6:
            req.forward_only = bool(_int(v, wt, "forward_only"))
        elif num == 7:
            key, value = "", b""
            for n2, wt2, x in _fields(_bytes(v, wt, "loss_fn_config"), "loss_fn_config"):
                if n2 == 1:
                    key = _str(x, wt2, "loss_fn_config")
                elif n2 == 2:
                    value = _bytes(x, wt2, f"loss_fn_config.{key}")
            for n3, wt3, x in _fields(value, f"loss_fn_config.{key}"):
                if n3 == 1:
                    v2[key] = _double(x, wt3, f"loss_fn_config.{key}")
                elif n3 == 2:
                    v2[key] = _str(x, wt3, f"loss_fn_config.{key}")
    req.loss_fn_config.update(v2)  # the SDK dual-writes; v2 wins (it also carries strings)
    return req


# --- encoding -------------------------------------------------------------------------------


def _enc_varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(num: int, wt: int) -> bytes:
    return _enc_varint(num << 3 | wt)


def _len_field(num: int, payload: bytes) -> bytes:
    return _key(num, LEN) + _enc_varint(len(payload)) + payload


def _int_field(num: int, value: int) -> bytes:
    return _key(num, VARINT) + _enc_varint(value) if value else b""


def _str_field(num: int, value: str) -> bytes:
    return _len_field(num, value.encode()) if value else b""


def _double_field(num: int, value: float) -> bytes:
    return _key(num, I64) + struct.pack("<d", value)


def _batched_tensor(arrays: list[np.ndarray]) -> bytes:
    """Per-datum arrays (same dtype and trailing shape) as one `BatchedTensor`."""
    first = arrays[0]
    dtype = DTYPE_INT64 if first.dtype.kind in "iu" else DTYPE_FLOAT32
    np_dtype = np.int64 if dtype == DTYPE_INT64 else np.float32
    parts = [np.ascontiguousarray(a, dtype=np_dtype).tobytes() for a in arrays]
    offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
    trailing = b"".join(_enc_varint(s) for s in first.shape[1:])
    return (
        _len_field(1, b"".join(parts))
        + _len_field(2, offsets.tobytes())
        + _int_field(3, dtype)
        + (_len_field(4, trailing) if trailing else b"")
    )


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """`ForwardBackwardOutput` with one `ArrayRecord` holding every datum's outputs."""
    record = _str_field(1, "ArrayRecord")
    if outputs:
        for name in outputs[0]:
            entry = _str_field(1, name) + _len_field(2, _batched_tensor([o[name] for o in outputs]))
            record += _len_field(2, entry)
    record += _int_field(3, len(outputs))
    out = _str_field(1, "ArrayRecord") + _len_field(2, record)
    for k, v in metrics.items():
        out += _len_field(3, _str_field(1, k) + _double_field(2, float(v)))
    return out


def encode_sample_response(
    sequences: Sequence[tuple[np.ndarray, np.ndarray, str]], prompt_logprobs: np.ndarray | None
) -> bytes:
    """`SampleResponse`: (tokens, logprobs, stop reason) per sequence, optional prompt logprobs."""
    out = b""
    for tokens, logprobs, stop in sequences:
        seq = (
            _int_field(1, STOP_REASON[stop])
            + _len_field(2, np.asarray(tokens, dtype=np.int32).tobytes())
            + _len_field(3, np.asarray(logprobs, dtype=np.float32).tobytes())
        )
        out += _len_field(1, seq)
    if prompt_logprobs is not None:
        out += _len_field(2, np.asarray(prompt_logprobs, dtype=np.float32).tobytes())
    return out
