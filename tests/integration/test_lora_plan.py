"""The memory and performance models under LoRA (finetune.mode = "lora")."""

from __future__ import annotations

import torch

from core.axes import Layout
from core.models import model_shape
from parallel.cluster import load_cluster
from parallel.memory import estimate_memory
from parallel.perf import predict
from parallel.planner import search
from parallel.workload import Workload
from recipe.loader import load_recipe


def test_lora_params_per_layer_equal_torchtitans_trainable_count():
    from torchtitan.components.lora import LoRAConverter
    from torchtitan.models.llama3 import model_registry

    for flavor in ("debugmodel", "8B"):
        cfg = model_registry(flavor).model
        cfg.layers = cfg.layers[:1]
        cfg = (
            LoRAConverter.Config(rank=8, alpha=16, target_modules=["wqkv", "wo", "w1", "w2", "w3"])
            .build()
            .convert(cfg)
        )
        with torch.device("meta"):
            m = cfg.build()
        trainable = sum(p.numel() for p in m.layers["0"].parameters() if p.requires_grad)
        w = Workload(shape=model_shape(flavor), seq_len=128, local_batch_size=1, lora_rank=8)
        assert w.lora_params_per_layer == trainable


def test_lora_needs_less_memory_and_time_than_full_and_the_planner_knows():
    shape = model_shape("8B")
    full = Workload(shape=shape, seq_len=8192, local_batch_size=1, layout=Layout(dp_shard=8))
    lora = full.with_(lora_rank=16)
    m_full, m_lora = estimate_memory(full), estimate_memory(lora)
    # Full fine-tuning keeps fp32 weights and two AdamW moments, 12 bytes per parameter at
    # the peak (the fp32 gradients are freed each step and made after the peak: measured by
    # tools.dryrun); the LoRA base keeps 4 (+ small adapters). Both sharded over 8.
    want_full, want = shape.total_params * 12 / 8, shape.total_params * 4 / 8
    assert abs(m_full.states - want_full) / want_full < 0.02
    assert abs(m_lora.states - want) / want < 0.02
    assert m_lora.states < m_full.states / 2.9 and m_lora.unsharded < m_full.unsharded
    cl = load_cluster("hgx_h100_ib", nodes=1)
    p_full, p_lora = predict(full, cl), predict(lora, cl)
    # Weight-gradient GEMMs dropped: block matmul time about 2/3 of full (adapters add a bit).
    ratio = p_lora.breakdown["matmul_s"] / p_full.breakdown["matmul_s"]
    assert 0.66 < ratio < 0.75
    assert p_lora.tokens_per_sec_per_gpu > p_full.tokens_per_sec_per_gpu
    # Planner: 8B on one GPU does not fit in full fine-tuning, fits under LoRA.
    r_full = load_recipe("recipes/llama3_8b.toml", ["parallel.world_size=1"])
    r_lora = load_recipe("recipes/llama3_8b.toml", ["parallel.world_size=1", "finetune.mode=lora"])
    one = load_cluster(
        "hgx_h100_ib", nodes=1, overrides=["gpus_per_node=1", "nvlink_domain_gpus=1"]
    )
    assert not search(r_full, one).plans
    assert search(r_lora, one).plans
