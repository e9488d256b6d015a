"""The backend on torchtitan: one frozen base model, LoRA adapters that take turns on it.

Built from a recipe through the same pieces as train.py: torchtitan's model registry, the
project's kernel choice (`kernels.registry.apply_kernels`: dense attention on CPU, flex on
GPU) and torchtitan's `LoRAConverter`, which turns every targeted `Linear` into a LoRA linear
with a frozen base. Losses are the RL layer's (`rl.losses`, sum-aggregated as Tinker defines
them), per-token logprobs its `rl.policy.forward_logits`, sampling its KV-cache
`rl.generator.Generator`.

Several adapters, one base: each adapter owns its own LoRA tensors (rank, seed, targets) and
its own AdamW state; before an adapter's operation its tensors are bound into the converted
modules by reference (no copy), so the base is shared and never trained. Operations run one
at a time (the scheduler's worker), so adapters take turns and an adapter's numbers never
depend on the others: running four sessions at once gives each the losses it gets alone.
A module an adapter does not target (train_mlp / train_attn / train_unembed = false) gets a
rank-0 pair: its LoRA branch adds exactly zero.

The adapter mechanics are the SFT layer's (`posttrain.lora`: `lora_modules`, `bind_adapter`;
`posttrain.adapters.load_base` loads the base from `checkpoint.load_from`, else the base is
initialised from `training.seed`). Per-adapter rank and targets are this module's addition
(Tinker clients choose them); the scale is alpha / rank with alpha from the recipe's `[lora]`.
Not done: PEFT key names in saved adapter weights (posttrain.lora.export_peft does it for
recipe-shaped adapters), multi-GPU sharding of the base (the service holds one device). The
sampler holds one deep copy of the model (a second base in memory).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from posttrain.lora import bind_adapter, lora_modules
from rl.generator import Generator
from rl.generator import SamplingParams as GenParams
from rl.losses import BUILTIN_LOSSES, LossBatch, LossConfig
from rl.policy import forward_logits
from service import proto
from service.backend import BaseModelInfo
from service.errors import ServiceError, bad_request
from service.served_base import ServedBase, load_hf_weights
from service.types import (
    AdamParams,
    Datum,
    FwdBwdResult,
    LoraSpec,
    SampledSeq,
    SampleResult,
    SamplingParams,
)


def _category(fqn: str) -> str:
    if ".attention." in fqn:
        return "attn"
    if ".feed_forward." in fqn or ".moe." in fqn:
        return "mlp"
    return "unembed"


def _targets(spec: LoraSpec, fqn: str) -> bool:
    return {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}[
        _category(fqn)
    ]


@dataclass
class _Adapter:
    spec: LoraSpec
    params: dict[str, nn.Parameter]  # "<module>.lora_a.weight" [rank, in], ".lora_b" [out, rank]
    opt: torch.optim.Optimizer

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params.values() if p.requires_grad]

    def state(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().cpu().contiguous() for k, p in self.params.items() if p.requires_grad}


@dataclass
class _Snapshot:
    """Frozen adapter tensors a sampler samples with."""

    rank: int
    params: dict[str, torch.Tensor]


def build_lora_model(
    recipe, device: torch.device, served: ServedBase | None = None
) -> tuple[nn.Module, BaseModelInfo]:
    """The recipe's model with every Linear LoRA-converted (placeholder rank 1), initialised
    from training.seed (or a Hugging Face base's weights), on `device`."""
    from torchtitan.components.lora import LoRAConverter

    from kernels.registry import apply_kernels
    from runtime.build import choose_kernels, recipe_model_spec
    from runtime.platform import Platform

    platform = Platform.detect()
    spec = recipe_model_spec(recipe)
    cfg = apply_kernels(spec.model, choose_kernels(recipe, platform)).model_config
    # Every linear gets a LoRA slot; each client's adapter decides which it trains.
    cfg = LoRAConverter.Config(rank=1, alpha=recipe.lora.alpha).build().convert(cfg)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[recipe.training.dtype]
    torch.manual_seed(recipe.training.seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cfg.build()
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    finally:
        torch.set_default_dtype(prev)
    if recipe.checkpoint.load_from:
        from posttrain.adapters import load_base

        load_base(model, recipe.checkpoint.load_from, file=recipe.source)
    if served is not None and served.hf_folder:
        load_hf_weights(model, served.hf_folder, spec, file=recipe.source)
    vocab = model.tok_embeddings.weight.shape[0]
    info = BaseModelInfo(
        name=served.name if served else f"titanscale/{recipe.job.name}",
        max_context=served.context if served else recipe.training.seq_len,
        vocab_size=int(vocab),
        arch=f"{recipe.model.family}-{recipe.model.flavor}",
        tokenizer_id=served.tokenizer_id if served else None,
    )
    return model, info


class TitanLoraBackend:
    max_lora_rank = 128

    def __init__(
        self,
        model: nn.Module,
        info: BaseModelInfo,
        *,
        alpha: float,
        devices: int = 1,
        tokenizer_dir: str | None = None,
        eos_ids: tuple[int, ...] = (),
    ):
        self.model = model
        self.info = info
        self.alpha = alpha
        self.devices = devices
        self.device = next(model.parameters()).device
        self.modules = dict(lora_modules(model))
        for p in model.parameters():
            p.requires_grad_(False)  # the base is frozen; adapters bring their own tensors
        self.adapters: dict[str, _Adapter] = {}
        self._samplers: dict[str, _Snapshot] = {}
        self._ids = itertools.count()
        self._generator: Generator | None = None
        self.eos_ids = eos_ids  # what stop=None stops at
        self._tokenizer = None
        if tokenizer_dir:  # server-side decoding of stop strings
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))

    @classmethod
    def from_recipe(cls, recipe, served: ServedBase | None = None) -> TitanLoraBackend:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            # torchtitan builds attention masks with a torch.compile'd create_block_mask, which
            # recompiles for every new sequence length (~30 s each on CPU). The CPU attention
            # backend (dense) only evaluates the mask's mask_mod, so eager is exact and cheap.
            # torch.compile reads this when torchtitan's attention module is imported, which
            # build_lora_model does next (the first torchtitan import of `tools.serve`).
            os.environ["TORCHDYNAMO_DISABLE"] = "1"
        model, info = build_lora_model(recipe, device, served)
        if served is None:
            return cls(model, info, alpha=recipe.lora.alpha)
        return cls(model, info, alpha=recipe.lora.alpha, tokenizer_dir=served.tokenizer_dir,
                   eos_ids=served.eos_ids)  # fmt: skip

    def base_model(self) -> BaseModelInfo:
        return self.info

    # --- adapters -----------------------------------------------------------------------------

    def _new_tensors(self, spec: LoraSpec, gen: torch.Generator) -> dict[str, nn.Parameter]:
        out = {}
        dt = next(self.model.parameters()).dtype
        for fqn, m in self.modules.items():
            w = m.weight
            out_f, in_f = w.shape
            r = spec.rank if _targets(spec, fqn) else 0
            ta = torch.empty(r, in_f, dtype=torch.float32)
            if r:  # the init torchtitan's LoRALinear uses: kaiming-uniform A, zero B
                bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) on [r, in]
                ta.uniform_(-bound, bound, generator=gen)
            tb = torch.zeros(out_f, r, dtype=dt, device=self.device)
            out[f"{fqn}.lora_a.weight"] = nn.Parameter(ta.to(self.device, dt), requires_grad=r > 0)
            out[f"{fqn}.lora_b.weight"] = nn.Parameter(tb, requires_grad=r > 0)
        return out

    def create_adapter(self, adapter: str, spec: LoraSpec) -> None:
        gen = torch.Generator().manual_seed(
            spec.seed if spec.seed is not None else int(torch.randint(0, 2**62, ()).item())
        )
        params = self._new_tensors(spec, gen)
        trainable = [p for p in params.values() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.adapters[adapter] = _Adapter(spec, params, opt)

    def drop_adapter(self, adapter: str) -> None:
        self.adapters.pop(adapter, None)

    def _adapter(self, adapter: str) -> _Adapter:
        ad = self.adapters.get(adapter)
        if ad is None:
            raise ServiceError(404, f"adapter {adapter} is not loaded")
        return ad

    def _bind(self, model: nn.Module, params: dict, rank: int) -> None:
        """Point every LoRA module at this adapter's tensors (by reference, no copy) and set
        its scale alpha / rank (the converter fixed one rank; adapters here choose theirs)."""
        bind_adapter(model, params)
        for _, m in lora_modules(model):
            m._lora_scaling = self.alpha / rank if rank else 0.0

    # --- training -----------------------------------------------------------------------------

    def _batch(self, data: list[Datum]):
        B, L = len(data), max(d.tokens.size for d in data)
        tokens = torch.zeros(B, L, dtype=torch.long)
        targets = torch.zeros(B, L, dtype=torch.long)
        valid = torch.zeros(B, L, dtype=torch.float32)
        extra: dict[str, torch.Tensor] = {}
        for i, d in enumerate(data):
            n = d.tokens.size
            tokens[i, :n] = torch.from_numpy(d.tokens)
            targets[i, :n] = torch.from_numpy(d.inputs["target_tokens"])
            valid[i, :n] = 1.0
            for k, v in d.inputs.items():
                if k == "target_tokens":
                    continue
                extra.setdefault(k, torch.zeros(B, L, dtype=torch.float32))[i, :n] = (
                    torch.from_numpy(v)
                )
        dev = self.device
        return (
            tokens.to(dev),
            targets.to(dev),
            valid.to(dev),
            {k: v.to(dev) for k, v in extra.items()},
        )

    def forward_backward(
        self,
        adapter: str,
        data: list[Datum],
        loss_fn: str,
        loss_config: dict[str, float | str],
        *,
        forward_only: bool,
    ) -> FwdBwdResult:
        ad = self._adapter(adapter)
        cfg = _loss_config(loss_fn, loss_config)
        self._bind(self.model, ad.params, ad.spec.rank)
        tokens, targets, valid, extra = self._batch(data)
        with torch.set_grad_enabled(not forward_only):
            logits = forward_logits(self.model, tokens).float()
            logp = F.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            if loss_fn == "cross_entropy":
                batch = LossBatch(mask=extra.get("weights", valid) * valid)
            else:
                batch = LossBatch(
                    mask=valid,
                    advantages=extra["advantages"],
                    sampling_logprobs=extra["logprobs"],
                    ratio_mask=extra.get("sequence_ratio_mask"),
                )
            loss = BUILTIN_LOSSES[loss_fn](logp, batch, cfg)
            if not forward_only:
                loss.backward()
        lp = logp.detach().cpu().numpy()
        outputs = [
            {"logprobs": lp[i, : d.tokens.size].astype(np.float32)} for i, d in enumerate(data)
        ]
        return FwdBwdResult(outputs, {"loss:sum": float(loss.detach())})

    def optim_step(self, adapter: str, params: AdamParams) -> dict[str, float]:
        ad = self._adapter(adapter)
        ps = ad.trainable()
        norm = 0.0
        if params.grad_clip_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(ps, params.grad_clip_norm))
        for g in ad.opt.param_groups:
            g.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        ad.opt.step()
        ad.opt.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm} if params.grad_clip_norm > 0 else {}

    # --- checkpoints --------------------------------------------------------------------------

    def _write_adapter(self, ad: _Adapter, folder: Path) -> None:
        save_file(ad.state(), str(folder / "adapter_model.safetensors"))
        targets = sorted({_category(k) for k, p in ad.params.items() if p.requires_grad})
        (folder / "adapter_config.json").write_text(
            json.dumps({"r": ad.spec.rank, "lora_alpha": self.alpha, "targets": targets}, indent=1)
        )

    def save_state(self, adapter: str, folder: Path) -> None:
        ad = self._adapter(adapter)
        self._write_adapter(ad, folder)
        torch.save(ad.opt.state_dict(), folder / "optimizer.pt")

    def _read_adapter(self, folder: Path) -> dict[str, torch.Tensor]:
        return load_file(str(folder / "adapter_model.safetensors"), device=str(self.device))

    def load_state(self, adapter: str, folder: Path, *, optimizer: bool) -> None:
        ad = self._adapter(adapter)
        state = self._read_adapter(folder)
        with torch.no_grad():
            for k, p in ad.params.items():
                if not p.requires_grad:
                    continue
                if k not in state or state[k].shape != p.shape:
                    raise bad_request("path", f"checkpoint lacks a matching {k}")
                p.copy_(state[k])
        if optimizer:
            ad.opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
        else:
            ad.opt.state.clear()

    def save_sampler_weights(self, adapter: str, folder: Path) -> None:
        self._write_adapter(self._adapter(adapter), folder)

    # --- sampling -----------------------------------------------------------------------------

    def _store_sampler(self, rank: int, params: dict[str, torch.Tensor]) -> str:
        handle = f"sampler-{next(self._ids)}"
        self._samplers[handle] = _Snapshot(rank, params)
        return handle

    def snapshot(self, adapter: str) -> str:
        ad = self._adapter(adapter)
        return self._store_sampler(
            ad.spec.rank, {k: v.detach().clone() for k, v in ad.params.items()}
        )

    def load_sampler(self, folder: Path, spec: LoraSpec) -> str:
        state = self._read_adapter(folder)
        # untargeted modules: the rank-0 pair of a fresh adapter of this shape
        shape = self._new_tensors(replace(spec, seed=0), torch.Generator().manual_seed(0))
        for k, p in shape.items():  # a targeted tensor missing is a damaged checkpoint, not 0
            if p.requires_grad and (k not in state or state[k].shape != p.shape):
                raise ServiceError(422, f"sampler weights lack a matching {k}")
        params = {k: state.get(k, p.detach()) for k, p in shape.items()}
        return self._store_sampler(spec.rank, params)

    def drop_sampler(self, handle: str) -> None:
        self._samplers.pop(handle, None)

    def _gen(self) -> Generator:
        if self._generator is None:
            tok = self._tokenizer
            decode = None if tok is None else lambda ids: tok.decode(ids, skip_special_tokens=False)
            self._generator = Generator.from_model(self.model, decode=decode)
        return self._generator

    def sample(
        self,
        handle: str | None,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        *,
        prompt_logprobs: bool,
        topk_prompt_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> SampleResult:
        if params.stop_strings and self._tokenizer is None:
            raise bad_request("sampling_params.stop", "stop strings need the served tokenizer")
        gen = self._gen()
        if handle is None:  # the base model: rank-0 everywhere
            none = LoraSpec(rank=1, train_mlp=False, train_attn=False, train_unembed=False)
            rank, params_ = 0, dict[str, torch.Tensor](self._new_tensors(none, torch.Generator()))
        else:
            snap = self._samplers.get(handle)
            if snap is None:
                raise ServiceError(404, "sampler weights are not loaded")
            rank, params_ = snap.rank, dict(snap.params)
        frozen = {k: nn.Parameter(v.detach(), requires_grad=False) for k, v in params_.items()}
        self._bind(gen.model, frozen, rank)
        gp = GenParams(
            max_tokens=params.max_tokens,
            # temperature 0 means greedy in the SDK; the generator needs > 0: near-greedy.
            temperature=max(params.temperature, 1e-6),
            top_p=params.top_p,
            top_k=params.top_k,
            n=num_samples,
            stop_tokens=(*(params.stop_tokens or ()), *(self.eos_ids if params.stop_eos else ())),
            stop_strings=params.stop_strings,
            seed=params.seed,
        )
        samples = gen.generate([prompt], gp)
        seqs = [
            SampledSeq(
                np.asarray(s.tokens, dtype=np.int32),
                np.asarray(s.logprobs, dtype=np.float32),
                "stop" if s.finish_reason == "stop" else "length",
            )
            for s in samples
        ]
        if not (prompt_logprobs or topk_prompt_logprobs):
            return SampleResult(seqs)
        lp, top_ids, top_lp = gen.prompt_scores(prompt, topk_prompt_logprobs)
        skip = 1 + (len(prompt) - 1 - prompt_logprobs_last_n if prompt_logprobs_last_n else 0)
        plp = np.concatenate([[np.nan], lp]).astype(np.float32)
        plp[:skip] = np.nan  # positions not scored
        topk = None
        if topk_prompt_logprobs:
            ids = np.zeros((len(prompt), topk_prompt_logprobs), np.int32)
            lps = np.full((len(prompt), topk_prompt_logprobs), proto.TOPK_EMPTY_LOGPROB, np.float32)
            ids[1:], lps[1:] = top_ids, top_lp
            ids[:skip], lps[:skip] = 0, proto.TOPK_EMPTY_LOGPROB
            topk = (ids, lps)
        return SampleResult(seqs, plp if prompt_logprobs else None, topk)


# Ratio thresholds when a request gives none: Tinker's 0.8 / 1.2 for ppo/cispo/gspo; the
# band outside which stable_reinforce drops a token's gradient is ours (wider: it masks, it
# does not clip).
_DEFAULT_THRESHOLDS = {"stable_reinforce": (0.5, 2.0)}


def _loss_config(loss_fn: str, cfg: dict[str, float | str]) -> LossConfig:
    """Tinker's loss_fn_config (ratio thresholds, e.g. clip_low_threshold=0.8; dro's beta;
    checked by service.wire.check_loss_config) as the RL layer's LossConfig (epsilons),
    summed over tokens as Tinker's losses are."""
    lo, hi = _DEFAULT_THRESHOLDS.get(loss_fn, (0.8, 1.2))
    low = float(cfg.get("clip_low_threshold", lo))
    high = float(cfg.get("clip_high_threshold", hi))
    beta = float(cfg.get("beta", LossConfig.beta))
    return LossConfig(clip_low=1.0 - low, clip_high=high - 1.0, beta=beta, aggregation="sum")
