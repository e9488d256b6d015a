"""Stack profiles, the stack-aware memory terms, slice-awareness, LoRA, and the planner's
fixed tokens per step (issue 16). Each check against an independent count or formula."""

from __future__ import annotations

import json

import pytest
import tomllib

from core.axes import Layout
from core.errors import ConfigError
from core.models import model_shape
from parallel.cluster import load_cluster
from parallel.memory import (
    STATE_BYTES_PER_PARAM,
    estimate_memory,
    inflight_stage_microbatches,
    layer_activation_bytes,
)
from parallel.perf import predict
from parallel.planner import TOKENS_PER_STEP_CEILING, search
from parallel.stacks import STACK_DIR, load_stack, parse_stack, stack_names
from parallel.workload import Workload, workload_from_recipe
from recipe.loader import check_recipe, load_recipe


def test_profiles_load_and_cite_every_constant():
    assert {"torchtitan", "megatron_te"} <= set(stack_names())
    for name in stack_names():
        st = load_stack(name)
        assert st.name == name
        for k in st.constants():
            assert st.sources.get(k, "").strip(), f"{name}: {k} has no source"


def _raw(name="torchtitan"):
    return tomllib.loads((STACK_DIR / f"{name}.toml").read_text())


def test_bad_profiles_name_the_key():
    raw = _raw()
    raw["constants"]["atention_eff"] = raw["constants"].pop("attention_eff")
    with pytest.raises(ConfigError, match="did you mean 'attention_eff'") as e:
        parse_stack(raw, "x.toml")
    assert e.value.key == "constants.atention_eff"
    raw = _raw()
    del raw["sources"]["tp_hidden"]
    with pytest.raises(ConfigError, match="tp_hidden") as e:
        parse_stack(raw, "x.toml")
    assert e.value.key == "sources"
    raw = _raw()
    raw["matmul_eff"]["bf16"] = 1.7
    with pytest.raises(ConfigError) as e:
        parse_stack(raw, "x.toml")
    assert e.value.key == "matmul_eff.bf16"
    with pytest.raises(ConfigError, match="megatron_te"):
        load_stack("megatron")


def _act(shape, t, ffn_elt_bytes, saves_gathered, rope_copy):
    """Bytes per token per layer kept for backward without recompute, counted here."""
    d, qd, kv, f = (
        shape.dim,
        shape.n_heads * shape.head_dim,
        shape.n_kv_heads * shape.head_dim,
        shape.ffn_hidden,
    )
    seq = 2 * d * 4  # LN1 in/out, LN2 in/out (sequence-sharded)
    gathered = 2 * d * 2 if saves_gathered and t > 1 else 0  # wqkv and w1/w3 inputs
    attn = 2 * (qd + 2 * kv) + 2 * qd + 4 * shape.n_heads  # q, k, v; output; fp32 lse
    attn += (2 * qd + 2 * kv) if rope_copy else 0
    return seq / t + gathered + (attn + ffn_elt_bytes * f) / t


def _act_torchtitan(shape, t):
    """torchtitan 0.3.0's block as tools.dryrun saw it live at llama3_8b's peak (per layer and
    token): norm in/out and residuals (8d, sequence-sharded), the SP-gathered inputs of wqkv
    and w1/w3 (4d), a contiguous copy of v, RoPE'd q and k, the attention output with its fp32
    logsumexp and row max, SwiGLU's four tensors (8f), and the token's RoPE factors
    (head_dim / 2 complex64, on every tp rank)."""
    d, qd, kv, f = (
        shape.dim,
        shape.n_heads * shape.head_dim,
        shape.n_kv_heads * shape.head_dim,
        shape.ffn_hidden,
    )
    attn = 2 * kv + (2 * qd + 2 * kv) + 2 * qd + 2 * 4 * shape.n_heads
    gathered = 2 * d * 2 if t > 1 else 0
    return 8 * d / t + gathered + (attn + 8 * f) / t + 4 * shape.head_dim


def test_megatron_regathers_sp_inputs_and_fuses_swiglu():
    s = model_shape("405B")
    w = Workload(s, 8192, 1, Layout(tp=8, dp_shard=8), ac="none")
    tt = layer_activation_bytes(w)
    mc = layer_activation_bytes(w.with_(stack="megatron_te"))
    assert tt == pytest.approx(_act_torchtitan(s, 8))
    assert mc == pytest.approx(_act(s, 8, 6, False, False))
    assert mc < 0.5 * tt


