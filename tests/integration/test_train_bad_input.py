"""train.py as a user runs it: bad input exits 2 with one line, no traceback."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.runs import ROOT


def test_train_py_bad_input_exits_2_without_traceback(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('[parallel]\ntp = "x"\n')
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--recipe", str(p)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "parallel.tp" in proc.stderr and str(p) in proc.stderr
