"""LoRA adapters on torchtitan models: find them, swap them, export them (PEFT) and merge them.

torchtitan's LoRA converter (torchtitan.components.lora) replaces each target Linear with a
subclass holding the frozen base `weight` and two trainable Linears `lora_a` (r x in,
Kaiming-uniform) and `lora_b` (out x r, zeros), and computes base(x) + alpha/r * B(A(x)).
The same math is PEFT's LoRA (`lora_A`, `lora_B`, scaling lora_alpha/r), so an adapter exports
exactly, with two renamings:
- module names follow torchtitan's Llama HF state-dict adapter (wo -> o_proj, w1 -> gate_proj,
  w2 -> down_proj, w3 -> up_proj, lm_head -> lm_head);
- the fused `wqkv` (one A, one B over [q; k; v] grouped per key/value head, as
  torchtitan's FusedQKVLinear lays it out) becomes q_proj / k_proj / v_proj adapters that share
  A and take their rows of B (B A x restricted to those output rows is exactly that), with
  q/k rows reordered by the same permutation the HF adapter applies to q/k weights (obtained
  by running row indices through `to_hf`, so it is torchtitan's permutation, not a copy).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from core import jsonio

PEFT_WEIGHTS = "adapter_model.safetensors"
# LoRA on MoE routed experts (runtime.moe_experts): PEFT cannot hold one pair per expert of a
# fused expert tensor as transformers 5 lays Qwen3-MoE out, so these pairs go beside the PEFT
# folder in torchtitan's names (layers.N.moe.routed_experts.inner_experts.lora_{a,b}{1,2,3}:
# A (E, r, in), B (E, out, r); 1 = gate/w1, 3 = up/w3, 2 = down/w2; scale lora_alpha / r).
ROUTED_EXPERTS_WEIGHTS = "routed_experts_lora.safetensors"
PEFT_CONFIG = "adapter_config.json"
_HF_NAMES = {"wo": "self_attn.o_proj", "w1": "mlp.gate_proj", "w2": "mlp.down_proj",
             "w3": "mlp.up_proj"}  # fmt: skip


def lora_modules(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, module) of every LoRA-converted linear, in model order, named as the state
    dict names it: an activation-checkpointed block's `_checkpoint_wrapped_module.` is left
    out, so an adapter's tensor names do not depend on the activation checkpointing."""
    for name, m in model.named_modules():
        if isinstance(getattr(m, "lora_a", None), nn.Module) and hasattr(m, "lora_b"):
            yield name.replace("._checkpoint_wrapped_module", ""), m


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights (name -> full tensor, detached), A and B of every LoRA linear."""
    out = {}
    for name, m in lora_modules(model):
        for part in ("lora_a", "lora_b"):
            w = getattr(m, part).weight
            w = w.full_tensor() if hasattr(w, "full_tensor") else w
            out[f"{name}.{part}.weight"] = w.detach()
    return out


def base_state(model: nn.Module, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """Every non-adapter parameter and buffer, whole (FSDP shards gathered: collective).
    `copy=False` for a reader that does not keep or change them (the export): a sharded
    tensor's gather is already a new tensor, an unsharded one is then the model's own."""
    out = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        whole = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = whole.detach().clone() if copy and whole is v else whole.detach()
    return out


def expert_adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The routed-expert adapters (runtime.moe_experts), name -> full tensor, detached."""
    from runtime.moe_experts import expert_lora_modules

    out = {}
    for name, m in expert_lora_modules(model):
        for p, t in m.named_parameters(recurse=False):
            if p.startswith("lora_"):
                out[f"{name}.{p}"] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
    return out


