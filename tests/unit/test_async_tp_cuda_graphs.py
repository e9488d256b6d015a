"""`[parallel] async_tp` and `[training] cuda_graphs`: accepted where torchtitan allows them
(and passed to its config), refused with one line naming the key where not, and priced by
the performance model (tools.predict) and the planner."""

from __future__ import annotations

import json

import pytest

from core.errors import ConfigError
from recipe.loader import check_recipe, load_recipe
from tools import predict as predict_cli

# A tp = 8 layout: torchtitan's 64-GPU 70B layout (TP 8 x FSDP 8, full AC, compiled).
TP8 = ["--recipe", "llama3_70b_h100", "--cluster", "hgx_h100_ib", "--json",
       "--set", "parallel.pp=1", "--set", "parallel.cp=1", "--set", "parallel.tp=8",
       "--set", "parallel.dp_shard=8", "--set", "parallel.pp_microbatches=0",
       "--set", "training.local_batch_size=4", "--set", "training.activation_checkpoint=full"]  # fmt: skip


def _predict(capsys, args):
    predict_cli.main(args)
    return json.loads(capsys.readouterr().out)


def test_predict_async_tp_beats_plain_tp8(capsys):
    off = _predict(capsys, [*TP8, "--set", "parallel.async_tp=false"])
    on = _predict(capsys, [*TP8, "--set", "parallel.async_tp=true"])
    assert off["layout"]["tp"] == on["layout"]["tp"] == 8
    assert on["tokens_per_sec_per_gpu"] > off["tokens_per_sec_per_gpu"]
    # what it hides is TP communication, nothing else
    assert on["breakdown"]["tp_exposed_s"] < off["breakdown"]["tp_exposed_s"]
    assert on["breakdown"]["matmul_s"] == pytest.approx(off["breakdown"]["matmul_s"])


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["parallel.async_tp=true", "training.compile=false"], "parallel.async_tp", "compile"),
        (
            [
                "parallel.async_tp=true",
                "parallel.tp=1",
                "parallel.cp=1",
                "parallel.pp=1",
                "parallel.dp_shard=64",
                "training.local_batch_size=1",
                "parallel.pp_microbatches=0",
            ],
            "parallel.async_tp",
            "tp > 1",
        ),  # fmt: skip
        (["training.cuda_graphs=on"], "training.cuda_graphs", "pipeline"),
    ],
)
def test_refused_with_one_line(capsys, overrides, key, words):
    args = ["--recipe", "llama3_70b_h100", "--cluster", "hgx_h100_ib"]
    for o in overrides:
        args += ["--set", o]
    with pytest.raises(SystemExit) as e:
        predict_cli.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{key}: " in err[0] and words in err[0], err


def _build(recipe, layout):
    from runtime.build import build_trainer_config, choose_kernels
    from runtime.platform import Platform

    platform = Platform(device_type="cuda", device_name="NVIDIA H100 80GB HBM3",
                        compute_capability=(9, 0), backend="nccl")  # fmt: skip
    return build_trainer_config(recipe, layout, platform=platform,
                                kernels=choose_kernels(recipe, platform), tokenizer_path="unused")  # fmt: skip


def test_accepted_and_passed_to_torchtitan():
    r = load_recipe("recipes/llama3_70b_h100.toml", ["parallel.async_tp=true"])
    layout = check_recipe(r, 64)
    cfg = _build(r, layout)
    assert layout.tp == 4 and layout.pp == 8
    assert cfg.compile.enable and cfg.compile.enable_async_tensor_parallel
    assert cfg.training.disable_cuda_graphs  # pp > 1: torchtitan cannot capture
    r1 = load_recipe("recipes/llama3_70b_b200.toml")
    cfg1 = _build(r1, check_recipe(r1, 64))
    assert not cfg1.training.disable_cuda_graphs  # pp = 1, flex attention: captured
    assert not cfg1.compile.enable_async_tensor_parallel
    r2 = load_recipe("recipes/llama3_70b_b200.toml", ["training.cuda_graphs=off"])
    assert _build(r2, check_recipe(r2, 64)).training.disable_cuda_graphs


def test_async_tp_refused_on_cpu_before_any_process_group(monkeypatch):
    from runtime import session

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun would set it; no group is started
    with pytest.raises(ConfigError, match="parallel.async_tp: async TP needs CUDA"):
        session.prepare("recipes/debug.toml", ["parallel.async_tp=true", "training.compile=true",
                                               "parallel.tp=2", "parallel.world_size=0"])  # fmt: skip


def test_planner_prices_cuda_graphs_for_small_blocks():
    """Host launch time shows only where a block's GPU work is shorter than its launches
    (debug model on an H100), and CUDA graphs remove it."""
    from core.models import model_shape
    from parallel.cluster import load_cluster
    from parallel.perf import predict
    from parallel.workload import Workload

    c = load_cluster("hgx_h100_ib", nodes=1)
    from core.axes import Layout

    w = Workload(model_shape("debugmodel"), 256, 1, Layout(dp_shard=8), compile=True)
    eager = predict(w, c)
    graphed = predict(w.with_(cuda_graphs=True), c)
    assert eager.breakdown["host_launch_s"] > 0 and graphed.breakdown["host_launch_s"] == 0
    assert graphed.tokens_per_sec_per_gpu > eager.tokens_per_sec_per_gpu
    big = Workload(model_shape("70B"), 8192, 1, Layout(dp_shard=8), ac="full", compile=True)
    assert predict(big, c).breakdown["host_launch_s"] == 0  # GPU-bound: graphs change nothing


def test_auto_cuda_graphs_stay_off_under_expert_parallelism():
    """torchtitan refuses CUDA graphs with its all-to-all token dispatcher; "auto" must not
    turn them on for an MoE recipe with ep > 1 (it does for the same recipe at ep 1)."""
    from recipe.loader import load_recipe, uses_cuda_graphs

    one = load_recipe("recipes/moe_debug.toml", ["training.cuda_graphs=auto"])
    two = load_recipe(
        "recipes/moe_debug.toml",
        ["training.cuda_graphs=auto", "parallel.ep=2", "parallel.dp_shard=2"],
    )
    assert uses_cuda_graphs(one, pp=1) and not uses_cuda_graphs(two, pp=1)
