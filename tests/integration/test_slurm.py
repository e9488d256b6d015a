"""tools.launch on a real Slurm: Debian's packages, 4 emulated nodes, 2 leaf switches.

The session fixture brings the cluster up with tools/slurmlab/up.sh (installing slurmctld,
slurmd, slurm-client and munge with apt-get when missing: needs root and the Debian
registry) and always tears it down with down.sh, which also restores /etc/hosts and
/etc/slurm. Leaves are interleaved (leaf1 = node1,node3; leaf2 = node2,node4), so node-name
order (what SLURM_NODEID follows) and switch order differ.

Jobs run the debug recipe on 4 nodes x 2 CPU processes through the generated sbatch script
(about 4-5 minutes on 2 cores), and a [fault_tolerance] job runs 2 replica groups of 2
one-process nodes, one group's step killed and re-launched alone (about 100 s).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from core.axes import Layout
from core.hostlist import expand_hostlist
from launch.slurm import fabric_from_slurm
from launch.topology import topology_order
from parallel.cluster import load_cluster
from parallel.placement import planned_rank_order
from tests.helpers.runs import ROOT, python

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
    """The lab's Slurm, and the jobs' torchrun workers in the suite's preloaded interpreter
    (PYTHON_EXEC; tests/helpers/zygote.py): a job of 8 ranks starts 12-24 processes that
    would each import torch and torchtitan (~300 of the lab's ~380 CPU-seconds)."""
    return dict(os.environ, SLURM_CONF=f"{BASE}/etc/slurm.conf", PYTHON_EXEC=python())


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
        "--cluster", str(PROFILE), "--nodes", "4", "--time", "00:15:00", "--python", python(),
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


# torchft replica groups on Slurm: 4 nodes of one CPU process each (2 ranks per group, so
# the 2 real cores are not oversubscribed as 2 groups x 2 nodes x 2 processes would be).
FT_STEPS = 25
# Every rank sleeps 1 s per step (runtime.faults' straggler seam): a re-launched group takes
# ~35 s to start here, and group 0 must still be training when it comes back.
FT_PACE = "slow:step=1:at=batch:seconds=1"
FT_SETS = (
    "fault_tolerance.enabled=true",
    "fault_tolerance.replica_groups=2",
    "fault_tolerance.quorum_timeout_s=20",
    "training.seq_len=64",
    f"training.steps={FT_STEPS}",
    "metrics.tensorboard=false",
)


def _ft_rows(out: Path, g: int) -> list[dict]:
    path = out / f"replica_{g}" / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return rows


def _ft_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "step" in r and "loss" in r]


