"""LoRA on routed experts (runtime.moe_experts): the grouped-GEMM adapter math against an
independent per-expert loop in float64, a fresh adapter leaving the model unchanged, and a
few optimizer steps on a tiny torchtitan qwen3 MoE that train only adapter parameters (the
experts' base weights and everything else bit-identical) while the loss falls."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.lora import base_state, expert_adapter_state, fold_expert_adapters
from runtime.moe_experts import LoRAGroupedExperts, expert_lora_modules
from runtime.steps import forward_logits
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
