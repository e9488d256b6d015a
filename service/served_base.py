"""The base model `tools.serve` serves: its name, context, tokenizer and (for a Hugging Face
base) its weights, all settled before the model is built.

- Name (what clients pass as `base_model`, listed by `get_server_capabilities`):
  `--base-name`, else for a `checkpoint.load_hf` folder the Hugging Face name it carries
  (config.json's `_name_or_path` when it is `org/name`, or the hub cache's
  `models--org--name/snapshots/<rev>` layout), else `titanscale/<job.name>`.
- Context (prompt + sampled tokens, and a training datum's length): `--context`, else
  `training.seq_len`; at most the model's RoPE table (`max_seq_len` of the flavor), and the
  two model copies plus a full-context KV cache of `max_samples` rows must fit the device.
- Tokenizer (server side: stop strings, EOS): `model.tokenizer`, except that a Hugging Face
  base with the default `embedded` takes the folder's own tokenizer. EOS ids: the
  tokenizer's `eos_token` and config.json / generation_config.json's `eos_token_id`.
- `tokenizer_id` (what `get_info` returns; the SDK's `get_tokenizer()` calls
  `AutoTokenizer.from_pretrained` on it): `--tokenizer-id`, else the served name. Never a
  server path: a Hugging Face name loads from the Hub or the client's cache; for any base,
  `python -m tools.tokenizer --url URL` fetches the served tokenizer's files
  (`GET /api/v1/tokenizer`) into a folder of that name in the client's working directory,
  which `from_pretrained` reads as a local folder.
- Weights of a Hugging Face base: the folder's safetensors through torchtitan's own
  `StateDictAdapter.from_hf` (the same conversion `checkpoint.load_hf` uses in training),
  then a strict check that every base tensor was filled.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import jsonio
from core.errors import ConfigError

HF_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+\Z")
_HUB_CACHE = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")


@dataclass(frozen=True)
class ServedBase:
    name: str
    context: int
    tokenizer_dir: str
    tokenizer_id: str
    eos_ids: tuple[int, ...]
    hf_folder: str | None  # checkpoint.load_hf, when the weights come from Hugging Face


def hf_name(folder: str, cfg: dict[str, Any]) -> str | None:
    """The Hugging Face `org/name` a folder carries, or None."""
    named = cfg.get("_name_or_path")
    if isinstance(named, str) and HF_NAME.match(named) and not os.path.exists(named):
        return named
    m = _HUB_CACHE.search(str(Path(folder).resolve()))
    return f"{m.group(1)}/{m.group(2)}" if m else None


def _eos_ids(tokenizer_dir: str, hf_folder: str | None) -> tuple[int, ...]:
    from runtime.hf import special_token_ids

    ids: set[int] = set()
    eos = special_token_ids(tokenizer_dir).get("eos_token_id")
    if eos is not None:
        ids.add(int(eos))
    for name in ("config.json", "generation_config.json"):
        path = Path(hf_folder or "", name)
        if hf_folder and path.is_file():
            try:
                value = jsonio.loads(path.read_bytes()).get("eos_token_id")
            except (OSError, ValueError):
                continue
            values = value if isinstance(value, list) else [value]
            ids.update(int(v) for v in values if isinstance(v, int))
    return tuple(sorted(ids))


def resolve_served_base(
    recipe: Any,
    *,
    name: str | None = None,
    context: int | None = None,
    tokenizer_id: str | None = None,
    max_samples: int = 64,
    device_bytes: int | None = None,
    check_memory: bool = True,
) -> ServedBase:
    """Everything above, checked: bad values are one ConfigError naming the option or key.
    `check_memory=False`: the caller prices the memory (tools.serve: the model resource's
    plan, parallel/serve.py, which knows the sharding and the generator's size)."""
    from data.tokenizer import resolve_tokenizer, tokenizer_id_count
    from recipe.loader import effective_shape

    f = recipe.source
    shape = effective_shape(recipe)
    folder = recipe.checkpoint.load_hf or None
    cfg: dict[str, Any] = {}
    if folder:
        from runtime.hf import check_load_hf, read_hf_config

        cfg = read_hf_config(folder, file=f, key="checkpoint.load_hf")
        check_load_hf(folder, shape, file=f)  # the folder is the recipe's model, or one line
    if name is not None and not name.strip():
        raise ConfigError("expected a non-empty name", key="--base-name")
    served = name or (folder and hf_name(folder, cfg)) or f"titanscale/{recipe.job.name}"

    ctx = context if context is not None else recipe.training.seq_len
    if ctx < 2:
        raise ConfigError(f"expected at least 2 tokens, got {ctx}", key="--context")
    if shape.max_seq_len and ctx > shape.max_seq_len:
        raise ConfigError(
            f"{ctx} exceeds the model's RoPE table of {shape.max_seq_len} positions "
            f"({recipe.model.family} {recipe.model.flavor}); serve at most {shape.max_seq_len}",
            key="--context",
        )
    need = served_bytes(shape, recipe.training.dtype, ctx, max_samples)
    have = device_bytes if device_bytes is not None else device_memory_bytes()
    if check_memory and need > have:
        raise ConfigError(
            f"serving {ctx} tokens of context needs about {need / 2**30:.1f} GiB (two copies "
            f"of the model and a KV cache of {max_samples} samples) but the device has "
            f"{have / 2**30:.1f} GiB; lower --context",
            key="--context",
        )

    spec = recipe.model.tokenizer
    if folder and spec == "embedded" and (Path(folder) / "tokenizer.json").is_file():
        tok_dir = folder
    else:
        tok_dir = resolve_tokenizer(spec, vocab_size=shape.vocab_size, recipe_file=f)
    ids = tokenizer_id_count(tok_dir)
    if ids is not None and ids > shape.vocab_size:
        raise ConfigError(
            f"the tokenizer in {tok_dir} has {ids} ids but the model's vocabulary is "
            f"{shape.vocab_size}",
            file=f,
            key="model.tokenizer",
        )
    return ServedBase(
        name=served,
        context=ctx,
        tokenizer_dir=tok_dir,
        tokenizer_id=tokenizer_id or served,  # a name, never this machine's path (#41)
        eos_ids=_eos_ids(tok_dir, folder),
        hf_folder=folder,
    )


def served_bytes(shape: Any, dtype: str, context: int, rows: int) -> int:
    """The service's main device memory: the base and the sampler's copy of it, a prompt's
    prefill cache and the decode cache of `rows` samples at full context. Not counted:
    LoRA tensors and optimizer state (rank x width, small), training activations."""
    from rl.generator import kv_cache_bytes

    itemsize = {"float32": 4, "bfloat16": 2}[dtype]
    cache = kv_cache_bytes(
        shape.n_layers, shape.n_kv_heads, shape.head_dim, rows + 1, context, itemsize
    )
    return 2 * shape.total_params * itemsize + cache


def device_memory_bytes() -> int:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def load_hf_weights(model: Any, folder: str, model_spec: Any, *, file: str | None) -> None:
    """The base weights of `model` (LoRA-converted or not) from a Hugging Face folder."""
    import torch
    from safetensors.torch import load_file

    sda_cls = model_spec.state_dict_adapter
    if sda_cls is None:
        raise ConfigError("this model family has no Hugging Face adapter", file=file,
                          key="checkpoint.load_hf")  # fmt: skip
    hf_sd: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        hf_sd.update(load_file(str(path)))
    native = sda_cls(model_spec.model, folder).from_hf(hf_sd)
    del hf_sd
    own = {k for k in model.state_dict() if ".lora_" not in k}
    # torchtitan's fused QKV keeps wq/wk/wv under `qkv_linear`; Hugging Face names don't.
    renamed = {}
    for k, v in native.items():
        if k not in own:
            alt = re.sub(r"\.attention\.(w[qkv])\.", r".attention.qkv_linear.\1.", k)
            k = alt if alt in own else k
        renamed[k] = v
    # The aux-loss-free routing bias (a buffer, zeros at init) has no tensor in the formats
    # without one (Qwen3-MoE, GPT-OSS: runtime.hf.NO_ROUTING_BIAS_FAMILIES); it stays zero,
    # which routes as transformers does. Formats that carry it (DeepSeek-V3) map it.
    missing = sorted(k for k in own - set(renamed) if not k.endswith(".expert_bias_E"))
    unexpected = sorted(set(renamed) - own)
    if missing or unexpected:
        raise ConfigError(
            f"{folder} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}",
            file=file,
            key="checkpoint.load_hf",
        )
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        model.load_state_dict({k: v.to(dtype) for k, v in renamed.items()}, strict=False)
