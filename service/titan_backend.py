"""The backend on torchtitan: one frozen base model, LoRA adapters that take turns on it.

Built as train.py builds a model (torchtitan's registry, `kernels.registry.apply_kernels`,
torchtitan's `LoRAConverter` on every Linear: the base frozen, the recipe's activation
checkpointing); the base is loaded from `checkpoint.load_from` (`posttrain.adapters.load_base`)
or a Hugging Face folder, or initialised from `training.seed`. Each adapter owns its LoRA
tensors (rank, seed, targets: `posttrain.lora.init_adapter`, the one initialisation; an
untargeted module gets an exactly-zero rank-0 pair) and a step engine (runtime.steps:
torchtitan's AdamW container, microbatches under `microbatch_tokens`, the non-finite guard, a
400 that leaves the adapter as it was); its tensors are bound into the shared base by
reference for each operation. Operations run one at a time (the scheduler's worker), so an
adapter's numbers never depend on the others. Losses are `rl.losses`' (sum-aggregated, as
Tinker defines them), sampling `rl.generator.Generator` decoding through the same base (no
copy; `generators = 0`: none). `save_state` writes the adapter as a PEFT LoRA folder
(posttrain.lora: adapter_model.safetensors + adapter_config.json with HF module names, the one
adapter format) and its optimizer state (DCP) beside it; the storage's manifest covers the
folder and is verified on every load. Any plain-LoRA PEFT folder of the architecture loads
(`_read_adapter`). On an MoE base the service's own adapters leave the routed experts frozen;
a folder that also holds routed-expert pairs (`routed_experts_lora.safetensors`, a LoRA SFT
export with target "experts") loads for sampling and into a training client, whose adapter
then trains and saves those pairs too (runtime.moe_experts.bind_adapter).

Several processes (a model resource, service/distributed.py): the base is FSDP2-sharded over
`group` (`shard_base`; a `checkpoint.load_from` base is built on the meta device, sharded,
then loaded sharded), adapters are replicated; each rank trains on its share of a request's
datums (the losses are sums, so the gradients summed over ranks are the request's) and every
rank decodes every sample (the generator gathers one layer at a time). Not done: tensor
parallelism.

With an engine (`tools.serve --sampler vllm`, one process only): `engine` is a
`service.vllm_sampler.EngineSampler` and every sampling client samples through it instead of
the generator: sampler weights (a `save_weights_for_sampler` folder, or a snapshot exported
as one) load into the engine as LoRA adapters, the base model's sampling client samples the
engine's base, and `sample` runs on its caller's thread (the scheduler detaches it,
`detached_sampling`) so concurrent requests of several tenants meet in one engine batch.
Stop strings are cut on this side with the served tokenizer (the generator's rule), prompt
logprobs come from the engine under the same adapter (docs/vllm.md "The service").
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torchtitan.components.loss import IGNORE_INDEX

from parallel.serve import GENERATOR_MAX_ROWS
from posttrain.lora import (
    ROUTED_EXPERTS_WEIGHTS,
    AdapterWeights,
    adapter_from_peft,
    bind_adapter,
    export_peft,
    init_adapter,
    is_expert_key,
    lora_modules,
    read_expert_adapter,
    read_peft,
    write_expert_adapter,
)
from rl.generator import Generator, stop_string_end
from rl.generator import SamplingParams as GenParams
from rl.losses import BUILTIN_LOSSES, LossBatch, LossConfig
from runtime.moe_experts import bind_expert_adapter, expert_adapter_shapes
from runtime.rows import Rows
from runtime.steps import NonFiniteError, StepEngine
from service import deadline, proto
from service.backend import NO_GENERATOR, BaseModelInfo, check_generator_capacity
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


def _has_moments(folder: Path) -> bool:
    """Whether the checkpoint in `folder` holds optimizer state per parameter (DCP metadata)."""
    from runtime.safe_load import SafeFileSystemReader

    md = SafeFileSystemReader(str(folder)).read_metadata()
    return any(k.startswith("optimizer.state.") for k in md.state_dict_metadata)


def _category(fqn: str) -> str:
    if ".attention." in fqn:
        return "attn"
    if ".feed_forward." in fqn or ".moe." in fqn:
        return "mlp"
    return "unembed"


def _targets(spec: LoraSpec, fqn: str) -> bool:
    if ".router." in fqn:  # MoE routers are never adapted (docs/sft.md "LoRA on MoE bases")
        return False
    return {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}[
        _category(fqn)
    ]


@dataclass
class _Adapter:
    spec: LoraSpec
    weights: AdapterWeights  # "<module>.lora_a.weight" [rank, in], ".lora_b" [out, rank]
    engine: StepEngine  # its own torchtitan AdamW container; the client sets the lr

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return self.weights.params


@dataclass
class _Snapshot:
    """Frozen adapter tensors a sampler samples with."""

    rank: int
    params: dict[str, torch.Tensor]


def _apply_ac(model: nn.Module, mode: str) -> None:
    """The recipe's activation checkpointing (torchtitan's policies, block by block) before
    any sharding, as torchtitan orders them; adapter names stay the same
    (posttrain.lora.lora_modules drops the wrapper's name)."""
    if mode == "none":
        return
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    policy = {"selective": SelectiveAC, "full": FullAC}[mode]
    policy.Config().build().apply(model)


def shard_served_base(model: nn.Module, mesh: Any) -> None:
    """FSDP2 over the frozen base, the adapters replicated: posttrain.adapters.shard_base,
    the [[adapters]] jobs' layout (nothing FSDP manages has a gradient: no reduce-scatter)."""
    from posttrain.adapters import shard_base

    shard_base(model, mesh)


def build_lora_model(
    recipe, device: torch.device, served: ServedBase | None = None, mesh: Any = None
) -> tuple[nn.Module, BaseModelInfo]:
    """The recipe's model with every Linear LoRA-converted (placeholder rank 1), initialised
    from training.seed (or loaded), on `device`; FSDP2-sharded over `mesh` when given.

    With a mesh, a `checkpoint.load_from` base is built on the meta device, sharded, and
    loaded shard by shard (no rank ever holds the whole base); a seeded or Hugging Face base
    is built whole first (every rank the same weights), then sharded."""
    from torchtitan.components.lora import LoRAConverter

    from kernels.registry import apply_kernels
    from runtime.build import choose_kernels, recipe_model_spec
    from runtime.moe_experts import convert_experts
    from runtime.platform import Platform

    platform = Platform.detect()
    spec = recipe_model_spec(recipe)
    cfg = apply_kernels(spec.model, choose_kernels(recipe, platform)).model_config
    # Every linear gets a LoRA slot; each client's adapter decides which it trains.
    cfg = LoRAConverter.Config(rank=1, alpha=recipe.lora.alpha).build().convert(cfg)
    # MoE: routed experts frozen (no per-expert adapters in the service), float32 on CPU
    cfg = convert_experts(cfg, compute_dtype="param" if platform.is_cpu else "bfloat16",
                          freeze_base=True)  # fmt: skip
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[recipe.training.dtype]
    sharded_load = mesh is not None and bool(recipe.checkpoint.load_from)
    torch.manual_seed(recipe.training.seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cfg.build()
        _apply_ac(model, recipe.training.activation_checkpoint)
        if sharded_load:
            shard_served_base(model, mesh)
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
    if mesh is not None and not sharded_load:
        shard_served_base(model, mesh)
    vocab = model.tok_embeddings.weight.shape[0]
    info = BaseModelInfo(
        name=served.name if served else f"titanscale/{recipe.job.name}",
        max_context=served.context if served else recipe.training.seq_len,
        vocab_size=int(vocab),
        arch=f"{recipe.model.family}-{recipe.model.flavor}",
        tokenizer_id=served.tokenizer_id if served else None,
        tokenizer_dir=served.tokenizer_dir if served else None,
    )
    return model, info


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """`module`'s own FSDP-sharded weights whole for the block (one all-gather, a collective:
    every rank must enter it in the same order), then sharded again; a no-op otherwise."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def base_shard_sizes(model: nn.Module) -> tuple[int, int, int]:
    """(parameters, bytes) of the frozen base this rank holds (its FSDP shards), and the
    base's total parameters: what `tools.serve` reports per rank."""
    local = nbytes = total = 0
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        t = p.to_local() if hasattr(p, "to_local") else p
        local += t.numel()
        nbytes += t.numel() * t.element_size()
        total += p.numel()
    return local, nbytes, total


def resource_plan(recipe, served: ServedBase | None, resource: Any) -> Any:
    """The `parallel.serve.ResourcePlan` of `resource` on this machine's devices (a GPU's
    memory, or on CPU the host's memory shared by the local processes), priced with the
    attention kernel the backend is built with."""
    from parallel.serve import plan_resource
    from runtime.platform import Platform, device_memory_bytes

    platform = Platform.detect()
    device_bytes, kind = device_memory_bytes(platform)
    return plan_resource(_served_here(recipe, served, platform), resource, device_bytes, kind)


def _served_here(recipe, served: ServedBase | None, platform: Any) -> Any:
    """The recipe's `parallel.serve.ServedModel`, priced with the attention kernel the
    backend is built with on `platform`."""
    from parallel.serve import served_model
    from runtime.build import choose_kernels

    dense = choose_kernels(recipe, platform).attention == "dense"
    return served_model(recipe, served.context if served else None, cpu=dense)


def resource_plans_together(
    recipes: list[Any], served: list[ServedBase], resources: list[Any]
) -> tuple[list[Any], float]:
    """Several bases in one process on this machine's device (`parallel.serve.plan_together`):
    their plans and the device's bytes."""
    from parallel.serve import plan_together
    from runtime.platform import Platform, device_memory_bytes

    platform = Platform.detect()
    device_bytes, kind = device_memory_bytes(platform)
    models = [_served_here(r, s, platform) for r, s in zip(recipes, served, strict=True)]
    return plan_together(models, resources, device_bytes, kind), device_bytes


def local_plan(recipe, served: ServedBase | None = None) -> Any:
    """One device, the default adapters and generator (what a plain TitanLoraBackend gets)."""
    from parallel.serve import Resource

    return resource_plan(
        recipe, served, Resource(microbatch_tokens=recipe.training.microbatch_tokens)
    )


class TitanLoraBackend:
    max_lora_rank = 128

    def __init__(
        self,
        model: nn.Module,
        info: BaseModelInfo,
        *,
        alpha: float,
        devices: int | None = None,
        tokenizer_dir: str | None = None,
        eos_ids: tuple[int, ...] = (),
        microbatch_tokens: int = 2**62,
        group: Any = None,
        generators: int = 1,
        generator_tokens: int = 2**62,
        whole_base_decode: bool = False,
        model_config: Any = None,
        state_dict_adapter: Any = None,
    ):
        """`group`: the process group the base is sharded over (None: one process);
        `generators`: 0 or 1; `generator_tokens`: KV-cache positions the generator may hold
        at once (rows x (prompt + max_tokens) per decode batch)."""
        self.model = model
        # The HF names of saved adapters (PEFT format): the model's config and torchtitan's
        # state-dict adapter for its family (None: adapters cannot be saved or loaded).
        self.model_config = model_config
        self.state_dict_adapter = state_dict_adapter
        self.microbatch_tokens = microbatch_tokens  # per forward/backward (runtime.steps)
        self.info = info
        self.alpha = alpha
        self.group = group
        self.world = torch.distributed.get_world_size(group) if group is not None else 1
        self.rank = torch.distributed.get_rank(group) if group is not None else 0
        # Billing: every device of the resource is held for every operation.
        self.devices = devices if devices is not None else self.world
        self.generators = generators
        self.generator_tokens = generator_tokens
        # Sharded base: gather it whole once per sample request (the plan found room) rather
        # than one layer per decode step; `_whole` is set while it is gathered.
        self.whole_base_decode = whole_base_decode and group is not None
        self._whole = False
        self.device = next(model.parameters()).device
        for p in model.parameters():
            p.requires_grad_(False)  # the base is frozen; adapters bring their own tensors
        self.adapters: dict[str, _Adapter] = {}
        self._samplers: dict[str, _Snapshot] = {}
        self._ids = itertools.count()
        self._generator: Generator | None = None
        self.eos_ids = eos_ids  # what stop=None stops at
        # `tools.serve --sampler vllm`: a service.vllm_sampler.EngineSampler (start_engine)
        self.engine: Any = None
        self._tokenizer = None
        if tokenizer_dir:  # server-side decoding of stop strings
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))

    @classmethod
    def from_recipe(
        cls,
        recipe,
        served: ServedBase | None = None,
        *,
        mesh: Any = None,
        plan: Any = None,
    ) -> TitanLoraBackend:
        """`mesh`: a 1-D mesh over the resource's processes (None: one process); `plan`: the
        resource's `parallel.serve.ResourcePlan` (budgets and generator capacity; None: the
        plan of one device of this machine)."""
        from runtime.platform import Platform

        platform = Platform.detect()
        if platform.is_cpu:
            device = torch.device("cpu")
            # torchtitan builds attention masks with a torch.compile'd create_block_mask,
            # which recompiles for every new sequence length (~30 s each on CPU). The CPU
            # attention backend (dense) only evaluates the mask's mask_mod, so eager is exact
            # and cheap. torch.compile reads this when torchtitan's attention module is
            # imported, which build_lora_model does next (the first torchtitan import of
            # `tools.serve`).
            os.environ["TORCHDYNAMO_DISABLE"] = "1"
        else:
            from core.launch_env import launch_env

            device = torch.device("cuda", launch_env().local_rank)
        if plan is None:
            plan = local_plan(recipe, served)
        model, info = build_lora_model(recipe, device, served, mesh)
        from runtime.build import recipe_model_spec

        spec = recipe_model_spec(recipe)
        sda = spec.state_dict_adapter(spec.model, None) if spec.state_dict_adapter else None
        kw: dict[str, Any] = {"model_config": spec.model, "state_dict_adapter": sda}
        if served is not None:
            kw |= {"tokenizer_dir": served.tokenizer_dir, "eos_ids": served.eos_ids}
        return cls(
            model,
            info,
            alpha=recipe.lora.alpha,
            microbatch_tokens=plan.memory.microbatch_tokens,
            group=mesh.get_group() if mesh is not None else None,
            generators=plan.resource.generators,
            generator_tokens=plan.memory.generator_tokens,
            whole_base_decode=plan.memory.whole_base_decode,
            **kw,
        )

    def base_model(self) -> BaseModelInfo:
        return self.info

    # --- adapters -----------------------------------------------------------------------------

    def _weights(self, spec: LoraSpec, seed: int) -> AdapterWeights:
        return init_adapter(self.model, seed, rank=spec.rank, targets=lambda n: _targets(spec, n))

    def adapter_bytes(self, spec: LoraSpec) -> int:
        """The bytes of one adapter's weights (service/resident.py prices a trained model at
        4 such copies, a sampler snapshot at one)."""
        total = 0
        for name, m in lora_modules(self.model):
            if _targets(spec, name):
                a, b = m.lora_a.weight, m.lora_b.weight
                total += spec.rank * (a.shape[1] + b.shape[0]) * a.element_size()
        return total

    def create_adapter(self, adapter: str, spec: LoraSpec) -> None:
        seed = spec.seed if spec.seed is not None else int(torch.randint(0, 2**62, ()).item())
        weights = self._weights(spec, seed)
        if not any(p.requires_grad for p in weights.parameters()):
            raise bad_request("lora_config", "an adapter must train mlp, attn or unembed")
        self.adapters[adapter] = _Adapter(spec, weights, self._engine(adapter, weights))

    def _engine(self, adapter: str, weights: AdapterWeights) -> StepEngine:
        from torchtitan.components.optimizer import default_adamw

        # Hyper-parameters are the client's, set at each optim_step (Tinker's AdamParams).
        opt = default_adamw(lr=1e-4, eps=1e-12, weight_decay=0.0).build(model_parts=[weights])
        return StepEngine(
            self.model,
            opt,
            microbatch_tokens=self.microbatch_tokens,
            named_params=[(n, p) for n, p in weights.named_parameters() if p.requires_grad],
            # A resource: replicated adapters, gradients summed over the ranks' datums; the
            # same microbatch count on every rank (FSDP's gathers are collectives).
            replicated_group=self.group,
            dp_group=self.group,
            label=f"adapter {adapter}",
            guard_weights=True,  # a step that makes the adapter non-finite is undone (400)
        )

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
        # MoE: the adapter's routed-expert pairs, if it has any (else the base experts)
        bind_expert_adapter(model, params, self.alpha / rank if rank else 0.0)

    # --- training -----------------------------------------------------------------------------

    def _batch(self, data: list[Datum]) -> tuple[Rows, torch.Tensor, dict[str, torch.Tensor]]:
        B, L = len(data), max(d.tokens.size for d in data)
        tokens = torch.zeros(B, L, dtype=torch.long)
        targets = torch.full((B, L), IGNORE_INDEX, dtype=torch.long)
        extra: dict[str, torch.Tensor] = {}
        for i, d in enumerate(data):
            n = d.tokens.size
            tokens[i, :n] = torch.from_numpy(d.tokens)
            targets[i, :n] = torch.from_numpy(d.inputs["target_tokens"])
            for k, v in d.inputs.items():
                if k != "target_tokens":
                    x = extra.setdefault(k, torch.zeros(B, L, dtype=torch.float32))
                    x[i, :n] = torch.from_numpy(v)
        dev = self.device
        rows = Rows(tokens.to(dev), targets.to(dev), None, [d.tokens.size for d in data])
        valid = (targets != IGNORE_INDEX).float().to(dev)  # the datums' own positions
        return rows, valid, {k: v.to(dev) for k, v in extra.items()}

    def forward_backward(
        self,
        adapter: str,
        data: list[Datum],
        loss_fn: str,
        loss_config: dict[str, float | str],
        *,
        forward_only: bool,
        contribute: bool = True,
    ) -> FwdBwdResult:
        """`contribute=False`: run `data` with a zero mask and return no outputs (a rank of a
        resource with no datum of this request still runs the collectives the others run).
        With a group, the loss returned (and checked for NaN) is the sum over every rank's
        datums; each rank's gradient is its own datums' (summed by optim_step)."""
        ad = self._adapter(adapter)
        cfg = _loss_config(loss_fn, loss_config)
        self._bind(self.model, ad.params, ad.spec.rank)
        rows, valid, extra = self._batch(data)
        if not contribute:
            valid = valid * 0.0
        if loss_fn == "cross_entropy":
            batch = LossBatch(mask=extra.get("weights", valid) * valid)
        else:
            batch = LossBatch(
                mask=valid,
                advantages=extra["advantages"],
                sampling_logprobs=extra["logprobs"],
                ratio_mask=extra.get("sequence_ratio_mask"),
            )

        def loss_of(lp: torch.Tensor) -> torch.Tensor:
            own = BUILTIN_LOSSES[loss_fn](lp, batch, cfg)
            if self.group is None:
                return own
            # Value: the whole request's loss (every rank checks the same number, so a NaN
            # is refused on all of them before any backward); gradient: this rank's own.
            total = own.detach().clone()
            torch.distributed.all_reduce(total, group=self.group)
            return own + (total - own.detach())

        try:
            loss, logp = ad.engine.forward_backward(rows, loss_of, backward=not forward_only)
        except NonFiniteError as e:
            raise bad_request("loss_fn_inputs", e.detail) from None
        if not contribute:
            return FwdBwdResult([], {"loss:sum": loss})
        lp = logp.detach().cpu().numpy()
        outputs = [
            {"logprobs": lp[i, : d.tokens.size].astype(np.float32)} for i, d in enumerate(data)
        ]
        return FwdBwdResult(outputs, {"loss:sum": loss})

    def optim_step(self, adapter: str, params: AdamParams) -> dict[str, float]:
        ad = self._adapter(adapter)
        for opt in ad.engine.optimizers:
            for g in opt.param_groups:
                g.update(
                    lr=params.learning_rate,
                    betas=(params.beta1, params.beta2),
                    eps=params.eps,
                    weight_decay=params.weight_decay,
                )
        ad.engine.max_norm = params.grad_clip_norm  # 0: no clipping (the norm is still checked)
        try:
            norm = ad.engine.optim_step()
        except NonFiniteError as e:
            raise bad_request("optim_step", e.detail) from None
        return {"grad_norm:mean": norm} if params.grad_clip_norm > 0 else {}

    # --- checkpoints --------------------------------------------------------------------------

    def _peft_layout(self) -> tuple[Any, Any]:
        if self.model_config is None or self.state_dict_adapter is None:
            raise ServiceError(501, "this model family has no Hugging Face names for adapters")
        return self.model_config, self.state_dict_adapter

    def _write_adapter(self, ad: _Adapter, folder: Path) -> None:
        """The adapter as a PEFT LoRA folder (posttrain.lora.export_peft: HF module names,
        q/k/v split from the fused wqkv), loadable by peft and by `_read_adapter`."""
        cfg, sda = self._peft_layout()
        state = {k: p.detach().cpu() for k, p in ad.params.items() if p.requires_grad}
        linear = {k: v for k, v in state.items() if not is_expert_key(k)}
        export_peft(str(folder), model_config=cfg, adapter=linear, state_dict_adapter=sda,
                    rank=ad.spec.rank, alpha=self.alpha, base_model=self.info.name)  # fmt: skip
        experts = {k: v for k, v in state.items() if is_expert_key(k)}
        if experts:  # beside the PEFT files, as a LoRA SFT export writes them
            write_expert_adapter(str(folder), experts)

    def save_state(self, adapter: str, folder: Path) -> None:
        from runtime.checkpoint import save_states

        ad = self._adapter(adapter)
        self._write_adapter(ad, folder)
        # DCP files and a manifest (sizes, CRC32s) over the whole folder, weights included;
        # the storage renames the folder into place.
        save_states(str(folder), {"optimizer": ad.engine.optimizers}, in_place=True)

    def _read_adapter(
        self, folder: Path, like: dict[str, torch.Tensor], rank: int
    ) -> dict[str, torch.Tensor]:
        """A PEFT LoRA folder (ours, an [[adapters]] job's export, any plain-LoRA PEFT folder
        of this architecture) in our names, shaped like `like`; its lora_alpha is honoured
        by scaling B to this service's alpha (the same alpha/r * B A). With
        `routed_experts_lora.safetensors` beside it (an MoE base), the routed-expert pairs too
        (`<module>.lora_{a,b}{1,2,3}`, at `rank`). 422 naming the file if it does not fit."""
        cfg, sda = self._peft_layout()
        try:
            tensors, peft_cfg = read_peft(str(folder))
            linear = {k: v for k, v in like.items() if not is_expert_key(k)}
            state = adapter_from_peft(cfg, tensors, sda, linear)
            if (folder / ROUTED_EXPERTS_WEIGHTS).exists():
                shapes = expert_adapter_shapes(self.model, rank)
                state |= read_expert_adapter(str(folder), shapes)
        except ValueError as e:
            raise ServiceError(422, f"the adapter does not load: {e}") from None
        ratio = float(peft_cfg["lora_alpha"]) / self.alpha
        if ratio != 1.0:
            # B of a Linear (".lora_b.weight") and of the routed experts (".lora_b1")
            state = {k: v * ratio if ".lora_b" in k else v for k, v in state.items()}
        return {k: v.to(self.device) for k, v in state.items()}

    def load_state(self, adapter: str, folder: Path, *, optimizer: bool) -> None:
        from runtime.checkpoint import CheckpointError, load_states, verify_checkpoint

        ad = self._adapter(adapter)
        # The storage verified the files against the manifest (sizes, CRC32s); a folder
        # with optimizer state also gets DCP's checks (metadata readable, files long enough).
        # A PEFT folder imported without optimizer state has none (`_has_moments`: False).
        dcp_state = (folder / ".metadata").exists()
        problems = verify_checkpoint(str(folder), checksums=False) if dcp_state else []
        if problems:  # names files inside the checkpoint only, never the server's path
            raise bad_request("path", f"the checkpoint is damaged: {'; '.join(problems)}")
        like = {k: p.detach() for k, p in ad.params.items()}
        state = self._read_adapter(folder, like, ad.spec.rank)
        experts = {k: v for k, v in state.items() if is_expert_key(k)}
        if experts.keys() != {k for k in ad.params if is_expert_key(k)}:
            # The folder brings routed-expert pairs (or this adapter's had some and it does
            # not): the adapter takes the folder's set, trained from here, with a new
            # optimizer over its tensors (the state's moments load below).
            own = {k: p.detach() for k, p in ad.params.items() if not is_expert_key(k)}
            ad.weights = AdapterWeights({**own, **{k: v.clone() for k, v in experts.items()}})
            ad.engine = self._engine(adapter, ad.weights)
        with torch.no_grad():
            for k, p in ad.params.items():
                if p.requires_grad:
                    p.copy_(state[k])
        opts = ad.engine.optimizers
        if not optimizer or not dcp_state or not _has_moments(folder):
            # A state saved before its first optim_step has no AdamW moments (torch does not
            # initialise them while gradients are pending): it resumes as "no moments yet".
            for opt in opts:
                opt.state.clear()
            return
        try:
            load_states(str(folder), {"optimizer": opts}, checksums=False)  # verified above
        except CheckpointError:
            raise bad_request("path", "the optimizer state does not load") from None

    def save_sampler_weights(self, adapter: str, folder: Path) -> None:
        self._write_adapter(self._adapter(adapter), folder)

    # --- sampling -----------------------------------------------------------------------------

    def _store_sampler(self, rank: int, params: dict[str, torch.Tensor]) -> str:
        handle = f"sampler-{next(self._ids)}"
        self._samplers[handle] = _Snapshot(rank, params)
        return handle

    def snapshot(self, adapter: str) -> str:
        ad = self._adapter(adapter)
        if self.engine is not None:  # exported as a PEFT folder, loaded into the engine
            import tempfile

            with tempfile.TemporaryDirectory(prefix="titanscale-snapshot-") as tmp:
                self._write_adapter(ad, Path(tmp))
                return self._engine_adapter(Path(tmp))
        return self._store_sampler(
            ad.spec.rank, {k: v.detach().clone() for k, v in ad.params.items()}
        )

    def load_sampler(self, folder: Path, spec: LoraSpec) -> str:
        # Shaped as a fresh adapter of this spec (untargeted modules: rank-0 pairs); the
        # storage verified the files against their manifest before this (a damaged one is
        # a 422 there, never the base model).
        shape = {k: p.detach() for k, p in self._weights(spec, 0).params.items()}
        state = self._read_adapter(folder, shape, spec.rank)  # 422 if it does not fit
        if self.engine is not None:
            if (folder / ROUTED_EXPERTS_WEIGHTS).exists():  # vLLM's LoRA has no expert pairs
                raise ServiceError(
                    422, "routed-expert adapters are not served by the vLLM engine (--sampler)"
                )
            return self._engine_adapter(folder)
        return self._store_sampler(spec.rank, state)

    def _engine_adapter(self, folder: Path) -> str:
        handle = f"sampler-{next(self._ids)}"
        self.engine.add_adapter(handle, str(folder))
        return handle

    def drop_sampler(self, handle: str) -> None:
        if self.engine is not None:
            self.engine.drop_adapter(handle)
        self._samplers.pop(handle, None)

    @property
    def detached_sampling(self) -> bool:
        """Whether `sample` may run off the scheduler's worker (it does not touch the model)."""
        return self.engine is not None

    def check_sample(
        self, params: SamplingParams, *, prompt_logprobs: bool, topk_prompt_logprobs: int
    ) -> None:
        """What this backend cannot sample as asked: a 400 naming the field (the service
        calls it before queuing). With the engine: stop strings without the served tokenizer
        (as the generator's own `sample` refuses them)."""
        if self.engine is not None and params.stop_strings and self._tokenizer is None:
            raise bad_request("sampling_params.stop", "stop strings need the served tokenizer")

    def _engine_sample(
        self,
        handle: str | None,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        *,
        prompt_logprobs: bool,
        topk_prompt_logprobs: int,
        prompt_logprobs_last_n: int | None,
    ) -> SampleResult:
        """`sample` through the vLLM engine, with the generator's semantics. Stop strings:
        the engine (no tokenizer) samples to max_tokens or a stop token, and each sample is
        cut where the generator's rule (rl.generator.stop_string_end, the served tokenizer's
        decode) would have stopped it: the same tokens and logprobs it would have given
        stopping there, at the cost of the tokens past the stop. Prompt logprobs: vLLM's
        prompt_logprobs under the same adapter in the same engine call."""
        self.check_sample(params, prompt_logprobs=prompt_logprobs,
                          topk_prompt_logprobs=topk_prompt_logprobs)  # fmt: skip
        # Greedy below vLLM's 1e-5: the engine's argmax; its logprobs would be of the
        # temperature-1 distribution, the generator's (temperature 1e-6) are 0 (a point
        # mass): returned as 0 so both samplers give the same numbers.
        greedy = params.temperature < 1e-5
        gp = GenParams(
            max_tokens=params.max_tokens,
            temperature=max(params.temperature, 1e-6),  # GenParams needs > 0
            top_p=params.top_p,
            top_k=params.top_k,
            n=num_samples,
            stop_tokens=(*(params.stop_tokens or ()), *(self.eos_ids if params.stop_eos else ())),
            seed=params.seed,
        )
        scored = prompt_logprobs or topk_prompt_logprobs > 0
        out = self.engine.sample(handle, prompt, gp, ignore_eos=True,
                                 prompt_logprobs=topk_prompt_logprobs if scored else None)  # fmt: skip
        tok = self._tokenizer

        def decode(ids: list[int]) -> str:
            assert tok is not None  # check_sample refused stop strings without it
            return tok.decode(ids, skip_special_tokens=False)

        seqs = []
        for s in out:
            toks, lps, finish = s["tokens"], s["logprobs"], s["finish"]
            if params.stop_strings:
                end = stop_string_end(toks, tuple(params.stop_strings), decode)
                if end is not None:
                    toks, lps, finish = toks[:end], lps[:end], "stop"
            seqs.append(
                SampledSeq(
                    np.asarray(toks, dtype=np.int32),
                    np.zeros(len(toks), np.float32) if greedy else np.asarray(lps, np.float32),
                    "stop" if finish == "stop" else "length",
                )
            )
        if not scored:
            return SampleResult(seqs)
        top = out[0]["prompt_top"]
        k = topk_prompt_logprobs
        ids = np.asarray([t[0] for t in top], np.int32).reshape(len(prompt) - 1, k)
        vals = np.asarray([t[1] for t in top], np.float32).reshape(len(prompt) - 1, k)
        return _prompt_result(SampleResult(seqs), len(prompt),
                              np.asarray(out[0]["prompt"], np.float32), ids, vals,
                              prompt_logprobs=prompt_logprobs, topk=k,
                              last_n=prompt_logprobs_last_n)  # fmt: skip

    def _gen(self) -> Generator:
        if not self.generators:
            raise ServiceError(400, NO_GENERATOR)
        if self._generator is None:
            tok = self._tokenizer
            decode = None if tok is None else lambda ids: tok.decode(ids, skip_special_tokens=False)
            # The generator decodes through the trainer's own base: no copy, no transfer (a
            # snapshot's adapter tensors are bound into it by reference for each sample).
            self._generator = Generator(
                self.model, decode=decode, shared=True, gather=self._gather_layer
            )
            if self.group is None:  # a resource's ranks share --op-timeout instead
                self._generator.on_token = deadline.check
        return self._generator

    def _gather_layer(self, module: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._whole else gathered(module)

    @contextlib.contextmanager
    def _decode_weights(self) -> Iterator[None]:
        """The whole base gathered for one sample request (every FSDP unit, in module order:
        the same collectives on every rank), or nothing (gathered per layer and step)."""
        from torch.distributed.fsdp import FSDPModule

        if not self.whole_base_decode:
            yield
            return
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in units:
            m.unshard()
        self._whole = True
        try:
            yield
        finally:
            self._whole = False
            for m in units:
                m.reshard()

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
        if self.engine is not None:
            return self._engine_sample(handle, prompt, num_samples, params,
                                       prompt_logprobs=prompt_logprobs,
                                       topk_prompt_logprobs=topk_prompt_logprobs,
                                       prompt_logprobs_last_n=prompt_logprobs_last_n)  # fmt: skip
        if params.stop_strings and self._tokenizer is None:
            raise bad_request("sampling_params.stop", "stop strings need the served tokenizer")
        gen = self._gen()
        total = len(prompt) + params.max_tokens
        check_generator_capacity(total, self.generator_tokens)
        # Decode as many rows at once as the capacity holds (each prompt + max_tokens).
        gen.max_batch = max(1, min(GENERATOR_MAX_ROWS, self.generator_tokens // total))
        if handle is None:  # the base model: rank-0 everywhere
            none = LoraSpec(rank=1, train_mlp=False, train_attn=False, train_unembed=False)
            rank, params_ = 0, dict[str, torch.Tensor](self._weights(none, 0).params)
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
        scored = prompt_logprobs or topk_prompt_logprobs > 0
        with self._decode_weights():
            samples = gen.generate([prompt], gp)
            scores = gen.prompt_scores(prompt, topk_prompt_logprobs) if scored else None
        seqs = [
            SampledSeq(
                np.asarray(s.tokens, dtype=np.int32),
                np.asarray(s.logprobs, dtype=np.float32),
                "stop" if s.finish_reason == "stop" else "length",
            )
            for s in samples
        ]
        if scores is None:
            return SampleResult(seqs)
        lp, top_ids, top_lp = scores
        return _prompt_result(SampleResult(seqs), len(prompt), lp, top_ids, top_lp,
                              prompt_logprobs=prompt_logprobs, topk=topk_prompt_logprobs,
                              last_n=prompt_logprobs_last_n)  # fmt: skip


def _prompt_result(
    result: SampleResult,
    P: int,
    lp: np.ndarray,
    top_ids: np.ndarray | None,
    top_lp: np.ndarray | None,
    *,
    prompt_logprobs: bool,
    topk: int,
    last_n: int | None,
) -> SampleResult:
    """A prompt's scores ([P-1] logprobs of prompt[1:], [P-1, k] top ids and logprobs) as
    the wire's fields, one home for both samplers: position 0 (and, with last_n, every
    position before the last n) not scored: NaN, top-k ids 0 and TOPK_EMPTY_LOGPROB."""
    skip = 1 + (P - 1 - last_n if last_n else 0)
    plp = np.concatenate([[np.nan], lp]).astype(np.float32)
    plp[:skip] = np.nan  # positions not scored
    top = None
    if topk:
        assert top_ids is not None and top_lp is not None
        ids = np.zeros((P, topk), np.int32)
        lps = np.full((P, topk), proto.TOPK_EMPTY_LOGPROB, np.float32)
        ids[1:], lps[1:] = top_ids, top_lp
        ids[:skip], lps[:skip] = 0, proto.TOPK_EMPTY_LOGPROB
        top = (ids, lps)
    return SampleResult(result.sequences, plp if prompt_logprobs else None, top)


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
