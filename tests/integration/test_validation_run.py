"""[validation]: torchtitan's validator through a recipe. A 4-step run validating at steps
1, 2 and 4 writes val loss and perplexity to metrics.jsonl and TensorBoard, and its training
losses equal a run without validation (validation neither trains nor moves the data
stream). Two 1-process runs, debug model, seq 64: ~30 s."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.runs import run_train

pytestmark = pytest.mark.slow  # training runs: ~30-120 s on 2 shared cores

RUN = [
    "training.seq_len=64",
    "training.steps=4",
    "training.warmup_steps=1",
    "metrics.summary_skip_steps=0",
]


def _records(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]


def test_validation_loss_in_metrics_and_training_untouched(tmp_path):
    val = tmp_path / "val"
    run_train(val, [*RUN, "validation.enable=true", "validation.every=2", "validation.steps=2"])
    plain = tmp_path / "plain"
    run_train(plain, [*RUN, "metrics.tensorboard=false"])
    recs = _records(val)
    vals = [r for r in recs if r.get("event") == "validation"]
    assert [r["step"] for r in vals] == [1, 2, 4]
    for r in vals:
        assert math.isfinite(r["val_loss"]) and 0 < r["val_loss"] < 20
        assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]))
    # The model learns the (seen) validation rows: loss at step 4 below step 1's.
    assert vals[-1]["val_loss"] < vals[0]["val_loss"]
    train_val = {r["step"]: r["loss"] for r in recs if "event" not in r}
    train_plain = {r["step"]: r["loss"] for r in _records(plain) if "event" not in r}
    assert train_val == pytest.approx(train_plain, abs=1e-6)
    # TensorBoard got the validation scalars too.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tb,) = list((val / "tb").iterdir())
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert {"validation/loss", "validation/perplexity"} <= set(acc.Tags()["scalars"])
    tb_loss = [e.value for e in acc.Scalars("validation/loss")]
    assert tb_loss == pytest.approx([r["val_loss"] for r in vals], rel=1e-6)
