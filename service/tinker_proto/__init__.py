"""The `tinker` SDK's wire schema, vendored: `tinker_public.desc` is the serialized
`FileDescriptorProto` of `tinker/proto/tinker_public_pb2.py` in the tinker 0.38.0 wheel
(Apache-2.0, see LICENSE beside it), loaded here into a private descriptor pool.

Why vendored, not `import tinker`: the server then needs only the `protobuf` runtime, not
the client SDK and its dependency tree (transformers, httpx, pyqwest, zstandard, ...), and a
client-side SDK upgrade in the same environment cannot change the server's schema behind
its back. A private pool (not protobuf's default one) lets the SDK's own generated module
be imported in the same process (the tests do) even if its schema differs.
tests/unit/test_service_units.py fails when the installed SDK's descriptor differs from this
copy; re-vendor then with

    python -c "from tinker.proto import tinker_public_pb2 as m; \\
      open('service/tinker_proto/tinker_public.desc', 'wb').write(m.DESCRIPTOR.serialized_pb)"

and re-run the codec tests (they compare with the SDK's encoder and decoder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pool, message_factory

SDK_VERSION = "0.38.0"  # the tinker release the descriptor was taken from
DESCRIPTOR_BYTES = (Path(__file__).with_name("tinker_public.desc")).read_bytes()

_pool = descriptor_pool.DescriptorPool()
FILE = _pool.AddSerializedFile(DESCRIPTOR_BYTES)


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"tinker_public.{name}"))


ForwardBackwardRequest = _message("ForwardBackwardRequest")
ForwardBackwardOutput = _message("ForwardBackwardOutput")
SampleResponse = _message("SampleResponse")
Tensor = _message("Tensor")
TopkLogprobs = _message("TopkLogprobs")

_enum_values = {
    v.name: v.number
    for e in ("StopReason", "DType")
    for v in _pool.FindEnumTypeByName(f"tinker_public.{e}").values
}
STOP_REASON_STOP = _enum_values["STOP_REASON_STOP"]
STOP_REASON_LENGTH = _enum_values["STOP_REASON_LENGTH"]
DTYPE_FLOAT32 = _enum_values["DTYPE_FLOAT32"]
DTYPE_INT64 = _enum_values["DTYPE_INT64"]
DTYPE_INT32 = _enum_values["DTYPE_INT32"]
DTYPE_BFLOAT16 = _enum_values["DTYPE_BFLOAT16"]
