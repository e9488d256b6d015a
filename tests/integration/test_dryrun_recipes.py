"""Every shipped recipe dry-runs (tools.dryrun) at its own world size, on the ranks that cover
its first and last pipeline stage (the command's main() in this process, each rank in a
fresh process of its own, as the command runs it); the measured rank is held to the memory
model and to the performance model's FSDP volumes; tools.launch --dry-run-rank refuses a
job whose rank does not survive its step. Slow: up to a minute of CPU per large recipe
(docs/dryrun.md, "Cost"); the figures themselves are benchmarks/dryrun.md."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.models import stages_per_rank
from recipe.loader import load_recipe
from tests.helpers.runs import child_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# Pipeline recipes run 2p of their microbatches: the schedules hold at most 2p stage-
# microbatches (the peak is reached), at a fraction of the cost (docs/dryrun.md).
# The DualPipeV recipes run rank 0 alone (half the cost, ~80 s each at load 5): a V schedule
# puts the first and the last stage on rank 0 (asserted below), rank 0 is the measured peak
# (70B: 71.8 GiB against 68.7 on rank 255), and what differs on the last rank, its held
# and deferred counts, is tests/unit/test_dryrun.py's against torch's own schedule orders.
EXTRA = {
    "llama3_70b": ["--microbatches=8", "--rank=0"],
    "llama3_70b_h100": ["--microbatches=16", "--rank=0"],
    "gpu_slice_70b": ["--cluster=hgx_h200_ib"],  # one GPU of the lent machine's kind
}
# Where the memory model may stay further from the measurement, and why (benchmarks/dryrun.md).
# (The LoRA recipes were here until the dry run showed their base training under activation
# checkpointing; runtime.build.keep_frozen now keeps it frozen.)
EXPLAINED: dict[tuple[str, int], str] = {
    ("gpt_oss_120b", 0): "planner 93.2 GiB against 110.9 measured (-15.9%), not yet explained "
    "(benchmarks/dryrun.md, MoE section): GPT-OSS's sinks and expert biases are not counted "
    "tensor by tensor",
}
# RL recipes step one update on the step layer (tools.dryrun.posttrain) against tools.predict's
# post-training figure: async RL also holds the staged, gathered float32 weights while it
# trains (benchmarks/dryrun.md, "Post-training step"), which the memory model does not count.
EXPLAINED[("rl_llama3_8b", 0)] = (
    "planner 62.8 GiB against 76.4 measured (-17.8%): async RL's staged weights (15.0 GiB "
    "in the generator's bfloat16) and one prompt's 8 samples of KV cache beyond the token "
    "budget are not in parallel.memory.posttrain_memory (benchmarks/dryrun.md)"
)
# Recipes whose dry run fails, with what it found (strict: the test fails once they step).
FAILS: dict[str, str] = {
    "rl_qwen3_30b_a3b": "the native generator's fresh copy of an EP model (parallel.ep = 2) "
    "carries torchtitan's all-to-all dispatcher with no EP mesh: its first forward fails "
    "(token_dispatcher.py: 'NoneType' object has no attribute 'get_group'); found by the "
    "RL dry run, not yet checked in a real run (benchmarks/dryrun.md)",
}
MEMORY_TOL_PCT = 10.0
# MoE GPU recipes whose dry run costs more than the suite can pay (DeepSeek-V3 671B at 256
# ranks: 684 s on 2 cores; GPT-OSS 120B and Qwen3 235B: over a minute each) or is not yet
# measured: their figures are benchmarks/dryrun.md's (MoE section, with the command), and
# expert parallelism under the dry run is held to the model by
# test_moe_expert_parallel_at_the_smallest_world and by qwen3_30b_a3b (32 ranks, EP 4) below.
# sft_qwen3_30b_a3b_lora (issue 35: 8 ranks, EP 2, LoRA on routed experts): 87 s on 2 cores.
BENCHMARK_ONLY = {"deepseek_v3_671b", "gpt_oss_120b", "qwen3_235b_a22b", "moonlight_16b_a3b",
                  "sft_qwen3_30b_a3b_lora"}  # fmt: skip
SHIPPED = sorted(p.stem for p in (ROOT / "recipes").glob("*.toml") if p.stem not in BENCHMARK_ONLY)


@pytest.fixture(autouse=True)
def _worker_env(monkeypatch):
    """The environment child_env gives a subprocess, for the dry run's rank processes."""
    monkeypatch.chdir(ROOT)
    for k, v in child_env().items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


