"""One process in float32 trains without FSDP2 (runtime.build `unsharded_when_alone`), exactly
as it did with it, and its checkpoints stay interchangeable with sharded layouts.

- Full fine-tune from the seed checkpoint, 5 steps, in one process: as built, the model's
  parameters are plain tensors; with FSDP2 forced back on (torchtitan's parallelize function
  unchanged) they are DTensors. Loss and grad norm agree at every step to float32 rounding
  (measured: bit-identical): the reference is torchtitan's own FSDP path.
- LoRA in one process with activation checkpointing: plain tensors, and only the adapters
  train (keep_frozen still holds the base frozen after spmd-types re-registers every
  parameter and the checkpoint wrapper renames them).
- The one-process run's step-3 checkpoint (plain tensors, model and AdamW state) resumes
  under FSDP2 at 2 processes and repeats steps 4 and 5 to the layout tests' tolerance
  (the other direction, dp=2 -> dp=1: tests/integration/test_data_resume_train.py).
Each run is its own process (it starts a one-process gloo group): ~10 s each.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.runs import FAST, ROOT, child_env, python, read_losses, run_train

pytestmark = pytest.mark.slow  # four training processes, ~50 s on 2 shared cores

WORKER = Path(__file__).with_name("_one_process_worker.py")
SAME = 1e-6  # float32 rounding; measured 0 (the same operations in the same order)
TOL = 2e-4  # the layout tests' bound across process counts: float reduction order only


def _run(tmp: Path, seed: str, mode: str, *extra: str) -> dict:
    proc = subprocess.run(
        [python(), str(WORKER), str(tmp), seed, mode, *extra],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    out["steps"] = {int(k): v for k, v in out["steps"].items()}
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory, seed_checkpoint) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("plain")
    return work, _run(work, seed_checkpoint, "plain", "checkpoint.interval=3")


def test_one_process_skips_fsdp_with_the_same_steps(plain, seed_checkpoint, tmp_path):
    _, ours = plain
    fsdp = _run(tmp_path, seed_checkpoint, "fsdp")
    assert ours["kinds"] == ["Parameter"], ours["kinds"]
    assert fsdp["kinds"] == ["DTensor"], fsdp["kinds"]
    assert ours["trainable"] == fsdp["trainable"]
    assert sorted(ours["steps"]) == sorted(fsdp["steps"]) == [1, 2, 3, 4, 5]
    for step, (loss, norm) in fsdp["steps"].items():
        got_loss, got_norm = ours["steps"][step]
        assert abs(got_loss - loss) <= SAME, (step, got_loss, loss)
        assert abs(got_norm - norm) <= SAME * max(1.0, norm), (step, got_norm, norm)
    assert ours["steps"][5][0] < ours["steps"][1][0]  # it trains


def test_one_process_lora_keeps_the_base_frozen(seed_checkpoint, tmp_path):
    # With activation checkpointing: the unsharded path applies it itself, and its wrapper
    # renames every block's parameters (keep_frozen must still match them, via plain_fqn).
    out = _run(
        tmp_path, seed_checkpoint, "plain", "finetune.mode=lora", "training.steps=2",
        "training.activation_checkpoint=full",
    )  # fmt: skip
    assert out["kinds"] == ["Parameter"], out["kinds"]
    assert any("_checkpoint_wrapped_module" in n for n in out["trainable"]), out["trainable"]
    assert out["trainable"] and all(".lora_" in n for n in out["trainable"]), out["trainable"]
    assert sorted(out["steps"]) == [1, 2]


@pytest.mark.multiproc
def test_one_process_checkpoint_resumes_under_fsdp2(plain, seed_checkpoint, tmp_path):
    work, ours = plain
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(work / "checkpoint" / "step-3", ckpt / "step-3")
    common = [*FAST, f"checkpoint.load_from={seed_checkpoint}", "checkpoint.interval=3"]
    run_train(tmp_path, [*common, "training.local_batch_size=1"], nproc=2)
    resumed = read_losses(tmp_path)
    assert sorted(resumed) == [4, 5], f"resumed steps {sorted(resumed)}"
    for step in (4, 5):
        assert abs(resumed[step] - ours["steps"][step][0]) <= TOL, (step, resumed, ours)
