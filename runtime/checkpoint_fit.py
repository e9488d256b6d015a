"""Does a checkpoint fit the model? Keys and shapes from the DCP metadata, before any load.

torchtitan loads the model with `load_state_dict(strict=False)` and DCP only reads the keys
the model asks for: a checkpoint with MORE layers than the model loads part of itself
silently (layers.3-5 are ignored), one with FEWER raises DCP's "Missing key" from inside
the load, and a different width fails with a tensor-size error. Here the checkpoint's
`.metadata` (read by the safe unpickler, no process group, no tensor read) is compared with
the tensors the model will ask for:

- model tensors: the same keys with the same global shapes, both ways (an extra checkpoint
  tensor would be dropped: a partial load is refused, never silent). A checkpoint without
  any LoRA tensors is a base for a LoRA model (the adapters keep their initialisation, as
  `runtime.checkpoint.drop_absent_adapter_keys` does); one WITH adapter tensors must match
  the model's adapters exactly.
- optimizer state (a resume, not a model-only load): the parameters the checkpoint's
  optimizer state covers are the parameters the model trains.

The result is one line naming what differs ("the checkpoint has 6 transformer layers
(layers.5.* present), the model 3"; "tok_embeddings.weight is [2048, 256] in the
checkpoint, the model expects [2048, 512]"); callers turn it into a ConfigError naming
`checkpoint.load_from` or `checkpoint.folder`.

The expected tensors come from the model itself (`expected_from_module`: a live or meta
model, the state-dict hooks that split fused weights included) or from its torchtitan
config (`expected_from_config`: built on the meta device, about 0.4 s for 405B, no memory).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

# Top-level entries of a titanscale/torchtitan checkpoint that are not model tensors.
NON_MODEL_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
# Wrapper names that parallelisms and compile insert into parameter names; the optimizer's
# state dict (torch's get_optimizer_state_dict) uses the names without them.
_WRAPPERS = re.compile(r"(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_OPT_STATE = "optimizer.state."


@dataclass
class Expected:
    """What the model will ask a checkpoint for."""

    model: dict[str, tuple[int, ...]]
    """Model state-dict key -> global shape."""
    trainable: set[str] = field(default_factory=set)
    """Names of the parameters the optimizer holds state for."""


def clean_name(name: str) -> str:
    return _WRAPPERS.sub("", name)


def expected_from_module(modules: Iterable[torch.nn.Module]) -> Expected:
    """From live (or meta) model parts: DTensors report their global shape."""
    model: dict[str, tuple[int, ...]] = {}
    trainable: set[str] = set()
    for m in modules:
        for k, v in m.state_dict().items():
            if isinstance(v, torch.Tensor):
                model[clean_name(k)] = tuple(v.shape)
        trainable |= {clean_name(n) for n, p in m.named_parameters() if p.requires_grad}
    return Expected(model, trainable)


def expected_from_config(model_config: Any) -> Expected:
    """Build torchtitan `model_config` (after kernels and converters) on the meta device."""
    with torch.device("meta"):
        model = copy.deepcopy(model_config).build()
    return expected_from_module([model])


@dataclass
class Present:
    """What a checkpoint holds, from its metadata."""

    model: dict[str, tuple[int, ...]]
    optimizer_params: set[str]
    has_optimizer: bool
    """Per-parameter optimizer state present (what a resume compares)."""
    any_optimizer: bool = True
    """Any optimizer entry at all (False: a model-only checkpoint, which cannot resume)."""


def read_present(path: str, non_model: Iterable[str] = NON_MODEL_STATES) -> Present:
    """Model tensors (key -> shape) and optimizer-state parameters of checkpoint `path`.
    Raises on unreadable metadata (callers verify the folder first)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from runtime.safe_load import SafeFileSystemReader

    md = SafeFileSystemReader(path).read_metadata()
    prefixes = tuple(f"{n}." for n in non_model)
    model: dict[str, tuple[int, ...]] = {}
    opt: set[str] = set()
    has_opt = any_opt = False
    for k, v in md.state_dict_metadata.items():
        if k.startswith("optimizer."):
            any_opt = True
            # Per-parameter state (torch's flattened optimizer state dict); an optimizer
            # without any (a stand-in in tests) is not compared.
            if k.startswith(_OPT_STATE):
                has_opt = True
                opt.add(k[len(_OPT_STATE) :].rsplit(".", 1)[0])  # drop exp_avg / step / ...
        elif not k.startswith(prefixes) and isinstance(v, TensorStorageMetadata):
            model[k] = tuple(v.size)
    return Present(model, opt, has_opt, any_opt)