def _step_task_pids(token: str, group: int) -> list[int]:
    """This test's processes of replica group `group` that Slurm started as the group's job
    step tasks (torchrun and its ranks: SLURM_STEP_ID set), found by their environment; the
    batch script's srun for the step is left alone, as a crash on a node would leave it."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = set((d / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if ({f"FT_TEST_TOKEN={token}".encode(), f"REPLICA_GROUP_ID={group}".encode()} <= env
                and any(v.startswith(b"SLURM_STEP_ID=") for v in env)):  # fmt: skip
            pids.append(int(d.name))
    return pids


def test_replica_group_step_is_relaunched_alone(slurm_cluster, tmp_path):
    """tools.launch renders the torchft script for 2 replica groups of 2 nodes; the lab's
    leaves are interleaved (leaf1 = node1,node3), so each group must be a leaf's nodes, not
    consecutive names. Group 1's step tasks are SIGKILLed after step 2: the script re-launches
    that step alone while group 0's step runs on (one start, its step counter never going
    back); group 1 heals from group 0 and both end with equal digests."""
    token = uuid.uuid4().hex
    profile = tmp_path / "slurmlab_cpu1.toml"
    text = PROFILE.read_text()
    for a, b in (('name = "slurmlab_cpu"', 'name = "slurmlab_cpu1"'),
                 ("gpus_per_node = 2", "gpus_per_node = 1"),
                 ("nvlink_domain_gpus = 2", "nvlink_domain_gpus = 1")):  # fmt: skip
        assert a in text
        text = text.replace(a, b)
    profile.write_text(text)
    out = tmp_path / "ft"
    cmd = [
        sys.executable, "-m", "tools.launch", "--recipe", str(ROOT / "recipes" / "debug.toml"),
        "--cluster", str(profile), "--nodes", "4", "--time", "00:15:00", "--no-preflight",
        "--python", python(),
        "--signal-seconds", "60", "--switch-wait", "00:01:00", "--out", str(out),
    ]  # fmt: skip
    for o in FT_SETS:
        cmd += ["--set", o]
    env = dict(_slurm_env(), FT_TEST_TOKEN=token, TITANSCALE_FAULT=FT_PACE)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)  # type: ignore[union-attr]

    _wait(job, out, lambda j: 2 in _ft_steps(_ft_rows(out, 1)), 240, "group 1 at step 2")
    killed = _step_task_pids(token, 1)
    for pid in killed:
        os.kill(pid, 9)
    killed_at = max(_ft_steps(_ft_rows(out, 1)))
    assert killed, "no task of group 1's step found"

    def rejoined(j):
        rows = _ft_rows(out, 1)
        return sum(r.get("event") == "start" for r in rows) == 2 and _ft_steps(rows)[-1] > killed_at

    _wait(job, out, rejoined, 240, "group 1 to rejoin")
    j = _wait(job, out, lambda j: j.get("JobState") == "COMPLETED", 240, "completion")
    assert j["ExitCode"] == "0:0" and j["Restarts"] == "0", j

    # Each group is one leaf's nodes (from Slurm's own topology), in the lab's switch order.
    topo = (out / "logs" / f"topology-{job}-0.txt").read_text()
    leaves = {m.group(1): set(expand_hostlist(m.group(2)))
              for m in re.finditer(r"SwitchName=(leaf\d+) .*Nodes=(\S+)", topo)}  # fmt: skip
    groups = [(out / "logs" / f"group-{job}-0-{g}.txt").read_text().split() for g in (0, 1)]
    assert groups == [EXPECTED_ORDER[:2], EXPECTED_ORDER[2:]]
    assert [set(g) for g in groups] == [leaves["leaf1"], leaves["leaf2"]], (groups, leaves)
    # The script re-launched group 1's step alone (a new step on the same nodes), once.
    log = (out / "logs" / f"debug-{job}.out").read_text()
    relaunch = re.findall(r"replica group (\d) exited (\d+); re-launching its step alone", log)
    assert [g for g, _ in relaunch] == ["1"] and relaunch[0][1] != "0", log
    assert log.count("replica group 1: job step on node2,node4 (attempt 2)") == 1
    assert "replica group 0: job step on node1,node3 (attempt 2)" not in log
    # Group 0 ran in one step from start to end, its step counter never going back.
    g0, g1 = _ft_rows(out, 0), _ft_rows(out, 1)
    assert sum(r.get("event") == "start" for r in g0) == 1
    steps0 = _ft_steps(g0)
    assert steps0 == list(range(1, FT_STEPS + 1)), steps0
    # Group 1 healed from group 0: its re-launch went on from the live step, not step 1, and
    # group 0 stepped while it was away.
    restart = max(i for i, r in enumerate(g1) if r.get("event") == "start")
    back = _ft_steps(g1[restart:])[0]
    assert back > killed_at + 1, (killed_at, back)
    assert [s for s in steps0 if killed_at < s < back]
    for r in (0, 1):  # ranks of a group
        d0, d1 = (json.loads((out / f"replica_{g}" / f"state_digest_rank{r}.json").read_text())
                  for g in (0, 1))  # fmt: skip
        assert d0["step"] == d1["step"] == FT_STEPS and d0 == d1
    print(f"group 1 killed after step {killed_at}, back at step {back}")
