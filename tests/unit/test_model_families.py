"""[model] family / flavor, Qwen3 shapes, and the load_hf shape check.

References: torchtitan's own registries and FLOP/parameter counts (meta-device models),
and config.json files written by `transformers`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.errors import ConfigError
from core.models import (
    FAMILIES,
    KIMI_VISION_FLAVORS,
    LLAMA3_FLAVORS,
    MLA_LATENT_NORM_EPS,
    MLA_LAYER_NORM_EPS,
    MOE_FAMILIES,
    QWEN3_FLAVORS,
    QWEN3_MOE_FLAVORS,
    model_config,
    model_shape,
    shape_of_config,
)
from core.small_flavors import SIGMOID_SOURCE, SMALL_FLAVORS
from parallel.perf import model_flops_per_token
from recipe.loader import load_recipe
from runtime.hf import hf_config, shape_mismatch
from tests.helpers.runs import train_main_error


def test_flavor_lists_are_torchtitans_registries():
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.qwen3 import qwen3_configs

    assert set(LLAMA3_FLAVORS) == set(llama3_configs)
    assert set(QWEN3_FLAVORS) | set(QWEN3_MOE_FLAVORS) == set(qwen3_configs)
    for f in QWEN3_MOE_FLAVORS:  # the MoE split is torchtitan's, not a guess
        assert any(
            getattr(layer, "moe", None) is not None for layer in qwen3_configs[f]("flex").layers
        )
    for f in QWEN3_FLAVORS:
        assert all(getattr(layer, "moe", None) is None for layer in qwen3_configs[f]("flex").layers)


@pytest.mark.parametrize(
    "overrides, key, needle",
    [
        (["model.family=qwen"], "model.family", "did you mean 'qwen3'"),
        (["model.family=qwen3_5"], "model.family", "GPU only"),
        (["model.family=kimi_k2_7", "model.flavor=Kimi-VL-A3B"], "model.flavor", "vision"),
        (["model.family=qwen3", "model.flavor=0.6b"], "model.flavor", "did you mean '0.6B'"),
        (["model.family=deepseek_v3", "model.flavor=16b"], "model.flavor", "did you mean '16B'"),
        (["model.flavor=0.6B"], "model.flavor", "unknown llama3 flavor"),
    ],
)
def test_bad_family_or_flavor(overrides, key, needle):
    with pytest.raises(ConfigError) as e:
        load_recipe(None, overrides)
    assert e.value.key == key and needle in str(e.value)


@pytest.mark.parametrize("flavor", ["debugmodel", "0.6B", "8B", "32B"])
def test_qwen3_shape_counts_equal_torchtitans(flavor):
    cfg = model_config(flavor, "qwen3")
    with torch.device("meta"):
        model = cfg.build()
    shape = model_shape(flavor, "qwen3")
    assert shape.qk_norm and shape.head_dim == 128
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    for seq in (2048, 8192):
        _, flops = cfg.get_nparams_and_flops(model, seq)
        assert shape.flops_per_token(seq) == flops, seq
        assert model_flops_per_token(shape, seq) == flops, seq  # the performance model's


_EVERY_MOE_FLAVOR = [(fam, fl) for fam, fls in FAMILIES.items() for fl in fls
                     if model_shape(fl, fam).is_moe]  # fmt: skip


def test_flavor_lists_are_torchtitans_moe_registries():
    from torchtitan.models.deepseek_v3 import deepseekv3_configs
    from torchtitan.models.gpt_oss import gptoss_configs
    from torchtitan.models.kimi_k2_7 import kimi_k2_5_configs

    # titanscale's own flavors (core.small_flavors) are the only ones not in torchtitan's.
    ours = SMALL_FLAVORS["deepseek_v3"]
    assert set(FAMILIES["deepseek_v3"]) == set(deepseekv3_configs) | set(ours)
    assert set(FAMILIES["gpt_oss"]) == set(gptoss_configs)
    kimi = set(kimi_k2_5_configs) | set(SMALL_FLAVORS["kimi_k2_7"])
    assert set(FAMILIES["kimi_k2_7"]) | set(KIMI_VISION_FLAVORS) == kimi
    assert not set(ours) & (set(deepseekv3_configs) | set(kimi_k2_5_configs))
    assert {fam for fam, _ in _EVERY_MOE_FLAVOR} == {"qwen3", *MOE_FAMILIES}


@pytest.mark.parametrize("family, flavor", _EVERY_MOE_FLAVOR)
def test_moe_shape_counts_equal_torchtitans(family, flavor):
    """total_params = torchtitan's meta-built model; flops_per_token = its own MoE count
    (active parameters: top_k of the routed experts)."""
    cfg = model_config(flavor, family)
    with torch.device("meta"):
        model = cfg.build()
    shape = model_shape(flavor, family)
    assert shape.is_moe and 0 < shape.top_k < shape.n_routed_experts
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if "moe.routed_experts" in n)
    assert routed == shape.n_moe_layers * shape.n_routed_experts * shape.routed_expert_params
    assert (
        shape.total_params - shape.active_params
        == routed * (shape.n_routed_experts - shape.top_k) // shape.n_routed_experts
    )
    _, flops = cfg.get_nparams_and_flops(model, 4096)
    assert shape.flops_per_token(4096) == flops


@pytest.mark.parametrize("family", sorted(SIGMOID_SOURCE))
def test_small_sigmoid_flavor_routes_as_its_source(family):
    """debugmodel_sigmoid: the big sigmoid flavor's router and RoPE (torchtitan's config),
    one dense layer then MoE; every norm at the released models' epsilon."""
    big, small = (
        model_config(SIGMOID_SOURCE[family][0], family),
        model_config("debugmodel_sigmoid", family),
    )
    r_big, r_small = big.layers[-1].moe.router, small.layers[-1].moe.router
    for f in ("score_func", "top_k", "num_expert_groups", "num_limited_groups", "route_norm",
              "route_scale"):  # fmt: skip
        assert getattr(r_small, f) == getattr(r_big, f), f
    assert r_small.score_func == "sigmoid"
    rope_big, rope_small = big.layers[0].attention.rope, small.layers[0].attention.rope
    assert dataclasses.replace(rope_small, dim=rope_big.dim) == rope_big
    assert small.layers[0].moe is None and all(x.moe is not None for x in small.layers[1:])
    for cfg in (big, small):
        attn = cfg.layers[0].attention
        assert attn.kv_norm.eps == MLA_LATENT_NORM_EPS
        assert cfg.norm.eps == cfg.layers[1].ffn_norm.eps == MLA_LAYER_NORM_EPS[family]