def test_llama3_405b_pp16_tp8_layout_is_no_longer_200_gib():
    """Meta trained PP16 x TP8 x DP128, no recompute, on 80 GB H100s (Llama 3 paper)."""
    s = model_shape("405B")
    w = Workload(
        s, 8192, 16, Layout(pp=16, dp_replicate=128, tp=8), pp_schedule="Interleaved1F1B",
        pp_microbatches=16, ac="none", stack="megatron_te",
    )  # fmt: skip
    m = estimate_memory(w)
    assert m.reserved_gib < 90, m.breakdown_gib()
    # 1F1B-like peak: rank 0/1 holds p stage-microbatches; interleaved with m = p holds all.
    assert inflight_stage_microbatches(w, 0) == 16 * 2
    # Distributed optimizer: bf16 weights + bf16 grads resident, 12 B/param over dp.
    lay_params = (m.unsharded) / 4
    assert m.states == pytest.approx(lay_params * (STATE_BYTES_PER_PARAM - 4) / 128, rel=1e-6)


def test_slice_is_priced_as_a_slice():
    r = load_recipe("recipes/gpu_slice_70b.toml")
    lay = check_recipe(r)
    w = workload_from_recipe(r, lay)
    full = model_shape("70B")
    assert w.shape.n_layers == r.model.layers < full.n_layers
    params = r.model.layers * full.params_per_layer + 2 * full.vocab_size * full.dim + full.dim
    assert w.shape.total_params == params
    m = estimate_memory(w)
    shards = lay.tp * lay.dp_shard * lay.cp
    assert m.states == pytest.approx(params * STATE_BYTES_PER_PARAM / shards, rel=0.02)


def test_lora_freezes_the_base():
    s = model_shape("8B")
    w = Workload(s, 4096, 2, Layout(dp_shard=8), ac="selective")
    lw = w.with_(lora_rank=16)
    full, lora = estimate_memory(w), estimate_memory(lw)
    # A (r x in) and B (out x r) on each block linear: wqkv (fused), wo, w1, w3, w2.
    qd, kv, d, f = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.dim, s.ffn_hidden
    linears = [(d, qd + 2 * kv), (qd, d), (d, f), (d, f), (f, d)]
    adapters = s.n_layers * sum(16 * (i + o) for i, o in linears)
    # torchtitan keeps the frozen base's fp32 parameter (4 B) and nothing else for it; the
    # adapters carry the usual 16 B/param (fp32 weight, gradient, two AdamW moments).
    assert lora.states == pytest.approx((s.total_params * 4 + adapters * 16) / 8)
    # Under selective AC the per-op policy also saves each adapter's full-width output
    # (measured by tools.dryrun, benchmarks/dryrun.md), so LoRA keeps more activations.
    assert lora.activations > full.activations
    c = load_cluster("hgx_h100_ib", nodes=1)
    w, lw = w.with_(ac="none"), lw.with_(ac="none")  # no recompute: fwd, dgrad, wgrad
    pf, pl = predict(w, c), predict(lw, c)
    # No weight gradients: the base's matmul time drops by a third (fwd 1, dgrad 1, wgrad 1);
    # the rank-16 adapter GEMMs (0.5% of the FLOPs, but skinny and so at low efficiency) add
    # some of it back, never more than a tenth of the full run's matmul time.
    base = pf.breakdown["matmul_s"] * 2 / 3
    assert base < pl.breakdown["matmul_s"] < base + pf.breakdown["matmul_s"] / 10
    # The optimizer touches the adapters only (well under 1% of the parameters).
    assert 0 < pl.breakdown["optimizer_s"] < pf.breakdown["optimizer_s"] / 100


def test_blackwell_is_not_hopper():
    s = model_shape("70B")
    w = Workload(s, 8192, 2, Layout(dp_shard=64), ac="full", compile=True)
    h, b = load_cluster("hgx_h100_ib", nodes=8), load_cluster("hgx_b200_ib", nodes=8)
    mfu_h, mfu_b = predict(w, h).mfu_pct, predict(w, b).mfu_pct
    assert load_stack("torchtitan").gpu_factor("B200") < 1.0
    assert mfu_b < mfu_h


