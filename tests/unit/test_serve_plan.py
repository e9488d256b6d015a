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


# ------------------------------------------------------------- several bases, one process
# Published parameter counts (the Hugging Face model cards' safetensors totals).
PUBLISHED_8B = {
    "recipes/sft_llama3_8b_lora.toml": 8_030_261_248,  # Llama 3.1 8B
    "recipes/sft_qwen3_8b_lora.toml": 8_190_735_360,  # Qwen3-8B (untied embeddings)
}


def test_several_bases_are_priced_together(capsys):
    """Two 8B bases on one H100: each holds its bf16 weights for the life of the service (the
    residents add up), one operation runs at a time (the larger transient part counts)."""
    from parallel.memory import ALLOCATOR_FRAGMENTATION, runtime_overhead_gib

    out = _plan_json(capsys, *[a for r in PUBLISHED_8B for a in ("--recipe", r)])
    assert out["fits"] and out["problem"] is None
    for b in out["bases"]:
        weights = PUBLISHED_8B[b["recipe"]] * 2 / GIB
        assert weights < b["resident_gib"] < weights + 2.0  # + adapters and snapshots
        assert b["generator_tokens"] >= 4096 and b["microbatch_tokens"] >= 4096
    resident = sum(b["resident_gib"] for b in out["bases"])
    transient = max(b["transient_gib"] for b in out["bases"])
    peak = (resident + transient) * (1 + ALLOCATOR_FRAGMENTATION) + runtime_overhead_gib("H100")
    assert out["gib_per_device"] == pytest.approx(peak, abs=0.02)
    assert out["gib_per_device"] <= out["device_gib"]


def test_a_set_that_fits_only_base_by_base_is_refused_naming_them(capsys):
    """Four 8B bases: each fits one H100 alone, their weights together (> 60 GiB) and one
    operation's memory do not; the answer names every base and the numbers."""
    four = [*PUBLISHED_8B, *PUBLISHED_8B]
    for r in PUBLISHED_8B:
        alone = _plan_json(capsys, "--recipe", r, "--nodes", "1")
        assert alone["resources"][0]["devices"] == 1 and alone["resources"][0]["fits"]
    out = _plan_json(capsys, *[a for r in four for a in ("--recipe", r)])
    weights = sum(PUBLISHED_8B[r] for r in four) * 2 / GIB
    assert not out["fits"] and out["gib_per_device"] > weights > 59
    why = out["problem"]
    assert "4 bases do not fit together on one device of 79.2 GiB" in why
    assert "sft_llama3_8b_lora (8B)" in why and "sft_qwen3_8b_lora (8B)" in why
    assert f"at least {out['gib_per_device']:.2f} GiB" in why and "\n" not in why


def test_plan_together_keeps_the_whole_set_within_the_device():
    """Whatever budgets each base picks, the residents' sum plus the largest transient part
    (the formula, from the parts) stays within the device; alone, a base may take more."""
    from parallel.memory import ALLOCATOR_FRAGMENTATION, runtime_overhead_gib
    from parallel.serve import plan_together

    models = [served_model(load_recipe(r)) for r in PUBLISHED_8B]
    res = [Resource(), Resource(adapters=8)]
    plans = plan_together(models, res, H100.hbm_bytes, "H100")
    assert all(p.fits for p in plans)
    parts = [(p.memory.resident, p.memory.allocated - p.memory.resident) for p in plans]
    peak = (sum(r for r, _ in parts) + max(t for _, t in parts)) * (1 + ALLOCATOR_FRAGMENTATION)
    assert peak + runtime_overhead_gib("H100") * GIB <= H100.hbm_bytes
    alone = [plan_resource(m, r, H100.hbm_bytes, "H100") for m, r in zip(models, res, strict=True)]
    for a, p in zip(alone, plans, strict=True):
        assert a.memory.generator_tokens >= p.memory.generator_tokens
        assert a.memory.microbatch_tokens >= p.memory.microbatch_tokens


@pytest.mark.parametrize(
    "argv, env, key, what",
    [
        (["--recipe", "debug", "--recipe", "debug"], {}, "--base-name", "both serve"),
        (["--recipe", "debug", "--recipe", "debug", "--base-name", "a"], {}, "--base-name",
         "given 1 times for 2 --recipe"),
        (["--recipe", "debug", "--recipe", "debug", "--base-name", "a", "--base-name", "b",
          "--sampler", "vllm"], {}, "--sampler", "one engine over one base"),
        (["--recipe", "debug", "--recipe", "debug", "--base-name", "a", "--base-name", "b"],
         {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
         "--recipe", "a model resource (torchrun, 2 processes) serves one base"),
    ],
)  # fmt: skip
def test_tools_serve_refuses_several_bases_it_cannot_serve(
    argv, env, key, what, tmp_path, capsys, monkeypatch
):
    from core.errors import exit_on_config_error
    from tools import serve

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = [*argv, "--set", f"job.output_dir={tmp_path}", "--port", "65000"]
    with pytest.raises(SystemExit) as e:
        exit_on_config_error(serve.main)(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert e.value.code == 2 and len(err) == 1 and f" {key}: " in err[0] and what in err[0], err


def test_tools_serve_refuses_bases_that_do_not_fit_together(tmp_path, capsys, monkeypatch):
    """Each debug base fits the (faked) device alone, the two together do not: one line
    naming both bases and the numbers, exit 2, before the port is bound or a model built."""
    import runtime.platform
    import service.server
    from parallel.serve import MICROBATCH_LADDER, resource_memory
    from tools import serve

    sets = ["model.layers=2", "training.seq_len=64"]
    m = served_model(load_recipe("recipes/debug.toml", sets), cpu=True)
    r = Resource(adapters=20000)  # resident adapters make each base's resident part large
    least = resource_memory(m, r, MICROBATCH_LADDER[0], m.context)
    device = least.required_gib_on("cpu") * GIB + least.resident  # one fits, two do not
    monkeypatch.setattr(runtime.platform, "device_memory_bytes", lambda platform: (device, "cpu"))
    monkeypatch.setattr(service.server, "bind", lambda *a: pytest.fail("port bound"))
    alone = plan_resource(m, r, device, "cpu")
    assert alone.fits
    argv = ["--recipe", "debug", "--recipe", "debug", "--base-name", "org/a", "--base-name",
            "org/b", "--adapters", "20000", "--port", "65000", "--set", f"job.output_dir={tmp_path}"]  # fmt: skip
    for s in sets:
        argv += ["--set", s]
    with pytest.raises(SystemExit) as e:
        from core.errors import exit_on_config_error

        exit_on_config_error(serve.main)(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert e.value.code == 2 and len(err) == 1 and " --recipe: " in err[0], err
    assert "2 bases do not fit together" in err[0] and "org/a" in err[0] and "org/b" in err[0]
