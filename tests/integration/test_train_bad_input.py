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


def test_train_py_refuses_a_kernel_this_device_cannot_run(tmp_path):
    """End to end: varlen attention needs a CUDA GPU with FlashAttention; on this CPU machine
    train.py stops before any process group with exit 2 and one line naming the key and why."""
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has a GPU: the CPU refusal is what is under test")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--set", "kernels.attention=varlen",
         "--set", f"job.output_dir={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "kernels.attention" in last and "varlen" in last, last
    assert not any(tmp_path.iterdir()), "nothing written before the refusal"
