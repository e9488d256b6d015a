"""Hugging Face folders in and out, around torchtitan's state-dict adapters.

The weights never pass through code of ours: loading is torchtitan's
`CheckpointManager` with `initial_load_in_hf` (its `HuggingFaceStorageReader` + the family's
`StateDictAdapter.from_hf`); exporting is the family's `to_hf` + torch's
`HuggingFaceStorageWriter`, laid out as torchtitan's `dcp_save(to_hf=True)` lays it out
(`write_hf_weights`: the one writer of full and merged exports). What torchtitan does not
do is here:

- `check_load_hf`: before any process group, the folder's config.json is compared with the
  recipe's model (family, layers, widths, heads, vocabulary): a mismatch is one line naming
  both shapes (exit 2), not a tensor-size error from inside DCP an hour into a queue wait.
- `verify_hf_folder` (also before any process group, when the folder will be loaded): every
  *.safetensors file (torch's reader reads them all) opens, its header parses and describes
  tensors that lie inside the file; every shard `model.safetensors.index.json` names exists
  and holds the tensors it is named for; every tensor the model loads is present, of the
  shape the model (hence config.json) gives, and floating point (int8 or fp8 weights would
  be cast silently, without their scales); and the values are finite (NaN or inf weights
  are refused naming the tensor). The value scan reads each tensor once, each rank a
  1/world share (tensors i with i % world == rank), at numpy speed (about 1-2 GB/s).
- `check_export_target`: an export never replaces another run's export of the same step
  (section "Exports" below).
- `hf_config`: the config.json of an exported folder. When the run started from a Hugging
  Face folder its config.json is kept (dtype updated), so fields we do not model
  (token ids, chat template settings) survive; otherwise it is written from torchtitan's
  model config (dimensions, RoPE, norm epsilon), not from a table of ours.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from core import jsonio
from core.errors import ConfigError
from core.models import HF_MODEL_TYPE, ModelShape, hf_model_type

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
        data = jsonio.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg} is not readable JSON: {e}", file=file, key=key) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg} is not a JSON object", file=file, key=key)
    return data


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k) is not None), None)


def hf_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The dimensions a Hugging Face config.json declares (None where absent). Mixture of
    experts: the routed experts (qwen3_moe num_experts, gpt_oss num_local_experts,
    deepseek_v3 n_routed_experts), top-k and one expert's width (gpt_oss names it
    intermediate_size: it has no dense FFN)."""
    heads = cfg.get("num_attention_heads")
    dim = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (dim // heads if dim and heads else None)
    if cfg.get("kv_lora_rank"):  # multi-head latent attention: the query/key head width
        head_dim = cfg.get("qk_nope_head_dim", 0) + cfg.get("qk_rope_head_dim", 0)
    experts = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts") or 0
    moe: dict[str, Any] = {}
    if experts:
        expert_ffn = _first(cfg, "moe_intermediate_size", "intermediate_size")
        moe = {"experts": experts, "top_k": cfg.get("num_experts_per_tok"),
               "expert_ffn": expert_ffn}  # fmt: skip
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
        **moe,
    }


def our_shape(shape: ModelShape) -> dict[str, Any]:
    moe: dict[str, Any] = {}
    if shape.is_moe:
        moe = {"experts": shape.n_routed_experts, "top_k": shape.top_k,
               "expert_ffn": shape.moe_ffn_hidden}  # fmt: skip
    return {
        "model_type": hf_model_type(shape.family, shape.flavor),
        "layers": shape.n_layers,
        "dim": shape.dim,
        "heads": shape.n_heads,
        "kv_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        # A dense FFN width only where the model has dense layers (an all-MoE model's
        # config.json carries an unused or expert-sized intermediate_size).
        "ffn": shape.ffn_hidden if shape.n_layers > shape.n_moe_layers else None,
        "vocab": shape.vocab_size,
        "tied": shape.weight_tying,
        **moe,
    }


def _fmt(s: dict[str, Any]) -> str:
    experts = (
        f", {s['experts']} experts (top {s['top_k']}, width {s['expert_ffn']})"
        if s.get("experts")
        else ""
    )
    return (
        f"{s['model_type']}, {s['layers']} layers, dim {s['dim']}, {s['heads']} heads "
        f"({s['kv_heads']} kv, head_dim {s['head_dim']}), ffn {s['ffn']}, vocab {s['vocab']}"
        f"{experts}{', tied embeddings' if s['tied'] else ''}"
    )


