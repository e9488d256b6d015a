"""Served model resources priced by the planner (parallel/serve.py, tools.plan --serve,
tools.predict --serve): a Llama 3.1 70B LoRA resource fits one 8 x H100 node and a 405B one
needs several nodes; the parts are checked against the published models' sizes, computed
here from the Llama 3 paper's dimensions, not from the implementation's shape table."""

from __future__ import annotations

import json

import pytest

from core.errors import ConfigError
from parallel.cluster import load_cluster
from parallel.serve import GIB, Resource, plan_resource, served_model
from recipe.loader import load_recipe

H100 = load_cluster("hgx_h100_ib")
# Llama 3.1 (Dubey et al. 2024, table 3; the released configs): layers, width, FFN width,
# KV heads x head dim, vocabulary; parameter counts as the Hugging Face model cards state.
LLAMA = {
    "70B": (80, 8192, 28672, 8 * 128, 128256, 70_553_706_496),
    "405B": (126, 16384, 53248, 8 * 128, 128256, 405_853_388_800),
}


def lora_params(flavor: str, rank: int) -> int:
    """rank x (in + out) on qkv (fused), wo, w1, w3, w2 of every block and the output."""
    n, d, f, kv, v, _ = LLAMA[flavor]
    block = (d + d + 2 * kv) + (d + d) + 3 * (d + f)
    return rank * (n * block + d + v)


def _plan_json(capsys, *argv: str) -> dict:
    from tools.plan import main

    main(["--serve", "--json", "--cluster", "hgx_h100_ib", *argv])
    return json.loads(capsys.readouterr().out)


def test_70b_lora_resource_fits_one_h100_node(capsys):
    out = _plan_json(capsys, "--recipe", "recipes/serve_llama3_70b.toml", "--nodes", "1")
    rows = {r["devices"]: r for r in out["resources"]}
    assert out["smallest"]["devices"] == 8 and out["smallest"]["nodes"] == 1
    assert not rows[4]["fits"] and rows[8]["fits"]
    one = rows[8]
    total = LLAMA["70B"][-1]
    assert one["memory_breakdown_gib"]["base_shard"] == pytest.approx(total * 2 / 8 / GIB, abs=0.01)
    # 4 resident adapters: parameter, gradient and two AdamW moments in bf16 (+ a snapshot)
    adapters = 4 * lora_params("70B", 32) * 2
    assert one["memory_breakdown_gib"]["adapters"] == pytest.approx(4 * adapters / GIB, abs=0.01)
    assert one["memory_breakdown_gib"]["sampler_snapshots"] == pytest.approx(
        adapters / GIB, abs=0.01
    )
    assert one["memory_gib_per_device"] <= one["device_gib"]
    # a full-context datum trains, the generator holds whole contexts, the estimates exist
    assert one["microbatch_tokens"] >= 8192 and one["generator_tokens"] % 8192 == 0
    assert one["concurrent_samples"] >= 1 and one["decode_step_s"] > 0
    assert one["forward_backward_tokens_per_s"] > 0


def test_405b_lora_resource_needs_several_nodes(capsys):
    out = _plan_json(
        capsys, "--recipe", "recipes/serve_llama3_405b.toml", "--nodes", "16", "--adapters", "2"
    )
    best = out["smallest"]
    assert best["nodes"] > 1 and best["devices"] == 8 * best["nodes"]
    total = LLAMA["405B"][-1]
    assert best["memory_breakdown_gib"]["base_shard"] == pytest.approx(
        total * 2 / best["devices"] / GIB, abs=0.01
    )
    smaller = [r for r in out["resources"] if r["devices"] < best["devices"]]
    assert smaller and not any(r["fits"] for r in smaller)
    one_node = next(r for r in out["resources"] if r["devices"] == 8)
    assert one_node["problems"][0]["key"] == "model.flavor"


def test_predict_serve_prices_one_resource(capsys):
    from tools.predict import main

    main(["--serve", "--recipe", "recipes/serve_llama3_70b.toml", "--cluster", "hgx_h100_ib",
          "--nodes", "1"])  # fmt: skip
    text = capsys.readouterr().out
    assert "on 8 x H100 (1 node(s)" in text and ": fits" in text and "decode step" in text


def test_no_generator_reserves_no_generator_memory():
    r = load_recipe("recipes/serve_llama3_70b.toml")
    m = served_model(r)
    on = plan_resource(m, Resource(devices=8), H100.hbm_bytes, "H100")
    off = plan_resource(m, Resource(devices=8, generators=0), H100.hbm_bytes, "H100")
    assert off.fits and off.memory.generation == 0 and off.memory.generator_tokens == 0
    assert on.memory.generation > 0
    # what remains for training alone is the larger budget it can choose
    assert off.memory.microbatch_tokens >= on.memory.microbatch_tokens


def test_resource_refusals_name_what_to_change():
    r = load_recipe("recipes/serve_llama3_70b.toml")
    m = served_model(r)
    base = plan_resource(m, Resource(devices=2), H100.hbm_bytes, "H100")
    key, why = base.problems[0]
    assert key == "model.flavor" and "cannot hold this base" in why
    assert "at least 8 devices" in why  # the fewest that hold base, adapters and budgets
    gen = plan_resource(m, Resource(devices=8, generator_tokens=10**6), H100.hbm_bytes, "H100")
    assert [k for k, _ in gen.problems] == ["--generator-tokens"]
    mb = plan_resource(m, Resource(devices=8, microbatch_tokens=131072), H100.hbm_bytes, "H100")
    assert "--microbatch-tokens" in [k for k, _ in mb.problems]


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--generators", "2"], "--generators"),
        (["--generators", "0", "--generator-tokens", "4096"], "--generator-tokens"),
        (["--generator-tokens", "0"], "--generator-tokens"),
        (["--adapters", "-1"], "--adapters"),
        (["--op-timeout", "nan"], "--op-timeout"),
        (["--op-timeout", "0"], "--op-timeout"),
    ],
)
def test_bad_resource_options_are_one_line(argv, key):
    from tools.serve import check_args, parse_args

    with pytest.raises(ConfigError) as e:
        check_args(parse_args(["--recipe", "recipes/debug.toml", *argv]))
    assert e.value.key == key and "\n" not in str(e.value)
