"""The MoE post-training recipes through train.py, shortened: RL with Rollout Routing Replay
writes router_agreement and the train/inference KL with and without replay for every update,
and LoRA SFT on attention + routed experts lowers the held-out loss (nll per trained token,
the `heldout` events before and after training)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import child_env

pytestmark = pytest.mark.slow  # two CPU trainings of a 64-expert debug MoE: ~2 min on 2 cores

ROOT = Path(__file__).resolve().parents[2]


def _train(recipe: str, out: Path, *sets: str) -> list[dict]:
    argv = [sys.executable, "train.py", "--recipe", recipe, "--set", f"job.output_dir={out}"]
    for s in sets:
        argv += ["--set", s]
    p = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                       timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_rl_moe_debug_with_routing_replay(tmp_path):
    recs = _train("recipes/rl_moe_debug.toml", tmp_path / "rl", "rl.routing_replay=true",
                  "training.steps=2", "rl.sft_warmup_steps=1", "rl.prompts_per_step=2",
                  "rl.group_size=2", "rl.eval_prompts=2")  # fmt: skip
    updates = [r for r in recs if "step" in r and "event" not in r]
    assert [r["step"] for r in updates] == [1, 2]
    for r in updates:
        assert 0.0 <= r["router_agreement"] <= 1.0
        # same weights, float32, same engine: replayed and own routing agree
        assert r["train_infer_kl_replay"] < 1e-6 and r["train_infer_kl_no_replay"] >= 0.0


def test_sft_moe_debug_heldout_loss_falls(tmp_path):
    recs = _train("recipes/sft_moe_debug.toml", tmp_path / "sft", "training.steps=10",
                  "checkpoint.interval=10")  # fmt: skip
    held = [r for r in recs if r.get("event") == "heldout"]
    assert [h["step"] for h in held] == [0, 10]
    assert held[1]["nll_per_trained_token"] < held[0]["nll_per_trained_token"] - 1.0, held
    export = tmp_path / "sft" / "export" / "sft_moe_debug"
    assert (export / "adapter_model.safetensors").is_file()
    assert (export / "routed_experts_lora.safetensors").is_file()  # the experts' pairs
    # The frozen router's expert bias (a buffer torchtitan's load-balancing hook moves every
    # step) has not moved from its initial zeros under LoRA (runtime.build.keep_frozen).
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "sft" / "checkpoint" / "step-10", tmp_path / "ck.pt")
    sd = torch.load(tmp_path / "ck.pt", weights_only=False)
    bias = [v for k, v in sd.get("model", sd).items() if k.endswith("expert_bias_E")]
    assert bias and all(float(b.abs().max()) == 0.0 for b in bias)
