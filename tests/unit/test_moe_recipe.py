"""[moe] and parallel.ep: validated at load, one line naming the key, exit 2.

Reference: the mixture-of-experts numbers are torchtitan's own config (8 routed experts in
the DeepSeek-V3 debug model recipes/moe_debug.toml trains), and the mesh rule is
torchtitan's ParallelDims (dp_shard x cp x tp == efsdp x ep).
"""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from recipe.loader import check_recipe, load_recipe
from tests.helpers.runs import ROOT, train_main_error

MOE = str(ROOT / "recipes" / "moe_debug.toml")


def test_moe_debug_recipe_is_a_small_moe_with_top_k_above_one():
    from recipe.loader import effective_shape

    shape = effective_shape(load_recipe(MOE, []))
    assert shape.is_moe and shape.n_routed_experts == 8 and shape.top_k > 1
    assert shape.n_moe_layers >= 1


@pytest.mark.parametrize(
    "overrides, world, key, needle",
    [
        (["parallel.ep=3"], None, "parallel.ep", "divide the 8 routed experts"),
        (["parallel.ep=4", "parallel.dp_shard=2"], 2, "parallel.ep", "dp_shard x cp x tp"),
        (["moe.load_balance=aux_loss"], None, "moe.load_balance", "no auxiliary"),
        (["moe.load_balance=aux-loss-free"], None, "moe.load_balance", "did you mean"),
        (["moe.capacity_factor=1.25"], None, "moe.capacity_factor", "HybridEP"),
        (["moe.n_mtp_layers=1"], None, "moe.n_mtp_layers", "multi-token"),
    ],
)
def test_moe_keys_refused_naming_the_key(overrides, world, key, needle):
    with pytest.raises(ConfigError) as e:
        check_recipe(load_recipe(MOE, overrides), world)
    assert e.value.key == key and needle in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "overrides, key",
    [(["parallel.ep=2"], "parallel.ep"), (["moe.bias_update_speed=0.01"], "moe.bias_update_speed")],
)
def test_moe_keys_refused_on_dense_models(overrides, key):
    with pytest.raises(ConfigError) as e:
        check_recipe(load_recipe(None, overrides), 2)
    assert e.value.key == key and "dense" in str(e.value)


def test_ep3_on_eight_experts_exits_2_in_one_line(tmp_path, capsys):
    code, err = train_main_error(
        ["--recipe", MOE, "--set", f"job.output_dir={tmp_path}", "--set", "parallel.ep=3"], capsys
    )
    assert code == 2 and len(err) == 1 and "parallel.ep" in err[0], err
    assert not torch.distributed.is_initialized()


def test_moe_section_reaches_torchtitans_moe_configs():
    """load_balance -> every MoE layer's load_balance_coeff (torchtitan's bias update)."""
    from runtime.build import recipe_model_spec

    for sets, want in ((["moe.bias_update_speed=0.01"], 0.01), (["moe.load_balance=none"], None)):
        spec = recipe_model_spec(load_recipe(MOE, sets))
        coeffs = {layer.moe.load_balance_coeff for layer in spec.model.layers if layer.moe}
        assert coeffs == {want}


def test_fp8_on_a_moe_model_refused_on_cpu():
    from runtime.build import choose_kernels
    from runtime.platform import Platform

    cpu = Platform(device_type="cpu", device_name="cpu", compute_capability=None, backend="gloo")
    with pytest.raises(ConfigError) as e:
        choose_kernels(load_recipe(MOE, ["kernels.linear=fp8_rowwise"]), cpu)
    assert e.value.key == "kernels.linear" and "GPU" in str(e.value)
    assert choose_kernels(load_recipe(MOE, []), cpu).linear == "bf16"


def test_export_of_a_routing_bias_the_format_cannot_hold_is_refused():
    from runtime.hf import check_scratch_export

    with pytest.raises(ConfigError) as e:
        check_scratch_export("gpt_oss", export=True, load_hf="x", file=None, moe_bias=True)
    assert e.value.key == "checkpoint.export_hf" and "routing bias" in str(e.value)
    check_scratch_export("deepseek_v3", export=True, load_hf="x", file=None, moe_bias=True)
    with pytest.raises(ConfigError) as e:  # no config.json writer for DeepSeek-V3 from scratch
        check_scratch_export("deepseek_v3", export=True, load_hf="", file=None)
    assert "checkpoint.load_hf" in str(e.value)
