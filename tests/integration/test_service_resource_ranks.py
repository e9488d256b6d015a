"""A model resource's ranks on two gloo processes, without the HTTP service.

The dispatcher (service/distributed.py) with a fake backend: a refusal on every rank fails
that operation alone; a rank slower than the per-operation deadline fails the operation
within the deadline and stops the resource (every later call fails at once with the same
sentence); the slow rank then finds rank 0 gone and exits with one line.

The sharded backend's generator (service/titan_backend.py): with the base gathered once per
request and gathered layer by layer per decode step, the samples, their logprobs and the
prompt logprobs equal an unsharded one-process backend's (the service test's resource uses
whichever its plan picks, the whole base on this machine)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.runs import ROOT, child_env, python

pytestmark = pytest.mark.multiproc


def test_slow_rank_fails_the_operation_within_the_deadline():
    env = dict(child_env(), OP_TIMEOUT_S="2", SLOW_S="6")
    cmd = [python(), "-m", "tools.torchrun", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "helpers" / "resource_worker.py")]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    line = next(x for x in p.stdout.splitlines() if x.startswith("{"))
    out = json.loads(line)
    assert out["echo(5,)"]["value"] == 5
    assert out["refuse()"] == {**out["refuse()"], "status": 400, "type": "ServiceError"}
    assert "refused the same way" in out["refuse()"]["error"]
    assert out["echo(6,)"]["value"] == 6  # a refusal leaves the resource serving
    slow = out["slow()"]
    assert slow["type"] == "ResourceBroken" and "did not finish slow within 2 s" in slow["error"]
    assert slow["s"] < 6  # the deadline, not the slow rank, ended the wait
    assert out["echo(7,)"]["error"] == slow["error"] and out["echo(7,)"]["s"] < 1
    assert out["broken"] == slow["error"]
    lost = [x for x in p.stderr.splitlines() if "resource rank 1: lost" in x]
    assert len(lost) == 1 and lost[0].startswith("error: "), p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_sharded_decode_equals_one_process_both_ways():
    cmd = [python(), "-m", "tools.torchrun", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "helpers" / "resource_decode_worker.py")]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("{")))
    for how in ("whole", "per_layer"):
        assert out[how]["same_tokens"], out
        assert out[how]["max_logprob_diff"] < 1e-5 and out[how]["max_prompt_logprob_diff"] < 1e-5