def test_planner_holds_tokens_per_step():
    # global batch left to the planner (the shipped recipe fixes 512 sequences)
    r = load_recipe("recipes/llama3_70b.toml", ["training.global_batch_size=-1"])
    c = load_cluster("hgx_h100_ib")
    res = search(r, c, nodes=4608)  # 36,864 GPUs
    assert res.plans
    seq = r.training.seq_len
    assert len(res.warnings) == 1 and "training.global_batch_size" in res.warnings[0]
    for p in res.plans[:50]:
        # Held at the largest multiple of dp under 16M tokens (2048 sequences of 8192).
        dp = p.layout.dp
        assert p.global_batch_size == (TOKENS_PER_STEP_CEILING // seq) // dp * dp
    r2 = load_recipe("recipes/llama3_70b.toml", ["training.global_batch_size=1024"])
    res2 = search(r2, c, nodes=64)
    assert not res2.warnings
    assert {p.global_batch_size for p in res2.plans} == {1024}


def test_predict_cli_stack(capsys):
    from tools.predict import main

    main([
        "--recipe", "llama3_70b", "--cluster", "hgx_h100_ib", "--nodes", "8", "--stack",
        "megatron_te", "--set", "parallel.world_size=64", "--set", "parallel.tp=4",
        "--set", "parallel.pp=8", "--set", "parallel.dp_shard=-1", "--set",
        "parallel.pp_schedule=Interleaved1F1B", "--set", "training.activation_checkpoint=none",
        "--json",
    ])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["stack"] == "megatron_te" and out["tokens_per_sec_per_gpu"] > 0
    with pytest.raises(SystemExit) as e:
        main(["--recipe", "llama3_70b", "--cluster", "hgx_h100_ib", "--stack", "megatrn"])
    assert e.value.code == 2
    assert "did you mean 'megatron_te'" in capsys.readouterr().err


def test_pp_stages_per_rank_is_checked_and_reaches_torchtitan():
    """Megatron's virtual pipeline size as a recipe key: validated at load, priced by the
    model, and passed to torchtitan as layers per stage (its own way to set it)."""
    base = ["parallel.world_size=64", "parallel.tp=4", "parallel.pp=8", "parallel.dp_shard=2",
            "parallel.cp=1", "training.global_batch_size=-1",
            "parallel.pp_microbatches=8", "training.local_batch_size=8"]  # fmt: skip
    bad = load_recipe("recipes/llama3_70b.toml", [*base, "parallel.pp_stages_per_rank=3"])
    with pytest.raises(ConfigError) as e:
        check_recipe(bad, 64)
    assert e.value.key == "parallel.pp_stages_per_rank"  # 1F1B runs one stage per rank
    r = load_recipe(
        "recipes/llama3_70b.toml",
        [*base, "parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=5"],
    )
    lay = check_recipe(r, 64)
    w = workload_from_recipe(r, lay)
    assert w.stages_per_rank == 5
    from runtime.build import build_trainer_config, choose_kernels
    from runtime.platform import Platform

    platform = Platform(device_type="cuda", device_name="NVIDIA H100 80GB HBM3",
                        compute_capability=(9, 0), backend="nccl")  # fmt: skip
    cfg = build_trainer_config(
        r, lay, platform=platform, kernels=choose_kernels(r, platform), tokenizer_path="unused"
    )
    par = cfg.parallelism
    # torchtitan: stages = ceil((layers + first_less + last_less) / layers_per_stage), and
    # stages / pp per rank. 80 layers, 8 x 5 = 40 stages: 2 per stage (Megatron's split).
    lps = par.pipeline_parallel_layers_per_stage
    eff = 80 + par.pipeline_parallel_first_stage_less_layers
    eff += par.pipeline_parallel_last_stage_less_layers
    assert lps == 2 and -(-eff // lps) == 8 * 5


def test_planner_prices_memory_on_the_stack():
    """Every plan's memory equals the direct estimate of its own workload on that stack
    (ZeRO-1 shards the optimizer over replicas, FSDP over dp_shard)."""
    r = load_recipe("recipes/llama3_70b_h100.toml")
    c = load_cluster("hgx_h100_ib")
    res = search(r, c, stack="megatron_te")
    zero1 = [p for p in res.plans if p.layout.dp_shard == 1 and p.layout.dp_replicate > 1]
    assert zero1 and res.plans
    for p in zero1[:5] + res.plans[:5]:
        w = Workload(
            model_shape("70B"), r.training.seq_len, p.local_batch_size, p.layout,
            grad_accum=1 if p.layout.pp > 1 else p.microbatches,
            pp_schedule=p.pp_schedule or "1F1B",
            pp_microbatches=p.microbatches if p.layout.pp > 1 else 0,
            ac=p.activation_checkpoint, linear=p.prediction.workload.linear,
            compile=r.training.compile, stack="megatron_te",
            cuda_graphs=p.prediction.workload.cuda_graphs,
        )  # fmt: skip
        assert p.memory_gib == pytest.approx(estimate_memory(w).reserved_gib, rel=1e-9)
