"""LoRA on routed experts (runtime.moe_experts): the grouped-GEMM adapter math against an
independent per-expert loop in float64, a fresh adapter leaving the model unchanged, and a
few optimizer steps on a tiny torchtitan qwen3 MoE that train only adapter parameters (the
experts' base weights and everything else bit-identical) while the loss falls; the routed
experts' side file of an export (routed_experts_lora.safetensors) read back by the service
against the exporting model's logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.lora import base_state, expert_adapter_state, fold_expert_adapters
from runtime.logprobs import forward_logits
from runtime.moe_experts import LoRAGroupedExperts, expert_lora_modules
from tests.helpers.tiny_llama import tiny_qwen3_moe


def _experts(rank: int) -> LoRAGroupedExperts:
    cfg = LoRAGroupedExperts.Config(
        dim=16, hidden_dim=24, num_experts=4, rank=rank, alpha=4.0, compute_dtype="param"
    )
    torch.manual_seed(0)
    m = cfg.build()
    with torch.no_grad():
        for p in m.parameters():  # every tensor random, B included (a trained adapter)
            p.normal_(0, 0.3)
    return m


def test_grouped_lora_equals_per_expert_loop():
    m = _experts(8)
    counts = torch.tensor([3, 0, 5, 2])  # an expert with no tokens included
    x = torch.randn(int(counts.sum()), 16)
    out = m(x, counts).double()
    s = 4.0 / 8
    ref, lo = [], 0
    for e, n in enumerate(counts.tolist()):  # the reference: one expert at a time, float64
        xe = x[lo : lo + n].double()
        lo += n

        def proj(inp, w, a, b, e=e):
            return inp @ w[e].double().T + s * (inp @ a[e].double().T) @ b[e].double().T

        h = F.silu(proj(xe, m.w1_EFD, m.lora_a1, m.lora_b1)) * proj(
            xe, m.w3_EFD, m.lora_a3, m.lora_b3
        )
        ref.append(proj(h, m.w2_EDF, m.lora_a2, m.lora_b2))
    assert torch.allclose(out, torch.cat(ref), atol=1e-5, rtol=1e-5)
    # and the adapter matters: without it the output differs
    assert not torch.allclose(_experts(0)(x, counts).double(), out, atol=1e-3)


def test_expert_lora_trains_only_adapters():
    base = tiny_qwen3_moe(2, rank=0)
    model = tiny_qwen3_moe(2, rank=8)
    model.load_state_dict(base.state_dict(), strict=False)  # the same base weights
    x = torch.randint(0, 2048, (2, 12))
    inputs, targets = x[:, :-1], x[:, 1:]
    with torch.no_grad():  # A random, B zero: a fresh adapter leaves the output as it was
        assert torch.allclose(forward_logits(model, inputs), forward_logits(base, inputs))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert len(expert_lora_modules(model)) == 2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = F.cross_entropy(forward_logits(model, inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses
    after = model.state_dict()
    for k, v in before.items():
        if ".lora_" in k:
            continue
        assert torch.equal(v, after[k]), k  # bit-identical base, routed experts included
    assert not torch.equal(
        before["layers.0.moe.routed_experts.inner_experts.lora_b2"],
        after["layers.0.moe.routed_experts.inner_experts.lora_b2"],
    )
    # The merged export's fold (W_e + alpha/r B_e A_e, torchtitan names) gives the adapted
    # model's logits on the adapter-free model (attention adapters absent here: rank 8 only
    # on the experts, no Linear targets).
    folded = fold_expert_adapters(base_state(model), expert_adapter_state(model), 16.0 / 8)
    base.load_state_dict(folded, strict=False)
    with torch.no_grad():
        assert torch.allclose(forward_logits(base, inputs), forward_logits(model, inputs),
                              atol=1e-4)  # fmt: skip


def _served_and_exporter():
    """The service's backend on sft_moe_debug's base (routed experts without pairs of their
    own) and train.py's model of the same recipe (LoRA on wqkv, wo and rank-8 pairs on every
    routed expert) on the same base weights, every adapter tensor random (a trained adapter)."""
    from kernels.registry import apply_kernels
    from recipe.loader import load_recipe
    from runtime.build import choose_kernels, lora_converter, post_train_experts, recipe_model_spec
    from runtime.platform import Platform
    from service.titan_backend import TitanLoraBackend, build_lora_model

    r = load_recipe("recipes/sft_moe_debug.toml", ["training.seq_len=64"])
    model, info = build_lora_model(r, torch.device("cpu"))
    spec = recipe_model_spec(r)
    sda = spec.state_dict_adapter(spec.model, None)
    served = TitanLoraBackend(model, info, alpha=r.lora.alpha, model_config=spec.model,
                              state_dict_adapter=sda)  # fmt: skip
    cfg = apply_kernels(recipe_model_spec(r).model, choose_kernels(r, Platform.detect()))
    cfg = post_train_experts(r, lora_converter(r).build().convert(cfg.model_config), cpu=True)
    exporter = cfg.build()
    missing, _ = exporter.load_state_dict(base_state(model), strict=False)
    assert missing and all(".lora_" in k for k in missing)
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in exporter.named_parameters():
            if ".lora_" in n:
                p.normal_(0, 0.05)
    return served, exporter, spec, sda, r


def test_routed_expert_file_loads_in_the_service(tmp_path):
    """An export with routed_experts_lora.safetensors beside the PEFT files, read back by
    the service as a sampler and into a training client: the exporting model's logits
    within 1e-5 in float32; the client saves the pairs again; a damaged or mismatched file
    is a 422 naming the file."""
    import shutil

    import pytest
    from safetensors.torch import load_file, save_file

    from posttrain.lora import (
        ROUTED_EXPERTS_WEIGHTS,
        adapter_state,
        export_peft,
        write_expert_adapter,
    )
    from service.errors import ServiceError
    from service.types import LoraSpec

    served, exporter, spec, sda, r = _served_and_exporter()
    folder = tmp_path / "export"
    export_peft(str(folder), model_config=spec.model, adapter=adapter_state(exporter),
                state_dict_adapter=sda, rank=r.lora.rank, alpha=r.lora.alpha)  # fmt: skip
    write_expert_adapter(str(folder), expert_adapter_state(exporter))
    x = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = forward_logits(exporter, x)
        base = forward_logits(served.model, x)
    assert float((ref - base).abs().max()) > 1e-3  # the adapter matters
    lora = LoraSpec(rank=r.lora.rank, train_mlp=False, train_unembed=False)

    def served_logits(params) -> torch.Tensor:
        frozen = {k: torch.nn.Parameter(v.detach(), requires_grad=False) for k, v in params.items()}
        served._bind(served.model, frozen, lora.rank)  # as TitanLoraBackend.sample binds
        with torch.no_grad():
            return forward_logits(served.model, x)

    handle = served.load_sampler(folder, lora)
    assert float((served_logits(served._samplers[handle].params) - ref).abs().max()) < 1e-5
    served.create_adapter("a", lora)
    served.load_state("a", folder, optimizer=False)
    params = served.adapters["a"].params
    assert float((served_logits(params) - ref).abs().max()) < 1e-5
    # The client trains the routed-expert pairs it loaded: one step moves them.
    import numpy as np

    from service.types import AdamParams, Datum

    key_b1 = next(n for n in params if n.endswith(".lora_b1"))
    b1 = params[key_b1].detach().clone()
    seq = x[0].numpy()
    datum = Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(len(seq) - 1, "f4")})
    served.forward_backward("a", [datum], "cross_entropy", {}, forward_only=False)
    served.optim_step("a", AdamParams(learning_rate=1e-3))
    params = served.adapters["a"].params
    assert params[key_b1].requires_grad and not torch.equal(params[key_b1], b1)
    served.load_state("a", folder, optimizer=False)  # back to the export's pairs
    params = served.adapters["a"].params
    served.save_sampler_weights("a", tmp_path / "saved")
    again = load_file(tmp_path / "saved" / ROUTED_EXPERTS_WEIGHTS)
    for k, v in expert_adapter_state(exporter).items():
        assert torch.equal(again[k], v), k
    # Damaged (cut short) and mismatched (another expert count): one line naming the file.
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    data = (folder / ROUTED_EXPERTS_WEIGHTS).read_bytes()
    (bad / ROUTED_EXPERTS_WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(ServiceError, match=f"{ROUTED_EXPERTS_WEIGHTS} is unreadable") as e:
        served.load_sampler(bad, lora)
    assert e.value.status == 422 and "\n" not in str(e.value)
    pairs = load_file(folder / ROUTED_EXPERTS_WEIGHTS)
    key = next(k for k in pairs if k.endswith("lora_a1"))
    save_file({**pairs, key: pairs[key][:-1].contiguous()}, bad / ROUTED_EXPERTS_WEIGHTS)
    with pytest.raises(ServiceError, match=f"{ROUTED_EXPERTS_WEIGHTS}: {key} has shape"):
        served.load_state("a", bad, optimizer=False)
    # Without the file the routed experts compute their base weights: the logits are off.
    (bad / ROUTED_EXPERTS_WEIGHTS).unlink()
    handle = served.load_sampler(bad, lora)
    assert float((served_logits(served._samplers[handle].params) - ref).abs().max()) > 1e-3
