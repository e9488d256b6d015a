"""Real 2-process torchrun jobs through `python -m tools.torchrun` (the launcher the job script
and the README use): bad input is printed once with exit 2 and no torchrun traceback; any
other failure is one line per failed rank with the failing rank's exit code, no traceback.
Every job here fails before a process group, so each takes seconds (~30 s together, loaded).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.runs import ROOT, child_env
from tools.reliability_report import record_case

pytestmark = pytest.mark.multiproc


def torchrun(tmp_path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tools.torchrun", "--nproc_per_node=2", *args]
    env = child_env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def no_launcher_traceback(p: subprocess.CompletedProcess[str]) -> None:
    both = p.stdout + p.stderr
    assert "Traceback" not in both and "ChildFailedError" not in both, both[-3000:]


def test_tp_larger_than_world_is_one_line_exit_2(tmp_path):
    """The issue's case: tp = 4 on 2 processes. Each rank finds it after importing torch."""
    p = torchrun(tmp_path, "train.py", "--recipe", "recipes/debug.toml", "--set", "parallel.tp=4",
                 "--set", f"job.output_dir={tmp_path / 'run'}")  # fmt: skip
    assert p.returncode == 2, p.stderr[-3000:]
    no_launcher_traceback(p)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        # The value that broke the check came from --set, so the line names it, not the file.
        "error: --set parallel.tp=4: parallel.dp_shard: dp_replicate x cp x tp x pp = 4 does not "
        "divide the world size 2"
    ], p.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    record_case("torchrun", "bad input on every rank")


def test_bad_override_is_exactly_one_line(tmp_path):
    """Found before torch is imported: stderr is that one line and nothing else."""
    p = torchrun(tmp_path, "train.py", "--set", "training.steps=x")
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: --set training.steps=x: training.steps:"
    ), p.stderr
    assert p.stdout == ""
    record_case("torchrun", "bad input on every rank")


def test_other_failures_summarised_with_the_childs_exit_code(tmp_path):
    """Rank 1 exits 3 while rank 0 waits: one line per failed rank, exit 3, no traceback."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n"
    )
    p = torchrun(tmp_path, str(script))
    assert p.returncode == 3, p.stderr[-3000:]
    no_launcher_traceback(p)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("torchrun:")]
    assert any("rank 1 (local rank 1)" in ln and "exit 3" in ln for ln in lines), p.stderr
    assert all("rank 0" not in ln or "stopped by torchrun" in ln for ln in lines), p.stderr
    record_case("torchrun", "child failure (not bad input)")


def test_signal_to_the_launcher_is_one_line(tmp_path):
    """scancel or a time limit sends SIGTERM to the launcher: torch raises SignalException
    (plain torchrun: a traceback); the wrapper stops the ranks and says so, exit 128 + 15."""
    import os
    import signal
    import time

    script = tmp_path / "wait.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(tmp_path)!r}, 'up-' + os.environ['RANK']).touch()\n"
        "time.sleep(120)\n"
    )
    env = child_env()
    cmd = [sys.executable, "-m", "tools.torchrun", "--nproc_per_node=2", str(script)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"up-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and p.poll() is None, "ranks did not start"
            time.sleep(0.2)
        os.kill(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in out + err and "SignalException" not in out + err, err[-3000:]
    assert "torchrun: stopped by SIGTERM; the ranks were stopped" in err.splitlines(), err
    record_case("torchrun", "launcher signalled")
