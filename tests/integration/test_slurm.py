"""tools.launch on a real Slurm: Debian's packages, 4 emulated nodes, 2 leaf switches.

The session fixture brings the cluster up with tools/slurmlab/up.sh (installing slurmctld,
slurmd, slurm-client and munge with apt-get when missing: needs root and the Debian
registry) and always tears it down with down.sh, which also restores /etc/hosts and
/etc/slurm. Leaves are interleaved (leaf1 = node1,node3; leaf2 = node2,node4), so node-name
order (what SLURM_NODEID follows) and switch order differ.

Jobs run the debug recipe on 4 nodes x 2 CPU processes through the generated sbatch script.
About 4-5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.axes import Layout
from launch.slurm import fabric_from_slurm
from launch.topology import topology_order
from parallel.cluster import load_cluster
from parallel.placement import planned_rank_order
from tests.helpers.runs import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LAB = ROOT / "tools" / "slurmlab"
BASE = "/tmp/titanscale-slurmlab"
PROFILE = ROOT / "clusters" / "slurmlab_cpu.toml"
# Small and short: 8 ranks share 2 cores. Checkpoints every 2 steps so a requeue resumes.
TRAIN = (
    "training.seq_len=128",
    "training.local_batch_size=1",
    "training.steps=8",
    "training.warmup_steps=2",
    "checkpoint.interval=2",
    "checkpoint.keep_latest=0",
    "metrics.tensorboard=false",
)
EXPECTED_ORDER = ["node1", "node3", "node2", "node4"]  # spine.leaf1.*, then spine.leaf2.*


def _slurm_env() -> dict[str, str]:
    return dict(os.environ, SLURM_CONF=f"{BASE}/etc/slurm.conf")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=_slurm_env(), **kw)


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip("bringing up Slurm needs root (apt-get, /etc/hosts, daemons as root)")
    hosts_before = Path("/etc/hosts").read_text()
    env = dict(
        os.environ,
        SLURMLAB_BASE=BASE,
        SLURMLAB_NODES="4",
        SLURMLAB_NODES_PER_LEAF="2",
        SLURMLAB_LEAF_LAYOUT="interleaved",
        SLURMLAB_CPUS="2",
    )
    # A cluster left by a killed earlier session would hold the ports: clear it first.
    subprocess.run([str(LAB / "down.sh")], env=env, capture_output=True, timeout=120)
    try:
        up = subprocess.run(
            [str(LAB / "up.sh")], env=env, capture_output=True, text=True, timeout=600
        )
        assert up.returncode == 0, f"up.sh failed:\n{up.stdout}\n{up.stderr}"
        yield BASE
    finally:
        down = subprocess.run(
            [str(LAB / "down.sh")], env=env, capture_output=True, text=True, timeout=120
        )
        assert down.returncode == 0, down.stderr
        assert Path("/etc/hosts").read_text() == hosts_before, "/etc/hosts not restored"
        assert not Path(BASE).exists()


def _job(job_id: str) -> dict[str, str]:
    out = _run(["scontrol", "-o", "show", "job", job_id]).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _logs(out: Path) -> str:
    """The job's logs and Slurm's own, for a failure message (down.sh removes Slurm's)."""
    text = []
    files = sorted((out / "logs").glob("*.out")) + sorted(Path(BASE, "log").glob("*.log"))
    for f in files:
        text.append(f"==== {f}\n" + f.read_text(errors="replace")[-3000:])
    return "\n".join(text)


def _wait(job_id: str, out: Path, until, timeout: float, what: str) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        j = _job(job_id)
        if until(j):
            return j
        if j.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.5)
    _run(["scancel", job_id])
    pytest.fail(f"job {job_id}: {what} not reached ({_job(job_id).get('JobState')})\n{_logs(out)}")


def _launch(out: Path, *extra: str) -> str:
    cmd = [
        sys.executable, "-m", "tools.launch", "--recipe", str(ROOT / "recipes" / "debug.toml"),
        "--cluster", str(PROFILE), "--nodes", "4", "--time", "00:15:00",
        "--signal-seconds", "60", "--switch-wait", "00:01:00", "--out", str(out), *extra,
    ]  # fmt: skip
    for o in TRAIN:
        cmd += ["--set", o]
    p = _run(cmd, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    m = re.search(r"submitted job (\d+)", p.stdout)
    assert m, p.stdout
    return m.group(1)


def _losses(out: Path) -> tuple[dict[int, float], list[dict]]:
    """Last logged loss per step (a requeued run logs some steps twice), and start events."""
    losses, starts = {}, []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "start":
            starts.append(rec)
        elif "loss" in rec and "step" in rec:
            losses[int(rec["step"])] = float(rec["loss"])
    return losses, starts


def _nodes_idle() -> bool:
    states = _run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split("\n")
    return len([ln for ln in states if ln.strip().endswith(" idle")]) == 4


def _expedite(job_id: str, out: Path) -> None:
    """Slurm holds a requeued job for ~2 minutes (BeginTime); start it sooner. Not at once:
    slurmd refuses to launch a job id whose previous credential it revoked in the same
    second ("Job credential revoked": the job FAILS), and the last incarnation must have
    left every node. The two minutes normally cover both. Ten seconds, not two: once, on a
    loaded machine, the new incarnation's step (the same step id, 3.1) started 3 s after the
    requeue and died 17 s later of the SIGUSR1 sent to the previous incarnation's batch shell
    (`scancel --batch --signal=USR1`, delivered late by slurmd); scripts/test.sh runs these
    tests beside the serial pass, one more core of load."""
    _wait(job_id, out, lambda j: j.get("JobState") == "PENDING" and _nodes_idle(), 60, "pending")
    time.sleep(10)
    r = _run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="session")
