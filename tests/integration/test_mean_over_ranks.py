"""runtime.rank_mean.mean_over_ranks with ranks reporting different metric keys (a rank whose
rollouts all failed trains nothing): each key is the mean over the ranks that report it,
checked against the hand-computed means on 2 gloo processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.runs import ROOT, child_env, free_port

pytestmark = pytest.mark.multiproc

WORKER = """
import json, sys
import torch.distributed as dist
from runtime.rank_mean import mean_over_ranks
dist.init_process_group("gloo")
rank = dist.get_rank()
mine = {"a": 1.0, "b": 4.0, "kl": 0.5} if rank == 0 else {"a": 3.0, "reward_mean": 0.25}
out = mean_over_ranks(mine)
empty = mean_over_ranks({})
if rank == 0:
    print(json.dumps({"out": out, "empty": empty}))
dist.destroy_process_group()
from tools.cli import exit_process
exit_process(0)  # past gloo's worker threads (its docstring)
"""


def test_keys_reported_by_some_ranks_average_over_those_ranks(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = child_env()
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", str(script)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["out"] == {"a": 2.0, "b": 4.0, "kl": 0.5, "reward_mean": 0.25}
    assert got["empty"] == {}
