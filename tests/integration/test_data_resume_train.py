"""Through torchtitan's Trainer: a checkpoint saved at dp=2 resumes at dp=1 on the same data.

bfd packing (padding, split long documents, a packing buffer in the checkpoint). The
second leg's losses match an uninterrupted 1-process run, which holds only if the resumed
process continues the global row stream exactly where the two ranks left it.
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.runs import FAST, read_losses, run_train

pytestmark = pytest.mark.multiproc

TOL = 2e-4


@pytest.mark.slow  # measured: over 60 s on 2 loaded cores (#31)
def test_bfd_checkpoint_at_dp2_resumes_at_dp1(seed_checkpoint, tmp_path):
    common = [
        *FAST,
        "data.packing=bfd",
        "data.window=32",
        f"checkpoint.load_from={seed_checkpoint}",
    ]
    ref_dir = tmp_path / "ref"
    run_train(ref_dir, [*common, "training.local_batch_size=4"])
    reference = read_losses(ref_dir)

    run = tmp_path / "run"
    run_train(run, [*common, "checkpoint.interval=3", "training.local_batch_size=2"], nproc=2)
    first = read_losses(run)
    for step in (1, 2, 3):
        assert abs(first[step] - reference[step]) <= TOL, (step, first[step], reference[step])
    shutil.rmtree(run / "checkpoint" / "step-5")  # resume from step 3, not the end
    (run / "metrics.jsonl").rename(run / "first_leg.jsonl")
    run_train(run, [*common, "checkpoint.interval=3", "training.local_batch_size=4"])
    resumed = read_losses(run)
    assert sorted(resumed) == [4, 5], sorted(resumed)
    for step in (4, 5):
        assert abs(resumed[step] - reference[step]) <= TOL, (step, resumed[step], reference[step])