def baseline_run(slurm_cluster, tmp_path_factory):
    """An uninterrupted run (with pre-flight): the reference for placement and losses."""
    out = tmp_path_factory.mktemp("slurm-baseline")
    job = _launch(out)
    j = _wait(job, out, lambda j: j.get("JobState") == "COMPLETED", 400, "completion")
    return out, job, j


def test_job_completes_with_topology_ordered_ranks(baseline_run):
    out, job, j = baseline_run
    assert j["ExitCode"] == "0:0" and j["Restarts"] == "0"
    assert j["NumNodes"] == "4"
    # Node ranks in switch order: rank r on the (r // 2)-th node of spine.leaf1.*, leaf2.*.
    placement = json.loads((out / "preflight" / "placement.json").read_text())
    assert placement["job_id"] == job and placement["world_size"] == 8
    nodes = [n["node"] for n in placement["nodes"]]
    assert nodes == EXPECTED_ORDER
    addrs = [n["topology_addr"] for n in placement["nodes"]]
    assert nodes == topology_order(list(zip(nodes, addrs, strict=True)))
    for r in placement["ranks"]:
        assert r["node"] == EXPECTED_ORDER[r["rank"] // 2]
        assert r["node_rank"] == r["rank"] // 2
        assert r["topology_addr"] == f"spine.{r['leaf']}.{r['node']}"
        assert r["leaf"] == ("leaf1" if r["rank"] < 4 else "leaf2")
    assert placement["checks"]["node_ranks_follow_topology"] is True
    # The planner's placement for these hosts in launch order is the identity: launching in
    # switch order leaves it nothing to permute (in Slurm's name order it would have to).
    cluster = load_cluster(PROFILE)
    by_node = {n["node"]: n["topology_addr"] for n in placement["nodes"]}
    launched = fabric_from_slurm(cluster, nodelist=",".join(nodes), topology_addrs=by_node)
    assert planned_rank_order(Layout(dp_shard=8), launched) == list(range(8))
    by_name = fabric_from_slurm(cluster, nodelist="node[1-4]", topology_addrs=by_node)
    assert planned_rank_order(Layout(dp_shard=8), by_name) != list(range(8))
    # SLURM_NODEID follows the names (node1, node2, ...): plain Slurm order would interleave
    # the leaves, which is what the ordering undoes.
    order_file = out / "logs" / f"node_order-{job}-0.txt"
    assert order_file.read_text().split() == EXPECTED_ORDER
    # Pre-flight ran the FSDP collectives on all 8 ranks and found them right.
    pre = json.loads((out / "preflight" / "preflight.json").read_text())
    assert pre["ok"] and {r["op"] for r in pre["results"]} == {"all_gather", "reduce_scatter"}
    # Metrics and summary written; the job's own log and one log per node.
    losses, starts = _losses(out)
    assert sorted(losses) == list(range(1, 9)) and len(starts) == 1
    assert (out / "summary.json").exists()
    names = {f.name for f in (out / "logs").glob("*.out")}
    assert {f"debug-{job}.out"} | {f"debug-{job}-{n}.out" for n in EXPECTED_ORDER} <= names


def test_requeue_resumes_from_checkpoint_with_the_same_losses(baseline_run, tmp_path):
    """Preempt twice: `scontrol requeue` from outside, then the time-limit signal path
    (SIGUSR1 to the batch shell: checkpoint, stop, requeue). Losses match the baseline."""
    base_out = baseline_run[0]
    out = tmp_path / "requeued"
    job = _launch(out, "--no-preflight")
    ckpt = out / "checkpoint"

    # 1. External requeue once the step-2 checkpoint is complete (DCP writes .metadata last).
    def has_ckpt(j):
        return (ckpt / "step-2" / ".metadata").exists()

    _wait(job, out, has_ckpt, 300, "a checkpoint of step 2")
    r = _run(["scontrol", "requeue", job])
    assert r.returncode == 0, r.stderr
    _expedite(job, out)

    # 2. Once the restarted run has trained a step, send the time-limit signal.
    def trained_after_restart(j):
        if j.get("Restarts") != "1" or not (out / "metrics.jsonl").exists():
            return False
        lines = (out / "metrics.jsonl").read_text().splitlines()
        starts = [i for i, ln in enumerate(lines) if '"event": "start"' in ln]
        return len(starts) == 2 and any('"loss"' in ln for ln in lines[starts[1] :])

    _wait(job, out, trained_after_restart, 300, "a step after the first restart")
    r = _run(["scancel", "--batch", "--signal=USR1", job])
    assert r.returncode == 0, r.stderr
    _wait(job, out, lambda j: j.get("Restarts") == "2", 120, "requeue on SIGUSR1")
    _expedite(job, out)
    j = _wait(job, out, lambda j: j.get("JobState") == "COMPLETED", 300, "completion")
    assert j["ExitCode"] == "0:0"

    losses, starts = _losses(out)
    resumed = [s["resumed_from_step"] for s in starts]
    assert len(starts) == 3 and resumed[0] == 0 and 2 <= resumed[1] < resumed[2] < 8, resumed
    batch_log = (out / "logs" / f"debug-{job}.out").read_text()
    assert "SIGUSR1" in batch_log and "stopped for the time limit" in batch_log
    # The run saved on the stop request: it resumed exactly where it stopped.
    node1 = (out / "logs" / f"debug-{job}-node1.out").read_text()
    saved = re.findall(r"stop requested .* checkpoint of step (\d+) saved", node1)
    assert saved and int(saved[-1]) == resumed[2]

    base_losses, _ = _losses(base_out)
    assert sorted(losses) == sorted(base_losses) == list(range(1, 9))
    for step in base_losses:
        assert losses[step] == pytest.approx(base_losses[step], abs=2e-4), step