def shape_mismatch(shape: ModelShape, cfg: dict[str, Any]) -> str | None:
    """None when the Hugging Face config describes `shape`, else one line naming both."""
    theirs, ours = hf_shape(cfg), our_shape(shape)
    differ = [k for k in ours if theirs.get(k) != ours[k] and not (k == "ffn" and ours[k] is None)]
    if not differ:
        return None
    return (
        f"the Hugging Face model is ({_fmt(theirs)}) but the recipe's {shape.family} "
        f"{shape.flavor} is ({_fmt(ours)}); differing: {', '.join(differ)}"
    )


# safetensors dtypes: element bytes, and which are floating point (loadable as weights).
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                      "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
                      "U8": 1, "BOOL": 1}  # fmt: skip
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# (unsigned view, exponent mask): a value is NaN or inf when all its exponent bits are set.
_EXPONENT = {"F64": ("<u8", 0x7FF0000000000000), "F32": ("<u4", 0x7F800000),
             "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
INDEX_FILE = "model.safetensors.index.json"
_SCAN_ELEMENTS = 1 << 24  # elements per step of the value scan (bounded temporaries)


class _Tensor:
    __slots__ = ("file", "dtype", "shape", "begin", "end")

    def __init__(self, file: Path, dtype: str, shape: list[int], begin: int, end: int) -> None:
        self.file, self.dtype, self.shape, self.begin, self.end = file, dtype, shape, begin, end


def _header(path: Path, fail: Callable[[str], NoReturn]) -> dict[str, _Tensor]:
    """The tensors a safetensors file describes, each checked to lie inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            text = f.read(n) if 0 < n <= min(MAX_HEADER_BYTES, size - 8) else None
    except OSError as e:
        fail(f"{path.name} cannot be read ({e.strerror or e})")
    if text is None:
        fail(f"{path.name} is not a safetensors file (header length {n}, file {size} bytes)")
    try:
        head = jsonio.loads(text)
    except ValueError as e:
        fail(f"{path.name} has a garbage header ({str(e).splitlines()[0][:100]})")
    if not isinstance(head, dict):
        fail(f"{path.name} has a garbage header (not a JSON object)")
    data = size - 8 - n
    out: dict[str, _Tensor] = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = t["dtype"], list(t["shape"]), t["data_offsets"]
            ok = dtype in SAFETENSORS_DTYPES and all(isinstance(d, int) and d >= 0 for d in shape)
            ok = ok and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
        except (TypeError, ValueError, KeyError):  # not a dict, no shape list, 3 offsets ...
            ok = False
        if not ok:
            fail(f"{path.name}: the header entry of {name!r} is not a tensor description")
        need = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if end - begin != need:
            fail(f"{path.name}: {name} {dtype} {shape} needs {need} bytes, the header gives "
                 f"{end - begin}")  # fmt: skip
        if end > data:
            fail(f"{path.name} is truncated: {name} ends at byte {8 + n + end}, the file has "
                 f"{size}")  # fmt: skip
        out[name] = _Tensor(path, dtype, shape, 8 + n + begin, 8 + n + end)
    return out


def _non_finite(t: _Tensor) -> int:
    """How many of a floating tensor's values are NaN or inf (read in bounded steps)."""
    import numpy as np

    view, mask = _EXPONENT[t.dtype]
    count = (t.end - t.begin) // np.dtype(view).itemsize
    if not count:
        return 0
    arr = np.memmap(t.file, dtype=view, mode="r", offset=t.begin, shape=(count,))
    bad = 0
    for i in range(0, count, _SCAN_ELEMENTS):
        part = arr[i : i + _SCAN_ELEMENTS]
        bad += int(np.count_nonzero((part & mask) == mask))
    return bad


def verify_hf_folder(
    folder: str,
    expected: dict[str, tuple[int, ...]] | None = None,
    *,
    file: str | None,
    key: str = "checkpoint.load_hf",
    rank: int = 0,
    world: int = 1,
) -> None:
    """A Hugging Face folder holds what loading it needs (module docstring); ConfigError
    naming the file and what was expected otherwise. `expected`: the Hugging Face names and
    shapes the model loads (None: the files alone are checked)."""

    def fail(problem: str) -> NoReturn:
        raise ConfigError(f"Hugging Face folder {folder}: {problem}", file=file, key=key)

    root = Path(folder)
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        fail(f"cannot be listed ({e.strerror})")
    tensors: dict[str, _Tensor] = {}
    for n in names:
        if not n.endswith(".safetensors"):
            continue
        p = root / n
        try:
            p.resolve(strict=True)  # a dangling link or a symlink loop
        except (OSError, RuntimeError) as e:
            fail(f"{n} cannot be opened ({getattr(e, 'strerror', None) or e})")
        if not p.is_file():
            fail(f"{n} is not a regular file")
        for name, t in _header(p, fail).items():
            if name in tensors:
                fail(f"{name} is in both {tensors[name].file.name} and {n}")
            tensors[name] = t
    index = root / INDEX_FILE
    if index.exists():
        try:
            wmap = jsonio.loads(index.read_bytes()).get("weight_map")
            if not isinstance(wmap, dict):
                raise ValueError("no weight_map")
        except (OSError, ValueError, AttributeError) as e:
            fail(f"{INDEX_FILE} is not readable ({str(e).splitlines()[0][:100]})")
        for name, shard in sorted(wmap.items()):
            if not isinstance(shard, str) or shard not in names:
                fail(f"{INDEX_FILE} names shard {shard!r} (for {name}), which is absent")
            if name not in tensors or tensors[name].file.name != shard:
                fail(f"{INDEX_FILE} puts {name} in {shard}, which does not hold it")
    if not tensors:
        fail("holds no tensors in *.safetensors files")
    if expected is not None:
        for name, shape in expected.items():
            found = tensors.get(name)
            if found is None:
                fail(f"tensor {name} ({list(shape)}) is in no *.safetensors file")
            if tuple(found.shape) != tuple(shape):
                fail(f"{name} is {found.shape} in {found.file.name}; config.json and the model "
                     f"give {list(shape)}")  # fmt: skip
            if found.dtype not in FLOAT_DTYPES:
                fail(f"{name} is {found.dtype} in {found.file.name}: quantized or integer weights would "
                     f"be cast to floating point without their scales; give "
                     f"{'/'.join(FLOAT_DTYPES)} weights")  # fmt: skip
    loaded = sorted(expected) if expected is not None else sorted(tensors)
    for i, name in enumerate(loaded):
        t = tensors[name]
        if i % world == rank and t.dtype in _EXPONENT:
            bad = _non_finite(t)
            if bad:
                fail(f"{name} in {t.file.name} holds {bad} NaN or infinite values")


def hf_expected(model_spec: Any) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names and shapes a model loads: torchtitan's model built on
    the meta device (converters applied, LoRA adapters left out: a base holds none), mapped
    by the family's state-dict adapter (`to_hf`, as its HF load does)."""
    import copy

    import torch

    with torch.device("meta"):
        model = copy.deepcopy(model_spec.model).build()
    sd = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    hf = model_spec.state_dict_adapter(model_spec.model, None).to_hf(sd)
    return {k: tuple(v.shape) for k, v in hf.items()}


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
    if family not in SCRATCH_CONFIG_FAMILIES:
        raise ValueError(f"no config.json writer for {family} (check_scratch_export refuses it)")
    layer = model_config.layers[0]
    moe = next((x.moe for x in model_config.layers if getattr(x, "moe", None) is not None), None)
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
    arch = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    out: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if moe is not None else arch],
        "model_type": "qwen3_moe" if moe is not None else HF_MODEL_TYPE[family],
        "hidden_size": model_config.dim,
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
    if moe is None:
        out["intermediate_size"] = layer.feed_forward.w1.out_features
    else:  # Qwen3 MoE: every layer sparse (torchtitan's qwen3 MoE flavors)
        width = moe.routed_experts.inner_experts.hidden_dim
        out.update(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.router.top_k,
            moe_intermediate_size=width,
            intermediate_size=width,
            norm_topk_prob=bool(moe.router.route_norm),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if family == "llama3":
        out["mlp_bias"] = False
    out.update(token_ids or {})
    return out


# Families whose config.json an export can write from torchtitan's config alone; the others
# (DeepSeek-V3, GPT-OSS, Kimi: YaRN RoPE, MLA, sinks, routing details) export only from a run
# that started from a Hugging Face folder (its config.json is kept).
SCRATCH_CONFIG_FAMILIES = ("llama3", "qwen3")


# MoE families whose Hugging Face format has no per-expert routing bias (DeepSeek-V3 and
# Kimi carry it as e_score_correction_bias).
NO_ROUTING_BIAS_FAMILIES = ("qwen3", "gpt_oss")


def check_scratch_export(
    family: str, *, export: bool, load_hf: str, file: str | None, moe_bias: bool = False
) -> None:
    """`checkpoint.export_hf` of a family whose config.json is not written from scratch
    needs `checkpoint.load_hf`; a MoE model trained with the aux-loss-free routing bias
    exports only where the format carries the bias (else the exported model would route
    differently from the trained one). One line each, before any process group."""
    if export and moe_bias and family in NO_ROUTING_BIAS_FAMILIES:
        raise ConfigError(
            f"the Hugging Face {family} MoE format has no routing bias, so a model trained "
            'with moe.load_balance = "aux_loss_free" would export routing differently; set '
            'moe.load_balance = "none" to export it',
            file=file,
            key="checkpoint.export_hf",
        )
    if export and not load_hf and family not in SCRATCH_CONFIG_FAMILIES:
        raise ConfigError(
            f"exporting {family} to Hugging Face needs checkpoint.load_hf (its config.json "
            "is kept; titanscale writes one from scratch only for "
            f"{', '.join(SCRATCH_CONFIG_FAMILIES)})",
            file=file,
            key="checkpoint.export_hf",
        )


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

    with open(cfg_path, "rb") as f:
        cfg = jsonio.loads(f.read())
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


# -- Exports: never over another run's --------------------------------------------------------
# Each export folder `<export_folder>/step-N` carries EXPORT_INFO naming the run that wrote it:
# the run's checkpoint folder (absolute), which is what a resume continues. A run exports a
# step over an existing one only when that one is its own (a resumed run writing the same
# weights again); another run's export of the same step (two jobs given one export_folder),
# or a folder titanscale did not write, is refused before the run starts (prepare) and again
# at export time, in one line naming checkpoint.export_folder. Refusing (rather than keeping
# both under a run id) keeps `<export_folder>/step-N` the one place a step's weights are.
EXPORT_INFO = "titanscale_export.json"


def export_run_id(checkpoint_folder: str) -> str:
    return os.path.abspath(checkpoint_folder)


def export_steps(steps: int, interval: int, every_checkpoint: bool) -> list[int]:
    """The steps a run exports: the last, and each interval checkpoint when asked."""
    out = {steps}
    if every_checkpoint and interval > 0:
        out |= set(range(interval, steps + 1, interval))
    return sorted(out)


def check_export_target(
    export_folder: str, steps: list[int], run: str, *, file: str | None
) -> None:
    """ConfigError when `<export_folder>/step-N` (N in `steps`) exists and is not `run`'s."""
    for step in steps:
        target = Path(export_folder) / f"step-{step}"
        who = export_owner_problem(target, run)
        if who is not None:
            raise ConfigError(
                f"{target} is {who}; this run would replace it with its own step {step}: "
                "point checkpoint.export_folder at a folder of its own (default "
                "<job.output_dir>/hf)",
                file=file,
                key="checkpoint.export_folder",
            )


def export_owner_problem(target: Path, run: str) -> str | None:
    """Why `run` may not write the export folder `target` (another run's, or not an export
    of ours), or None: it does not exist or is `run`'s own (a resume exporting again)."""
    if not target.exists():
        return None
    try:
        owner = jsonio.loads((target / EXPORT_INFO).read_bytes()).get("run")
    except (OSError, ValueError, AttributeError):
        owner = None
    if owner == run:
        return None
    return (
        f"another run's (checkpoint folder {owner})"
        if isinstance(owner, str)
        else f"not a titanscale export of this run (no readable {EXPORT_INFO})"
    )


def mark_export(folder: str, run: str, **fields: Any) -> None:
    """Record in `folder` the run that wrote it (EXPORT_INFO; `export_owner_problem`)."""
    with open(os.path.join(folder, EXPORT_INFO), "w") as f:
        json.dump({**fields, "run": run}, f)


# -- Writing the weights: one writer for full and merged exports -------------------------------
SHARDED_DIR = "sharded"  # the writer's per-rank files before consolidation (removed after)


def shard_mapping(fqn_to_index_mapping: dict[str, int] | None, names: Any) -> dict[str, int] | None:
    """The file index of every tensor in `names` (Hugging Face names): the state-dict
    adapter's mapping (the shards of the folder the model came from) where it names the
    tensor, else the last file (a merged export's untied lm_head.weight of a tied model,
    which the tied folder's index does not name; the writer would fail with a KeyError).
    None (no mapping): one consolidated file."""
    if not fqn_to_index_mapping:
        return None
    last = max(fqn_to_index_mapping.values())
    return {n: fqn_to_index_mapping.get(n, last) for n in names}


def write_hf_weights(
    folder: str,
    hf_state: dict[str, Any],
    fqn_to_index_mapping: dict[str, int] | None,
    *,
    single_process: bool = False,
) -> None:
    """Write `hf_state` (Hugging Face names: the state-dict adapter's `to_hf` output) as
    safetensors into `folder`, as torchtitan's `dcp_save(to_hf=True)` does: torch's
    `HuggingFaceStorageWriter`, sharded per `fqn_to_index_mapping` when the adapter has one
    (model-0000i-of-0000n.safetensors + model.safetensors.index.json), else consolidated
    into one file (model-00001-of-00001.safetensors + the index).

    Every rank calls (a collective save: DTensors are written by the ranks holding them, the
    shards consolidated a file per rank), or, with `single_process`, one process holding
    whole tensors (the merged export on rank 0: `no_dist`, the writer consolidates alone).
    The per-rank files under `folder/sharded` are removed once consolidated. Committing the
    folder (config.json: `finish_export`; manifest and rename: core.atomic) is the caller's."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )

    mapping = shard_mapping(fqn_to_index_mapping, hf_state)
    sharded = os.path.join(folder, SHARDED_DIR)
    # Collective with a mapping: each rank writes its shards, then consolidates its share of
    # the output files (torchtitan's layout). One process: the writer consolidates in finish.
    collective_shards = bool(mapping) and not single_process
    writer = HuggingFaceStorageWriter(
        path=sharded if collective_shards else folder,
        save_distributed=True,
        fqn_to_index_mapping=mapping,
        enable_consolidation=not collective_shards,
    )
    with warnings.catch_warnings():  # DCP warns that no_dist assumes one process: the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(hf_state, storage_writer=writer, no_dist=single_process)
    if collective_shards:
        assert mapping is not None
        consolidate_safetensors_files_on_every_rank(
            input_dir=sharded, output_dir=folder, fqn_to_index_mapping=mapping, num_threads=5
        )  # ends with a barrier: every rank's share is written
    coordinator = single_process or not dist.is_initialized() or dist.get_rank() == 0
    if coordinator:
        shutil.rmtree(sharded, ignore_errors=True)


def finish_export(
    folder: str,
    *,
    model_config: Any,
    family: str,
    dtype: str,
    tokenizer_dir: str | None,
    step: int | None,
    run: str = "",
    base_config: str = "",
    untied: bool = False,
) -> None:
    """Finish a weights folder `write_hf_weights` wrote (a run's export and a merged adapter
    export alike): config.json (`hf_config`: the config.json of `base_config`, the folder the
    run started from, dtype updated; else written from torchtitan's `model_config` with the
    tokenizer's bos/eos/pad ids; `untied`: tie_word_embeddings false, for a merged model
    whose lm_head adapter made the output projection its own), the tokenizer files of
    `tokenizer_dir`, and EXPORT_INFO: the step (None: not a training step's), dtype and the
    run that wrote it."""
    base = None
    if base_config:
        with open(os.path.join(base_config, "config.json"), "rb") as f:
            base = jsonio.loads(f.read())
    config = hf_config(
        model_config, family, dtype, base=base, token_ids=special_token_ids(tokenizer_dir)
    )
    if untied:
        config["tie_word_embeddings"] = False
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer_dir and os.path.isdir(tokenizer_dir):
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(folder, name))
    with open(os.path.join(folder, EXPORT_INFO), "w") as f:
        json.dump({"step": step, "dtype": config.get("torch_dtype"), "run": run}, f)
