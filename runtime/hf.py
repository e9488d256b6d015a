"""Hugging Face folders in and out, around torchtitan's state-dict adapters.

The weights never pass through code of ours: loading is torchtitan's
`CheckpointManager` with `initial_load_in_hf` (its `HuggingFaceStorageReader` + the family's
`StateDictAdapter.from_hf`), exporting is its `dcp_save(to_hf=True)` (`to_hf` +
`HuggingFaceStorageWriter`). What torchtitan does not do is here:

- `check_load_hf`: before any process group, the folder's config.json is compared with the
  recipe's model (family, layers, widths, heads, vocabulary): a mismatch is one line naming
  both shapes (exit 2), not a tensor-size error from inside DCP an hour into a queue wait.
- `hf_config`: the config.json of an exported folder. When the run started from a Hugging
  Face folder its config.json is kept (dtype updated), so fields we do not model
  (token ids, chat template settings) survive; otherwise it is written from torchtitan's
  model config (dimensions, RoPE, norm epsilon), not from a table of ours.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from core.models import HF_MODEL_TYPE, ModelShape

# Tokenizer files copied next to exported weights, so the folder loads on its own.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def read_hf_config(folder: str | Path, *, file: str | None, key: str) -> dict[str, Any]:
    """config.json of a Hugging Face folder; ConfigError when missing or unreadable."""
    p = Path(folder)
    if not p.is_dir():
        raise ConfigError(f"Hugging Face folder not found: {folder}", file=file, key=key)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"{cfg} is missing (a Hugging Face folder has one)", file=file, key=key)
    if not any(p.glob("*.safetensors")):
        raise ConfigError(
            f"no *.safetensors in {folder} (only safetensors weights are read)", file=file, key=key
        )
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg} is not readable JSON: {e}", file=file, key=key) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg} is not a JSON object", file=file, key=key)
    return data


def hf_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The dimensions a Hugging Face config.json declares (None where absent)."""
    heads = cfg.get("num_attention_heads")
    dim = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (dim // heads if dim and heads else None)
    return {
        "model_type": cfg.get("model_type"),
        "layers": cfg.get("num_hidden_layers"),
        "dim": dim,
        "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "ffn": cfg.get("intermediate_size"),
        "vocab": cfg.get("vocab_size"),
        "tied": bool(cfg.get("tie_word_embeddings", False)),
    }


def our_shape(shape: ModelShape) -> dict[str, Any]:
    return {
        "model_type": HF_MODEL_TYPE[shape.family],
        "layers": shape.n_layers,
        "dim": shape.dim,
        "heads": shape.n_heads,
        "kv_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "ffn": shape.ffn_hidden,
        "vocab": shape.vocab_size,
        "tied": shape.weight_tying,
    }


def _fmt(s: dict[str, Any]) -> str:
    return (
        f"{s['model_type']}, {s['layers']} layers, dim {s['dim']}, {s['heads']} heads "
        f"({s['kv_heads']} kv, head_dim {s['head_dim']}), ffn {s['ffn']}, vocab {s['vocab']}"
        f"{', tied embeddings' if s['tied'] else ''}"
    )


def shape_mismatch(shape: ModelShape, cfg: dict[str, Any]) -> str | None:
    """None when the Hugging Face config describes `shape`, else one line naming both."""
    theirs, ours = hf_shape(cfg), our_shape(shape)
    differ = [k for k in ours if theirs[k] != ours[k]]
    if not differ:
        return None
    return (
        f"the Hugging Face model is ({_fmt(theirs)}) but the recipe's {shape.family} "
        f"{shape.flavor} is ({_fmt(ours)}); differing: {', '.join(differ)}"
    )


def check_load_hf(folder: str, shape: ModelShape, *, file: str) -> None:
    """`checkpoint.load_hf` is a Hugging Face folder of exactly the recipe's model shape."""
    cfg = read_hf_config(folder, file=file, key="checkpoint.load_hf")
    problem = shape_mismatch(shape, cfg)
    if problem:
        raise ConfigError(problem, file=file, key="checkpoint.load_hf")


def hf_config(
    model_config: Any,
    family: str,
    dtype: str,
    *,
    base: dict[str, Any] | None = None,
    token_ids: dict[str, int] | None = None,
) -> dict[str, Any]:
    """config.json for torchtitan `model_config` of `family`, weights stored in `dtype`.

    `base` (the config.json of the folder the run started from) is kept with the dtype
    updated; otherwise the dimensions, RoPE and norm epsilon come from torchtitan's config.
    """
    if base is not None:
        return {**base, "torch_dtype": dtype, "dtype": dtype}
    layer = model_config.layers[0]
    attn = layer.attention
    rope = attn.rope
    heads = attn.n_heads
    head_dim = attn.head_dim or model_config.dim // heads
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(rope.theta)}
    if getattr(rope, "scaling", "none") == "llama":
        rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": float(rope.theta),
            "factor": float(rope.scaling_factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": int(rope.original_max_position_embeddings),
        }
    out: dict[str, Any] = {
        "architectures": [{"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]],
        "model_type": HF_MODEL_TYPE[family],
        "hidden_size": model_config.dim,
        "intermediate_size": layer.feed_forward.w1.out_features,
        "num_hidden_layers": len(model_config.layers),
        "num_attention_heads": heads,
        "num_key_value_heads": attn.n_kv_heads or heads,
        "head_dim": head_dim,
        "vocab_size": model_config.vocab_size,
        "max_position_embeddings": int(rope.max_seq_len),
        "rms_norm_eps": float(model_config.norm.eps),
        "rope_parameters": rope_parameters,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": bool(getattr(model_config, "enable_weight_tying", False)),
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if family == "llama3":
        out["mlp_bias"] = False
    out.update(token_ids or {})
    return out


def special_token_ids(tokenizer_dir: str | None) -> dict[str, int]:
    """bos/eos/pad token ids named by the tokenizer folder's tokenizer_config.json (for a
    generated config.json: inference stacks stop generating at eos_token_id)."""
    if not tokenizer_dir:
        return {}
    cfg_path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    tok_path = os.path.join(tokenizer_dir, "tokenizer.json")
    if not (os.path.isfile(cfg_path) and os.path.isfile(tok_path)):
        return {}
    from tokenizers import Tokenizer

    with open(cfg_path) as f:
        cfg = json.load(f)
    tok = Tokenizer.from_file(tok_path)
    out = {}
    for name in ("bos", "eos", "pad"):
        value = cfg.get(f"{name}_token")
        if isinstance(value, dict):  # {"content": "<|...|>", ...}
            value = value.get("content")
        token_id = tok.token_to_id(value) if isinstance(value, str) else None
        if token_id is not None:
            out[f"{name}_token_id"] = token_id
    return out


def finish_export(
    folder: str, config: dict[str, Any], tokenizer_dir: str | None, *, step: int
) -> None:
    """Write config.json and copy the tokenizer files into an exported weights folder."""
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer_dir and os.path.isdir(tokenizer_dir):
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(folder, name))
    with open(os.path.join(folder, "titanscale_export.json"), "w") as f:
        json.dump({"step": step, "dtype": config.get("torch_dtype")}, f)