def test_mtp_shape_counts_equal_torchtitans():
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    cfg = deepseekv3_configs["debugmodel"](
        attn_backend="flex", moe_comm_backend="standard", num_mtp_layers=1
    )
    with torch.device("meta"):
        model = cfg.build()
    shape = shape_of_config(cfg, "debugmodel", "deepseek_v3")
    assert shape.n_mtp_layers == 1
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.flops_per_token(2048) == cfg.get_nparams_and_flops(model, 2048)[1]


def _hf_dict(cfg) -> dict:
    return cfg.to_dict()


def test_shape_check_against_transformers_configs():
    import transformers

    llama = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=2048,
    )  # fmt: skip
    qwen = transformers.Qwen3Config(
        hidden_size=256, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=2048, tie_word_embeddings=True,
    )  # fmt: skip
    assert shape_mismatch(model_shape("debugmodel", "llama3"), _hf_dict(llama)) is None
    assert shape_mismatch(model_shape("debugmodel", "qwen3"), _hf_dict(qwen)) is None
    msg = shape_mismatch(model_shape("debugmodel", "llama3"), _hf_dict(qwen))
    assert msg is not None and "\n" not in msg
    # Both shapes named, and what differs.
    assert "qwen3, 8 layers" in msg and "llama, 6 layers" in msg and "layers" in msg
    # A real 8B config.json's numbers (published) against the 8B flavor.
    llama8 = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256,
    )  # fmt: skip
    assert shape_mismatch(model_shape("8B", "llama3"), _hf_dict(llama8)) is None


def test_generated_config_reads_back_in_transformers():
    import transformers

    for family, cls in (("llama3", transformers.LlamaConfig), ("qwen3", transformers.Qwen3Config)):
        cfg = hf_config(model_config("debugmodel", family), family, "bfloat16")
        back = cls(**{k: v for k, v in cfg.items() if k != "model_type"})
        assert shape_mismatch(model_shape("debugmodel", family), back.to_dict()) is None


def test_load_hf_shape_mismatch_exits_2_before_any_process_group(tmp_path, capsys):
    import transformers

    folder = tmp_path / "qwen"
    transformers.Qwen3Config(
        hidden_size=256, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=2048,
    ).save_pretrained(folder)  # fmt: skip
    (folder / "model.safetensors").write_bytes(b"")  # never read: the shape check comes first
    code, err = train_main_error(
        ["--set", f"job.output_dir={tmp_path / 'out'}", "--set", f"checkpoint.load_hf={folder}"],
        capsys,
    )
    assert code == 2
    assert len(err) == 1 and "checkpoint.load_hf" in err[0] and "llama, 6 layers" in err[0]
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_moe_shape_check_against_transformers_configs():
    """config.json of transformers' own MoE config classes against our MoE shapes: equal
    when the dimensions are the flavor's, one line naming the experts when not."""
    import dataclasses

    import transformers

    from tests.helpers.hf_reference import GPT_OSS_DEBUG, QWEN3_MOE_DEBUG

    def cut(flavor: str, family: str):
        return dataclasses.replace(model_shape(flavor, family), n_layers=2)

    qwen = transformers.Qwen3MoeConfig(**QWEN3_MOE_DEBUG).to_dict()
    assert shape_mismatch(cut("debugmodel_moe", "qwen3"), qwen) is None
    oss = transformers.GptOssConfig(**GPT_OSS_DEBUG).to_dict()
    assert shape_mismatch(cut("debugmodel", "gpt_oss"), oss) is None
    # DeepSeek-V3's debug shape (MLA: head_dim = nope + rope; 1 dense layer of width 1024).
    ds = transformers.DeepseekV3Config(
        hidden_size=256, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=3, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=2048,
    ).to_dict()  # fmt: skip
    assert shape_mismatch(model_shape("debugmodel", "deepseek_v3"), ds) is None
    ds["n_routed_experts"] = 16
    msg = shape_mismatch(model_shape("debugmodel", "deepseek_v3"), ds)
    assert msg is not None and "\n" not in msg and "experts" in msg and "16 experts" in msg
