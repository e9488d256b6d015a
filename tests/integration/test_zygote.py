"""The suite's preloaded interpreter (tests/helpers/zygote.py) behaves like the real one for
what the tests read: the exit code and stderr of a refused run, death by a signal sent to
it, the program's death with its shim, and the real interpreter for programs outside its
list. Reference: the same command under sys.executable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import zygote
from tests.helpers.runs import ROOT, child_env

pytestmark = pytest.mark.skipif(
    os.environ.get("TITANSCALE_TEST_ZYGOTE") == "0", reason="TITANSCALE_TEST_ZYGOTE=0"
)


def _forks() -> list[int]:
    """The server's children: the programs it is running now."""
    server = zygote._state["server"]
    assert isinstance(server, subprocess.Popen)
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == server.pid:
            kids.append(int(stat.parent.name))
    return kids


def test_refused_run_exits_and_prints_as_the_real_interpreter(tmp_path):
    cmd = ["train.py", "--set", f"job.output_dir={tmp_path}", "--set", "training.stepz=2"]
    real = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    shim = subprocess.run([zygote.python(), *cmd], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert real.returncode == shim.returncode == 2
    errors = [[ln for ln in p.stderr.splitlines() if ln.startswith("error")] for p in (real, shim)]
    assert errors[0] == errors[1] and len(errors[0]) == 1, errors
    assert real.stdout == shim.stdout


def test_signals_reach_the_program_and_its_end_is_mirrored(tmp_path):
    sets = ["training.steps=100000", "training.seq_len=32", "metrics.tensorboard=false"]
    args = ["train.py", "--set", f"job.output_dir={tmp_path}"]
    for s in sets:
        args += ["--set", s]

    def started(python: str) -> subprocess.Popen:
        p = subprocess.Popen([python, *args], cwd=ROOT, env=child_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        assert p.stdout is not None
        for line in p.stdout:  # up to its first step: the program, not the interpreter, runs
            if "step    1" in line:
                return p
        raise AssertionError(f"exited {p.wait()} before its first step")

    # SIGTERM: forwarded; the shim ends as the real process does.
    ends = []
    for python in (sys.executable, zygote.python()):
        p = started(python)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        ends.append(p.returncode)
    assert ends[0] == ends[1] != 0, ends
    # SIGKILL can't be forwarded: the program notices its shim's end and dies too.
    p = started(zygote.python())
    assert len(_forks()) == 1
    p.kill()
    p.communicate(timeout=60)
    end = time.monotonic() + 30
    while _forks() and time.monotonic() < end:
        time.sleep(0.1)
    assert _forks() == []


def test_programs_outside_its_list_run_in_the_real_interpreter():
    code = "import sys; print('torch' in sys.modules, sys.argv[1:])"
    p = subprocess.run([zygote.python(), "-c", code, "a"], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0 and p.stdout.split() == ["False", "['a']"], p.stdout + p.stderr
