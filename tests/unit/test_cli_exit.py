"""tools.cli.run in a process that imported torch ends through exit_process: main's code,
atexit handlers run, non-daemon threads joined, buffered output flushed (docs/reliability.md,
"A run that succeeded must exit 0")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from tools.cli import ROOT, run

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time, types
    sys.modules.setdefault("torch", types.ModuleType("torch"))  # as if torch were imported
    from tools.cli import run

    def late():
        time.sleep(0.3)
        print("thread joined")

    def main():
        atexit.register(lambda: print("atexit ran"))
        threading.Thread(target=late).start()
        print("buffered", end="")  # no newline: still in the buffer at os._exit
        {ending}

    run(main)
    """
)


def _run(ending: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(ending=ending)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_return_code_atexit_threads_and_buffers_survive():
    p = _run("return 3")
    assert p.returncode == 3, p.stderr
    assert p.stdout == "bufferedthread joined\natexit ran\n"


def test_sys_exit_inside_main_keeps_its_code_and_message():
    p = _run("sys.exit('one line')")
    assert p.returncode == 1
    assert p.stderr.strip() == "one line"
    p = _run("sys.exit(0)")
    assert p.returncode == 0, p.stderr


def test_run_called_in_process_raises_instead_of_ending_the_process(monkeypatch):
    """A test calling run() (main not defined in __main__) gets SystemExit, even with torch
    imported: os._exit here would end pytest itself with main's code and no summary."""
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or types.ModuleType("t"))
    with pytest.raises(SystemExit) as e:
        run(lambda: 3)
    assert e.value.code == 3
