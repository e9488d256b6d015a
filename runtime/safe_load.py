"""Loading DCP checkpoints without running code from the file.

DCP's stock reader unpickles `.metadata` with `pickle.load` and its planner loads non-tensor
items with `torch.load(weights_only=False)`; both run code from the file. Here the metadata
unpickler accepts only DCP's metadata classes (`load_metadata`, `SafeFileSystemReader`), and
non-tensor items load with `weights_only=True` (`SafeLoadPlanner`; tensors already do).
Every DCP read of the project goes through these (runtime/checkpoint.py's manager, the
adapter jobs, the service, the RL reference policy).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

# Everything a DCP `.metadata` pickle refers to (torch 2.14): DCP's metadata dataclasses,
# torch.Size / dtype / layout / memory format, and pathlib paths (storage_meta). Calling
# any of these with attacker-chosen arguments constructs plain data; nothing else is found.
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(
            f"refusing to load global {module}.{name} from checkpoint metadata "
            "(only DCP metadata classes are allowed)"
        )


def load_metadata(data: bytes | io.IOBase) -> Metadata:
    """Unpickle DCP metadata allowing DCP's own classes only."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    md = _MetadataUnpickler(stream).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"metadata is a {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata unpickler only builds DCP metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            md = load_metadata(f)
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            lines = str(e).splitlines()
            why = next(
                (ln.strip() for ln in lines if "Unsupported" in ln), lines[0] if lines else ""
            )
            raise pickle.UnpicklingError(
                f"checkpoint item {read_item.dest_index.fqn!r} is not plain data; refusing "
                f"to run code from it ({why[:200]})"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_dcp_load(state_dict: dict[str, Any], checkpoint_id: str, *, no_dist: bool = False) -> None:
    dcp.load(
        state_dict,
        storage_reader=SafeFileSystemReader(checkpoint_id),
        planner=SafeLoadPlanner(),
        no_dist=no_dist,
    )


def drop_absent_adapter_keys(state_dict: dict[str, Any], checkpoint_id: str) -> dict[str, Any]:
    """LoRA fine-tuning starts from a base checkpoint that has no adapter weights: leave the
    model's `lora_a` / `lora_b` entries out of the load (they keep their initialisation,
    B = 0, so the model starts as the base). Every other missing key still fails the load."""
    if not any(".lora_" in k for k in state_dict):
        return state_dict
    present = SafeFileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    return {k: v for k, v in state_dict.items() if ".lora_" not in k or k in present}