def _layers(keys: Iterable[str]) -> int:
    idx = [int(m.group(1)) for k in keys if (m := _LAYER.match(k))]
    return max(idx) + 1 if idx else 0


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


def _more(n: int, what: str) -> str:
    return f" (and {n} more {what})" if n > 0 else ""


def mismatch(present: Present, expected: Expected, *, model_only: bool) -> str | None:
    """None when the checkpoint fits the model, else one line saying what differs."""
    want = dict(expected.model)
    have = present.model
    if not any(".lora_" in k for k in have):
        # A base checkpoint for a LoRA model: adapters start from their initialisation.
        want = {k: v for k, v in want.items() if ".lora_" not in k}
    theirs, ours = _layers(have), _layers(want)
    if theirs != ours:
        if theirs > ours:
            return (
                f"the checkpoint has {theirs} transformer layers (layers.{theirs - 1}.* "
                f"present), the model {ours}: loading it would silently drop layers "
                f"{ours}-{theirs - 1}"
            )
        return (
            f"the checkpoint has {theirs} transformer layers, the model {ours} "
            f"(layers.{theirs}.* missing from the checkpoint)"
        )
    lora_extra = sorted(k for k in have if ".lora_" in k and k not in want)
    if lora_extra and not any(".lora_" in k for k in want):
        return (
            f"the checkpoint holds LoRA adapter weights ({len(lora_extra)} tensors, e.g. "
            f"{lora_extra[0]}) and the model has no adapters: loading it would drop them "
            "(use finetune.mode = 'lora' with the same rank and targets)"
        )
    differ = sorted(k for k in want if k in have and have[k] != want[k])
    if differ:
        k = differ[0]
        return (
            f"{k} is {_shape(have[k])} in the checkpoint, the model expects "
            f"{_shape(want[k])}{_more(len(differ) - 1, 'tensors differ')}"
        )
    missing = sorted(k for k in want if k not in have)
    if missing:
        return (
            f"the model's {missing[0]} is not in the checkpoint{_more(len(missing) - 1, 'missing')}"
        )
    extra = sorted(k for k in have if k not in want)
    if extra:
        return (
            f"the checkpoint's {extra[0]} is not in the model{_more(len(extra) - 1, 'extra')}: "
            "loading it would silently drop them"
        )
    if model_only:
        return None
    if not present.any_optimizer and expected.trainable:
        return (
            "the checkpoint holds model weights only (no optimizer state), so it cannot be "
            "resumed; start from it with checkpoint.load_from in another folder"
        )
    if not present.has_optimizer:
        return None
    trains = expected.trainable
    only_ckpt = sorted(present.optimizer_params - trains)
    only_model = sorted(trains - present.optimizer_params)
    if only_ckpt or only_model:
        ex = (
            f"{only_ckpt[0]} only in the checkpoint"
            if only_ckpt
            else f"{only_model[0]} only in the model"
        )
        return (
            f"the checkpoint's optimizer state covers {len(present.optimizer_params)} "
            f"parameters, the model trains {len(trains)} ({ex}; e.g. LoRA switched on or off "
            "since the checkpoint was written)"
        )
    return None


def check_fits(path: str, expected: Expected, *, model_only: bool) -> str | None:
    """`mismatch` for checkpoint folder `path` (its metadata must be readable)."""
    return mismatch(read_present(path), expected, model_only=model_only)
