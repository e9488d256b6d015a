"""benchmarks/peers.py's loss claims, at its smallest size (not its timings): on the same
base and data, titanscale's step-0 loss equals the peer's within 1e-4 for LoRA SFT (TRL
SFTTrainer + PEFT, packing bfd and none: the packed rows and the cut padding of
data.loader.trim_padding) and for DPO through tools.serve (TRL DPOTrainer), and the DPO
sequence log-probs agree too (the DPO loss at step 0 is ln 2 for any implementation).
One peers.py run at what these claims need: a 5-step base, then the three pairs, one repeat
each, 3 SFT steps (step 0 compared, the losses move) and 2 DPO steps; the peers' runs and the
tinker DPO client share one worker process (--one-worker-process: TRL and torch imported once;
the timings that mode reports are not used). TRL stays the reference: its own trainers."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers.runs import ROOT, child_env

pytestmark = pytest.mark.slow  # 5 processes (base, 2 train.py, tools.serve, the peers')

TOL = 1e-4


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers")
    env = child_env()
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    cmd = [
        sys.executable,
        "benchmarks/peers.py",
        "--quick",
        "--one-worker-process",
        "--pairs",
        "sft_lora_packed,sft_lora_unpacked,dpo",
        "--base-steps",
        "5",
        "--work",
        str(tmp / "work"),
        "--out",
        str(tmp / "peers"),
        "--skyrl-python",
        "",
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads((tmp / "peers.json").read_text())
    assert (tmp / "peers.md").read_text().startswith("# titanscale side by side")
    return out["pairs"]


@pytest.mark.parametrize("pair", ["sft_lora_packed", "sft_lora_unpacked"])
def test_sft_step0_loss_matches_trl(report, pair):
    r = report[pair]
    assert "error" not in r, r.get("error")
    l0 = r["loss_step0"]
    assert l0["abs_diff"] < TOL, l0
    # A real comparison: a loss far from 0 that training moves on both sides.
    assert l0["ours"] > 1.0
    ours, peer = r["losses_by_step"]["ours"], r["losses_by_step"]["peer"]
    assert ours[-1] < ours[0] - 0.5 and peer[-1] < peer[0] - 0.5
    assert r["config"]["examples_per_step"] == (32 if pair == "sft_lora_packed" else 8)


def test_dpo_step0_matches_trl(report):
    r = report["dpo"]
    assert "error" not in r, r.get("error")
    assert r["loss_step0"]["abs_diff"] < TOL, r["loss_step0"]
    assert abs(r["loss_step0"]["ours"] - math.log(2)) < 1e-6  # policy = reference at step 0
    for k, v in r["logps_step0"].items():
        assert v["abs_diff"] < TOL, (k, v)
        assert v["ours"] < -1.0  # sequence log-probs of several tokens, not a degenerate 0
    # chosen and rejected differ, so the logps comparison is not of one number twice
    assert r["logps_step0"]["logps_chosen"]["ours"] != r["logps_step0"]["logps_rejected"]["ours"]
