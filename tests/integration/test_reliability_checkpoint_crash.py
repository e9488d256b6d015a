"""A real SIGKILL mid-save (a subprocess at the fault-injection seam) leaves the previous
checkpoint loadable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from runtime.checkpoint import (
    PARTIAL,
    committed_steps,
)
from tests.helpers.checkpoints import load_fresh
from tests.helpers.runs import ROOT, child_env
from tools.reliability_report import record

CRASH_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from tests.helpers.checkpoints import make_manager
    import torch
    mgr, model, ts = make_manager(__import__("pathlib").Path({folder!r}))
    for s in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(s))
        ts.kv = {{"step": s, "note": ""}}
        mgr.save(curr_step=s)   # TITANSCALE_FAULT kills this process inside the step-2 save
    print("not killed")
    """
)


def test_crash_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    """SIGKILL after the step-2 data is written, before its commit (the fault seam)."""
    script = CRASH_SCRIPT.format(root=str(ROOT), folder=str(tmp_path))
    env = {**child_env(), "TITANSCALE_FAULT": "kill:step=2:at=save"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert "fault injection: kill" in proc.stderr
    assert committed_steps(str(tmp_path)) == [1]
    assert (tmp_path / f"step-2{PARTIAL}" / ".metadata").exists()  # data written, not committed
    ok, model, ts = load_fresh(tmp_path)
    assert ok and ts.kv["step"] == 1 and float(model.weight.detach()[0, 0]) == 1.0
    assert not (tmp_path / f"step-2{PARTIAL}").exists(), "the partial save is cleared at start"
    # One fault, recovered by falling back (added to the checkpoint figures of the unit tier).
    record("checkpoint_faults", 1)
    record("checkpoint_fallbacks", 1)