def dry_run(*args: str) -> tuple[int, str, dict[str, Any]]:
    """`python -m tools.dryrun ARGS --json` as its main() in this process: (exit code, stderr,
    the report). Each rank still steps in a fresh process of its own (tools.dryrun's
    workers); the command's own interpreter, its torch and torchtitan imports and the
    recipe's checks (~5 CPU-s a command) are this process's, paid once for the file."""
    from tools.dryrun.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*args, "--json"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    text = out.getvalue()
    return code, err.getvalue(), json.loads(text) if text.strip() else {}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=FAILS[n])) if n in FAILS else n
     for n in SHIPPED],
)  # fmt: skip
def test_shipped_recipe_builds_and_steps_at_its_world_size(name):
    recipe = load_recipe(str(ROOT / "recipes" / f"{name}.toml"))
    code, err, out = dry_run(f"--recipe=recipes/{name}.toml", *EXTRA.get(name, []))
    assert code == 0, err[-3000:] + json.dumps(out.get("ranks"))[-3000:]
    if recipe.parallel.world_size:
        assert out["world_size"] == recipe.parallel.world_size
    pp = out["layout"]["pp"]
    par = recipe.parallel
    last = pp * stages_per_rank(par.pp_schedule, par.pp_stages_per_rank) - 1 if pp > 1 else 0
    stages = {s for r in out["ranks"] for s in r["stages"]}
    assert {0, last} <= stages, stages  # first and last stage (V schedules: both on rank 0)
    for r in out["ranks"]:
        assert "error" not in r, r
        # What issue 28 asks to see, as keys of each rank's entry (the 405B at 512 ranks too).
        assert {"world_size", "peak_gib", "planned_gib"} <= set(r)
        assert r["world_size"] == out["world_size"] and r["peak_gib"] > 0 and r["planned_gib"] > 0
        gpu = out["gpu"] != "cpu"
        if gpu and (name, r["rank"]) not in EXPLAINED:
            assert abs(r["error_pct"]) <= MEMORY_TOL_PCT, (r["rank"], r["error_pct"], r["planned"])
        # FSDP's gathered bytes: torchtitan's per-block all-gathers against the perf model's
        # stage volume (the model's one home for it), within 5%, without pipelining.
        fsdp = r["collectives"].get("fsdp.all_gather")
        lora = recipe.finetune.mode == "lora"  # adapters' gathers: priced by issue 23's terms
        # An RL update gathers the weights for each of its passes and for the push to the
        # generator (tools.dryrun.posttrain); the perf model's volume is a Trainer step's.
        if pp == 1 and not lora and not recipe.rl.enabled and fsdp and fsdp["predicted_gib"]:
            # MoE under EP: the experts are gathered on torchtitan's efsdp groups.
            efsdp = r["collectives"].get("efsdp.all_gather", {"measured_gib": 0.0})
            measured = fsdp["measured_gib"] + efsdp["measured_gib"]
            assert measured == pytest.approx(fsdp["predicted_gib"], rel=0.05)
        a2a = r["collectives"].get("ep.all_to_all")
        if a2a:  # the expert all-to-all's bytes (its count adds torchtitan's token counts)
            assert a2a["measured_gib"] == pytest.approx(a2a["predicted_gib"], rel=0.05)


def test_moe_expert_parallel_at_the_smallest_world():
    """The DeepSeek-V3 debug model with EP 2 over 2 ranks: the all-to-all on the ep group
    with the performance model's bytes, the experts' FSDP traffic on efsdp (issue 34)."""
    code, err, out = dry_run("--recipe=recipes/moe_debug.toml", "--set=parallel.ep=2",
                             "--set=parallel.dp_shard=2", "--set=parallel.world_size=2")  # fmt: skip
    assert code == 0, err[-3000:] + json.dumps(out.get("ranks"))[-3000:]
    (r,) = out["ranks"]
    assert "error" not in r, r
    assert r["world_size"] == 2 and r["peak_gib"] > 0 and r["planned_gib"] > 0
    a2a = r["collectives"]["ep.all_to_all"]
    assert a2a["measured_gib"] == pytest.approx(a2a["predicted_gib"], rel=0.05)
    assert a2a["measured_count"] >= a2a["predicted_count"] > 0


def test_70b_h100_grown_to_4096_gpus():
    code, err, out = dry_run("--recipe=recipes/llama3_70b_h100.toml", "--nodes=512",
                             "--set=training.global_batch_size=2048", "--microbatches=16",
                             "--rank=0")  # fmt: skip
    assert code == 0, err[-3000:] + json.dumps(out.get("ranks"))[-3000:]
    assert out["world_size"] == 4096 and out["layout"]["dp_shard"] == 64
    (r,) = out["ranks"]
    assert r["world_size"] == 4096 and r["peak_gib"] > 0 and r["planned_gib"] > 0
    assert abs(r["error_pct"]) <= MEMORY_TOL_PCT, (r["error_pct"], r["planned"])  # +1.1% seen


def launch(*extra: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tools.launch", *LAUNCH, *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


LAUNCH = ["--recipe", "recipes/debug.toml", "--cluster", "local_cpu", "--nodes", "1", "--dry-run"]


def test_launch_refuses_a_job_whose_rank_dies_in_its_dry_run():
    from tools.launch import main
    from tools.reliability_report import record_case

    # The accepted job in this process (its rank steps in a process of its own); the refused
    # one as the user runs it: its exit code and its whole stderr are the claim.
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main([*LAUNCH, "--dry-run-rank", "0"]) == 0, err.getvalue()[-2000:]
    assert "dry run: rank 0 builds and steps at world 8" in err.getvalue()
    assert "#SBATCH" in out.getvalue()
    env = child_env()
    env["TITANSCALE_FAULT"] = "kill:rank=0:step=1"  # runtime.faults: SIGKILL mid-step
    bad = launch("--dry-run-rank", "0", env=env)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert lines[0].startswith("error: --dry-run-rank: rank 0 does not build or step")
    assert "#SBATCH" not in bad.stdout  # refused before any script
    record_case("tools.launch", "job that fails its dry run")
