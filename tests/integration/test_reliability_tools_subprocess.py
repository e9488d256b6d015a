"""A few planning-tool cases as real processes (`python -m tools.X`), as a user runs them:
exit 2, the last stderr line is our one line, no traceback, no torch warning before it, and
an answer within a generous hang guard (the planner's divisor search used to run forever on
`--nodes 10**15`). The same classes are fuzzed in-process by
tests/unit/test_reliability_tools.py. About 10 s on a quiet 2-core machine (20 s under load;
most of it is importing torchtitan in the case that reaches the kernel check).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.runs import ROOT
from tools.reliability_report import record_case

HANG_GUARD_S = 120  # a loaded machine imports torch slowly; the bug was "never finishes"


def tool(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )


def _empty(tmp_path):
    p = tmp_path / "empty.toml"
    p.write_text("")
    return str(p)


def _cycle(tmp_path):
    p = tmp_path / "cycle.toml"
    p.write_text(
        'gpu = "H100"\nnodes = 2\ngpus_per_node = 8\n'
        '[[topology.switches]]\nname = "leaf"\nnodes = "n[0-1]"\n'
        '[[topology.switches]]\nname = "a"\nswitches = "b"\n'
        '[[topology.switches]]\nname = "b"\nswitches = "a"\n'
    )
    return str(p)


CASES = [
    ("tools.plan", lambda t: ["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--nodes",
                              str(10**15)], "--nodes", "hang (huge size)"),
    ("tools.plan", lambda t: ["--recipe", "debug", "--cluster", _empty(t)], "missing",
     "nonsense accepted"),
    ("tools.launch", lambda t: ["--recipe", "debug", "--cluster", _cycle(t), "--nodes", "1",
                                "--dry-run"], "switch cycle", "nonsense accepted"),
    ("tools.predict", lambda t: ["--recipe", "llama3_70b_h100", "--cluster", "hgx_h100_ib",
                                 "--set", "kernels.linear=mxfp8"], "kernels.linear",
     "kernel capability"),
    ("tools.predict", lambda t: ["--recipe", "debug", "--cluster", "hgx_h100_ib", "--nodes",
                                 "abc"], "--nodes", "bad argument"),
    # No arguments: one line, not argparse's 8-line usage block.
    ("tools.prepare_data", lambda t: [], "--source, --tokenizer, --out", "bad argument"),
    ("tools.prepare_data", lambda t: ["--source", "stdlib", "--tokenizer", "embedded",
                                      "--vocab-size", "-5", "--out", str(t / "s")],
     "--vocab-size", "bad argument"),
]  # fmt: skip


@pytest.mark.parametrize("entry,argv,needle,kind", CASES, ids=[c[3] + "-" + c[0] for c in CASES])
def test_planning_tool_subprocess_one_line(entry, argv, needle, kind, tmp_path):
    p = tool(entry, *argv(tmp_path))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    record_case(entry, kind)
