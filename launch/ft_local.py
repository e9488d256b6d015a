"""Run a [fault_tolerance] recipe's replica groups on this machine (tools.launch --local).

One torchft lighthouse (torchft.coordination.LighthouseServer, in this process) and one
torchrun per replica group (tools.torchrun: `nproc` ranks, its own rendezvous), each group's
ranks given REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE. A group whose torchrun ends with
anything but 0 or 2 (killed, crashed) is restarted alone, up to `max_restarts` times in all,
while the others train on; it heals from a live group (runtime.fault_tolerance). Exit 2 from
a group (bad input, one line already printed) stops every group: a restart would repeat it.

The one home of what a replica group's ranks are given (`group_vars`) and of how the
lighthouse is started (`start_lighthouse`): the Slurm job script's group steps
(launch/sbatch.py) and lighthouse step (tools.lighthouse) use the same two functions.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.launch_env import LIGHTHOUSE_ENV, REPLICA_ENV, worker_python

if TYPE_CHECKING:  # torchft's import costs seconds: only where a lighthouse starts
    from torchft.coordination import LighthouseServer

REPO_ROOT = Path(__file__).resolve().parents[1]
# A lighthouse forms a quorum once every known group has joined or this long has passed:
# short, so a restarted group's absence does not hold the others (torchft's default: 60 s).
JOIN_TIMEOUT_MS = 1000
POLL_S = 0.5


@dataclass(frozen=True)
class GroupsPlan:
    """What `run_groups` starts: pure data, so tests and --dry-run can read it."""

    groups: int
    nproc: int
    min_replicas: int
    train_args: tuple[str, ...]  # train.py's arguments (recipe, overrides)
    out: str  # the run folder; group g's torchrun log in <out>/replica_g/torchrun.log
    max_restarts: int = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_command(plan: GroupsPlan, python: str = sys.executable) -> list[str]:
    """One group's torchrun (its own c10d rendezvous on a free port)."""
    return [python, "-m", "tools.torchrun", f"--nproc_per_node={plan.nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
            str(REPO_ROOT / "train.py"), *plan.train_args]  # fmt: skip


def group_vars(group: int, lighthouse: str) -> dict[str, str]:
    """What every rank of replica group `group` is given beyond its torchrun's variables:
    its group id and the lighthouse's address (runtime.fault_tolerance reads both)."""
    return {REPLICA_ENV: str(group), LIGHTHOUSE_ENV: lighthouse}


def start_lighthouse(min_replicas: int, port: int = 0) -> LighthouseServer:
    """torchft's lighthouse on every interface (`port` 0: a free one). A quorum forms once
    every known group has joined or JOIN_TIMEOUT_MS has passed."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=f"[::]:{port or free_port()}",
        min_replicas=min_replicas,
        join_timeout_ms=JOIN_TIMEOUT_MS,
    )


def group_env(base: dict[str, str], group: int, lighthouse: str) -> dict[str, str]:
    """The launcher's environment plus `group_vars`; this checkout first on PYTHONPATH (the
    groups run in the caller's folder, where the recipe's relative paths mean what they mean
    to train.py)."""
    env = {k: v for k, v in base.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(group_vars(group, lighthouse))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), base.get("PYTHONPATH")) if p)
    return env


def _start(plan: GroupsPlan, g: int, lighthouse: str) -> subprocess.Popen:
    folder = Path(plan.out) / f"replica_{g}"
    folder.mkdir(parents=True, exist_ok=True)
    log = open(folder / "torchrun.log", "a")  # noqa: SIM115 (the child holds it)
    # Own session: a group's torchrun and ranks are stopped together, never the launcher.
    return subprocess.Popen(group_command(plan, worker_python()), env=group_env(dict(os.environ), g, lighthouse),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_groups(plan: GroupsPlan) -> int:
    """Start the lighthouse and the groups; restart a dead group alone; 0 when every group
    finished, 2 when one refused its input, 1 when restarts ran out."""
    lh = start_lighthouse(plan.min_replicas)
    addr = lh.address()
    print(f"lighthouse {addr}; {plan.groups} replica groups x {plan.nproc} ranks", flush=True)
    procs = {g: _start(plan, g, addr) for g in range(plan.groups)}
    done: set[int] = set()
    restarts = 0
    try:
        while len(done) < plan.groups:
            time.sleep(POLL_S)
            for g, p in procs.items():
                rc = p.poll()
                if g in done or rc is None:
                    continue
                if rc == 0:
                    done.add(g)
                    print(f"replica group {g} finished", flush=True)
                    continue
                if rc == 2:
                    return 2  # its one line is in its log and on the ranks' stderr
                if restarts >= plan.max_restarts:
                    print(f"replica group {g} exited {rc}; no restarts left "
                          f"({plan.max_restarts})", file=sys.stderr, flush=True)  # fmt: skip
                    return 1
                restarts += 1
                print(f"replica group {g} exited {rc}; restarting it alone "
                      f"({restarts} of {plan.max_restarts})", flush=True)  # fmt: skip
                procs[g] = _start(plan, g, addr)
        return 0
    finally:
        for p in procs.values():
            _stop(p)
        lh.shutdown()