@torch.no_grad()
def fold_expert_adapters(
    base: dict[str, torch.Tensor], experts: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """Routed-expert adapters folded into the base expert weights (torchtitan names):
    w[e] + scale * B[e] A[e] per expert and projection, in float32, cast back."""
    out = dict(base)
    for key, w_name in (("1", "w1_EFD"), ("3", "w3_EFD"), ("2", "w2_EDF")):
        for a_key in [k for k in experts if k.endswith(f".lora_a{key}")]:
            mod = a_key.rsplit(".", 1)[0]
            a, b = experts[a_key].float(), experts[f"{mod}.lora_b{key}"].float()
            w = out[f"{mod}.{w_name}"]
            out[f"{mod}.{w_name}"] = (w.float() + scale * torch.bmm(b, a)).to(w.dtype)
    return out


def is_expert_key(name: str) -> bool:
    """Whether an adapter tensor name is a routed-expert pair's (`...lora_a1`), not a
    LoRA Linear's (`...lora_a.weight`)."""
    return re.search(r"\.lora_[ab][123]$", name) is not None


def write_expert_adapter(folder: str, experts: dict[str, torch.Tensor]) -> None:
    """The routed-expert pairs as ROUTED_EXPERTS_WEIGHTS in `folder` (torchtitan names)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in experts.items()},
              os.path.join(folder, ROUTED_EXPERTS_WEIGHTS))  # fmt: skip


def read_expert_adapter(folder: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """ROUTED_EXPERTS_WEIGHTS of an adapter folder, checked against `shapes` (every pair the
    model's routed experts hold at the folder's rank: runtime.moe_experts
    .expert_adapter_shapes): ValueError naming the file (and the tensor) when it is
    unreadable, lacks a pair, holds one the model has no slot for, or has a shape that does
    not fit or a non-finite value. safetensors holds no code."""
    from safetensors.torch import load_file

    f = ROUTED_EXPERTS_WEIGHTS
    if not shapes:
        raise ValueError(f"{f}: this model has no routed experts to adapt")
    try:
        tensors = load_file(os.path.join(folder, f))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{f} is unreadable ({type(e).__name__})") from None
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise ValueError(f"{f}: no routed-expert slot for {extra[0]}")
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{f}: {name} is missing")
        if tuple(t.shape) != shape:
            raise ValueError(f"{f}: {name} has shape {tuple(t.shape)}, this model's adapter "
                             f"needs {shape}")  # fmt: skip
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{f}: {name} is not finite floating point")
    return tensors


class AdapterWeights(nn.Module):
    """One adapter's tensors, parameters named as the model's LoRA weights
    (`layers.0.attention.wo.lora_a.weight`): torchtitan's optimizer container, DCP
    checkpoints and `bind_adapter` address them by those names. Rank-0 pairs stay frozen."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod: nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(t, requires_grad=t.numel() > 0))

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return dict(self.named_parameters())


def init_adapter(
    model: nn.Module,
    seed: int,
    *,
    rank: int | None = None,
    targets: Callable[[str], bool] | None = None,
) -> AdapterWeights:
    """The one initialisation of every adapter ([[adapters]] jobs, the service): torchtitan's
    converter's (A Kaiming-uniform with a = sqrt(5), B zeros) drawn from `seed` on a CPU
    generator in model order, so the same seed, rank and targets give the same adapter.
    `rank`: default the converted modules' own; modules `targets(name)` rejects get rank 0."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in lora_modules(model):
        a, b = m.lora_a.weight, m.lora_b.weight
        fan_in = a.shape[1]
        r = 0 if targets is not None and not targets(name) else a.shape[0] if rank is None else rank
        # kaiming_uniform_(a=sqrt(5)): bound = sqrt(6 / ((1 + 5) * fan_in)) = 1 / sqrt(fan_in)
        bound = 1.0 / math.sqrt(fan_in)
        wa = (torch.rand((r, fan_in), generator=gen, dtype=torch.float32) * 2 - 1) * bound
        out[f"{name}.lora_a.weight"] = wa.to(a.device, a.dtype)
        out[f"{name}.lora_b.weight"] = torch.zeros((b.shape[0], r), dtype=b.dtype, device=b.device)
    return AdapterWeights(out)


def bind_adapter(model: nn.Module, params: dict[str, nn.Parameter] | AdapterWeights) -> None:
    """Point the model's LoRA linears at `params` (no copy: the adapter's own tensors get
    the gradients). One frozen base serves any number of adapters this way."""
    if isinstance(params, AdapterWeights):
        params = params.params
    for name, m in lora_modules(model):
        m.lora_a.weight = params[f"{name}.lora_a.weight"]
        m.lora_b.weight = params[f"{name}.lora_b.weight"]


# -- PEFT export -------------------------------------------------------------------------------
def _row_permutation(adapter: Any, key: str, rows: int, cols: int) -> torch.Tensor | None:
    """The row order `adapter.to_hf` gives tensor `key` (None when it keeps the order)."""
    idx = torch.arange(rows, dtype=torch.float64).unsqueeze(1).expand(rows, cols).contiguous()
    out = adapter.to_hf({key: idx})
    (val,) = out.values()
    perm = val[:, 0].round().long()
    return None if torch.equal(perm, torch.arange(rows)) else perm


def peft_tensors(
    model_config: Any, adapter: dict[str, torch.Tensor], state_dict_adapter: Any
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our adapter (lora_modules names) -> PEFT tensor names for transformers' Llama, and the
    PEFT target module names used."""
    attn = model_config.layers[0].attention
    n_heads = attn.n_heads
    n_kv = attn.n_kv_heads or n_heads
    dim = model_config.dim
    hd = attn.head_dim or dim // n_heads
    hpk = n_heads // n_kv
    out: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    perms: dict[str, torch.Tensor | None] = {}

    def put(hf_module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        base = f"base_model.model.{hf_module}"
        out[f"{base}.lora_A.weight"] = a.contiguous()
        out[f"{base}.lora_B.weight"] = b.contiguous()
        targets.add(hf_module.rsplit(".", 1)[-1])

    names = sorted({k.rsplit(".lora_", 1)[0] for k in adapter})
    for name in names:
        a = adapter[f"{name}.lora_a.weight"]
        b = adapter[f"{name}.lora_b.weight"]
        if a.shape[0] == 0:  # an untargeted module (rank 0): not an adapter in PEFT's terms
            continue
        if name == "lm_head":
            put("lm_head", a, b)
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(attention|feed_forward)\.(.+)", name)
        if m is None:
            raise ValueError(f"no PEFT name for LoRA module {name!r}")
        layer, rest = m.group(1), m.group(3)
        prefix = f"model.layers.{layer}"
        if rest in ("wo", "w1", "w2", "w3"):
            put(f"{prefix}.{_HF_NAMES[rest]}", a, b)
            continue
        if rest == "qkv_linear.wqkv":
            r = b.shape[1]
            w = b.reshape(n_kv, hpk + 2, hd, r)  # FusedQKVLinear: per kv head [q.., k, v]
            parts = {
                "q": w[:, :hpk].reshape(-1, r),
                "k": w[:, hpk].reshape(-1, r),
                "v": w[:, hpk + 1].reshape(-1, r),
            }
        elif rest.startswith("qkv_linear.w") and rest[-1] in "qkv":
            parts = {rest[-1]: b}
        else:
            raise ValueError(f"no PEFT name for LoRA module {name!r}")
        for which, bp in parts.items():
            key = f"layers.{layer}.attention.qkv_linear.w{which}.weight"
            cols = dim
            if which not in perms:
                perms[which] = _row_permutation(state_dict_adapter, key, bp.shape[0], cols)
            perm = perms[which]
            put(f"{prefix}.self_attn.{which}_proj", a, bp[perm] if perm is not None else bp)
    return out, sorted(targets)


def adapter_from_peft(
    model_config: Any,
    peft: dict[str, torch.Tensor],
    state_dict_adapter: Any,
    like: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """PEFT tensors -> our adapter names, shaped like `like` (the adapter's own tensors,
    lora_modules names): the inverse of `peft_tensors`, found by running each module's row
    indices through `peft_tensors` itself (so the q/k/v split and the HF row permutation are
    the export's, not a second copy). A module PEFT leaves out keeps `like`'s tensors (its
    initialisation: B = 0, no effect); q/k/v of a fused wqkv that PEFT holds with different
    A matrices cannot share one A: ValueError, as for a shape that does not fit or a PEFT
    module this model has no slot for."""
    out = {k: v.detach().clone() for k, v in like.items()}
    used: set[str] = set()
    for name in sorted({k.rsplit(".lora_", 1)[0] for k in like}):
        a0, b0 = like[f"{name}.lora_a.weight"], like[f"{name}.lora_b.weight"]
        if a0.shape[0] == 0:
            continue
        rows = torch.arange(b0.shape[0], dtype=torch.float64).unsqueeze(1)
        probe = {f"{name}.lora_a.weight": torch.zeros(1, a0.shape[1], dtype=torch.float64),
                 f"{name}.lora_b.weight": rows}  # fmt: skip
        mapped, _ = peft_tensors(model_config, probe, state_dict_adapter)
        pieces = [k.removesuffix(".lora_B.weight") for k in mapped if k.endswith(".lora_B.weight")]
        present = [p for p in pieces if f"{p}.lora_A.weight" in peft]
        if not present:
            continue
        a = peft[f"{present[0]}.lora_A.weight"]
        if tuple(a.shape) != tuple(a0.shape):
            raise ValueError(f"{present[0]}.lora_A.weight has shape {tuple(a.shape)}, this "
                             f"model's adapter needs {tuple(a0.shape)}")  # fmt: skip
        for p in present[1:]:
            if not torch.equal(peft[f"{p}.lora_A.weight"], a):
                raise ValueError(f"{present[0]} and {p} have different lora_A matrices; the "
                                 "fused q/k/v projection holds one A for all three")  # fmt: skip
        b = torch.zeros(b0.shape, dtype=torch.float32)
        for p in present:
            idx = mapped[f"{p}.lora_B.weight"][:, 0].round().long()
            pb = peft.get(f"{p}.lora_B.weight")
            if pb is None or tuple(pb.shape) != (len(idx), a0.shape[0]):
                raise ValueError(f"{p}.lora_B.weight is missing or not [{len(idx)}, {a0.shape[0]}]")
            b[idx] = pb.float()
        out[f"{name}.lora_a.weight"] = a.to(a0.dtype).to(a0.device)
        out[f"{name}.lora_b.weight"] = b.to(b0.dtype).to(b0.device)
        used.update(present)
    extra = sorted({k.rsplit(".lora_", 1)[0] for k in peft} - used)
    if extra:
        raise ValueError(f"no trained adapter slot for PEFT module(s) {', '.join(extra[:3])}")
    return out


def read_peft(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, adapter_config) of a PEFT LoRA folder, refusing what our LoRA cannot
    compute (another PEFT type, rsLoRA, DoRA, biases, fan_in_fan_out): ValueError naming it.
    safetensors holds no code."""
    from safetensors.torch import load_file

    try:
        with open(os.path.join(folder, PEFT_CONFIG), "rb") as f:
            cfg = jsonio.loads(f.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"{PEFT_CONFIG} is unreadable ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{PEFT_CONFIG} is not a JSON object")
    wrong = {"peft_type": cfg.get("peft_type") != "LORA", "use_rslora": bool(cfg.get("use_rslora")),
             "use_dora": bool(cfg.get("use_dora")), "bias": cfg.get("bias", "none") != "none",
             "fan_in_fan_out": bool(cfg.get("fan_in_fan_out"))}  # fmt: skip
    bad = [k for k, v in wrong.items() if v]
    if bad:
        raise ValueError(f"{PEFT_CONFIG}: {bad[0]}={cfg.get(bad[0])!r} is not plain LoRA")
    if not isinstance(cfg.get("r"), int) or not isinstance(cfg.get("lora_alpha"), int | float):
        raise ValueError(f"{PEFT_CONFIG} needs an integer 'r' and a numeric 'lora_alpha'")
    try:
        tensors = load_file(os.path.join(folder, PEFT_WEIGHTS))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{PEFT_WEIGHTS} is unreadable ({type(e).__name__})") from None
    return tensors, cfg


def export_peft(
    folder: str,
    *,
    model_config: Any,
    adapter: dict[str, torch.Tensor],
    state_dict_adapter: Any,
    rank: int,
    alpha: float,
    base_model: str = "",
) -> str:
    """Write adapter_model.safetensors + adapter_config.json (PEFT LoRA) into `folder`."""
    from safetensors.torch import save_file

    tensors, targets = peft_tensors(model_config, adapter, state_dict_adapter)
    os.makedirs(folder, exist_ok=True)
    save_file(
        {k: v.detach().cpu().clone() for k, v in tensors.items()},
        os.path.join(folder, PEFT_WEIGHTS),
    )
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    with open(os.path.join(folder, PEFT_CONFIG), "w") as f:
        json.dump(cfg, f, indent=1)
    return folder


# -- merged model ------------------------------------------------------------------------------
@torch.no_grad()
def merge_into_hf(
    hf_state: dict[str, torch.Tensor], peft: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """Fold PEFT adapters into an HF state dict: W + scale * B A for every adapted module
    (in float32, cast back to W's dtype). Works on the full (gathered) state of any layout."""
    out = dict(hf_state)
    for key, a in peft.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = peft[key.replace(".lora_A.", ".lora_B.")]
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def export_merged(
    folder: str,
    *,
    base: dict[str, torch.Tensor],
    adapter: dict[str, torch.Tensor],
    model_config: Any,
    state_dict_adapter: Any,
    scale: float,
    family: str = "llama3",
    dtype: torch.dtype = torch.float32,
    tokenizer_dir: str | None = None,
    run: str = "",
) -> str:
    """The merged model (base + adapter) as a Hugging Face folder, written as a full export is
    (runtime.hf.write_hf_weights: safetensors sharded per the state-dict adapter's
    fqn_to_index_mapping or one consolidated file, + index; finish_export: config.json from
    runtime.hf.hf_config for `family`, tokenizer files, EXPORT_INFO). One process, whole
    tensors: `base` is the full torchtitan state dict without adapter keys. Committing the
    folder (manifest, rename) is the caller's (export_adapter).

    Tied embeddings (Qwen3's small flavors) with an adapter on lm_head: the merged output
    projection is embed + scale * B A, no longer the embedding, so the folder is written
    untied (its own lm_head.weight, tie_word_embeddings = false)."""
    from runtime.hf import finish_export, write_hf_weights

    peft, _ = peft_tensors(model_config, adapter, state_dict_adapter)
    hf = state_dict_adapter.to_hf(dict(base))
    untie = "lm_head.weight" not in hf and "base_model.model.lm_head.lora_A.weight" in peft
    if untie:  # the tied adapter's to_hf drops lm_head.weight: it is the embedding
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    hf = merge_into_hf(hf, peft, scale)
    os.makedirs(folder, exist_ok=True)
    weights = {k: v.detach().to(dtype).cpu().contiguous() for k, v in hf.items()}
    write_hf_weights(
        folder, weights, getattr(state_dict_adapter, "fqn_to_index_mapping", None),
        single_process=True,
    )  # fmt: skip
    finish_export(folder, model_config=model_config, family=family,
                  dtype=str(dtype).removeprefix("torch."), tokenizer_dir=tokenizer_dir,
                  step=None, run=run, untied=untie)  # fmt: skip
    return folder


def export_adapter(
    model: nn.Module,
    recipe: Any,
    name: str,
    *,
    model_config: Any,
    state_dict_adapter: Any,
    tokenizer_dir: str | None = None,
) -> str:
    """The adapter bound in `model` as a PEFT folder <finetune.export_dir>/<name> (and, with
    finetune.export_merged, the merged model in its merged/ subfolder, `tokenizer_dir`'s
    tokenizer files copied in as for a full export). Every rank calls
    (gathering sharded tensors is collective); rank 0 writes, into a hidden sibling that is
    committed whole (core.atomic: manifest, fsync, one rename; a previous export of the same
    name is replaced only once the new one is complete)."""
    import shutil

    import torch.distributed as dist

    from core.atomic import folder_crcs, fsync_files, publish_folder, write_manifest
    from runtime.hf import export_run_id, mark_export

    r = recipe
    folder = adapter_export_folder(r, name)
    adapter = adapter_state(model)
    experts = expert_adapter_state(model)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    # FSDP: an all-gather on every rank (collective); no further copy of the base anywhere.
    base = base_state(model, copy=False) if r.finetune.export_merged else None
    if not rank0:
        return folder
    check_adapter_export(r, name)  # again at export time: another run may have written since
    kw = {
        "model_config": model_config,
        "adapter": adapter,
        "state_dict_adapter": state_dict_adapter,
    }
    run = export_run_id(r.checkpoint_dir)
    parent, leaf = os.path.split(folder.rstrip("/"))
    tmp = os.path.join(parent, f".{leaf}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export_peft(tmp, rank=r.lora.rank, alpha=r.lora.alpha, **kw)
        scale = r.lora.alpha / r.lora.rank
        if experts:
            write_expert_adapter(tmp, experts)
            if base is not None:  # new tensors for the experts: the model's stay untouched
                base = fold_expert_adapters(base, experts, scale)
        if base is not None:
            merged = os.path.join(tmp, "merged")
            export_merged(merged, base=base, scale=scale, family=r.model.family,
                          tokenizer_dir=tokenizer_dir, run=run, **kw)  # fmt: skip
            write_manifest(merged, folder_crcs(merged))
            fsync_files(merged)
        mark_export(tmp, run)
        write_manifest(tmp, folder_crcs(tmp))
        fsync_files(tmp)
        publish_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def adapter_export_folder(recipe: Any, name: str) -> str:
    r = recipe
    return os.path.join(r.finetune.export_dir.replace("{output_dir}", r.output_dir), name)


def check_adapter_export(recipe: Any, name: str) -> None:
    """ConfigError when <finetune.export_dir>/<name> holds another run's export (two runs
    given one export_dir silently replaced the first one's adapter, #41); this run's own
    (a resume) may be written again."""
    from core.errors import ConfigError
    from runtime.hf import export_owner_problem, export_run_id

    folder = adapter_export_folder(recipe, name)
    who = export_owner_problem(Path(folder), export_run_id(recipe.checkpoint_dir))
    if who is not None:
        raise ConfigError(
            f"{folder} is {who}; this run would replace it with its adapter: point "
            "finetune.export_dir at a folder of its own",
            file=recipe.source,
            key="finetune.export_dir",
        )
