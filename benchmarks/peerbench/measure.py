"""Measurement helpers: medians and spreads over repeats, per-repeat ratios, steady-state step
times, CPU seconds from /proc (a process or a whole process tree), the per-step clock the
workers keep, and running a child process with its output in a log. Stdlib only: it is
imported by workers in the skyrl-tx venv too."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.peerbench.config import ROOT


def summarize(values: list[float]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": vals,
    }


def ratio_range(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """The ratio peer / ours (> 1 = titanscale faster) of each repeat, summarized: median and
    min-max. Repeat r pairs ours' r-th run with the peer's r-th, adjacent in time under the
    ABBA interleaving, so a load swing moves both sides of one ratio. Computed from two
    `summarize` results whose values are in repeat order (none dropped: else n = 0)."""
    a, b = ours["values"], peer["values"]
    if not a or len(a) != len(b):
        return summarize([])
    return summarize([y / x for x, y in zip(a, b, strict=True)])


def ratios(
    t_ours: dict[str, Any], t_peer: dict[str, Any], c_ours: dict[str, Any], c_peer: dict[str, Any]
) -> dict[str, Any]:
    """peer / ours (> 1 = titanscale faster) of the medians of wall (`t_*`) and CPU (`c_*`)
    seconds, each with its per-repeat range (`ratio_range`): the four ratio fields of every
    pair in peers.json."""
    return {
        "ratio": t_peer["median"] / t_ours["median"],
        "ratio_range": ratio_range(t_ours, t_peer),
        "cpu_ratio": c_peer["median"] / c_ours["median"],
        "cpu_ratio_range": ratio_range(c_ours, c_peer),
    }


def steady(step_times: list[float], skip: int, drop_last: int = 0) -> float | None:
    """Median step time after `skip` warm-up steps (and without the last `drop_last`)."""
    xs = step_times[skip : len(step_times) - drop_last if drop_last else None]
    return statistics.median(xs) if xs else None


def steady_cpu(marks: list[float], skip: int, drop_last: int = 0) -> float | None:
    """CPU seconds per step from cumulative CPU readings at the end of each step (marks[i]
    after step i + 1): the mean over the steps after `skip` (and without the last
    `drop_last`). CPU time counts the work, not the waiting: it is what a loaded machine
    distorts least (wall time on a shared core grows with the other jobs' load)."""
    end = len(marks) - 1 - drop_last
    if end <= skip - 1 or skip < 1:
        return None
    return (marks[end] - marks[skip - 1]) / (end - skip + 1)


def proc_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and every process below it (a server and the workers it runs)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += proc_cpu_s(p)
        todo += children.get(p, [])
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(threads: int) -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )


class RunFailed(RuntimeError):
    pass


def run_logged(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> float:
    """Run `cmd` to completion with its output in `log`; its wall seconds. RunFailed with the
    log's tail when it fails."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            p = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise RunFailed(f"timed out after {timeout:.0f} s: {log}") from None
    if p.returncode != 0:
        tail = log.read_text(errors="replace")[-2500:]
        raise RunFailed(f"exit {p.returncode} ({log}):\n{tail}")
    return time.perf_counter() - t0


def worker_result(log: Path) -> dict[str, Any]:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RunFailed(f"no RESULT line in {log}:\n{log.read_text(errors='replace')[-2500:]}")
    return json.loads(lines[-1][len("RESULT ") :])


# -- in the workers: one side's per-step clock ------------------------------------------------
class StepClock:
    """Wall time per optimizer step, and this process's CPU time at the end of each
    (`cpu_marks`; plus a server's process tree when `server_pid` is given: the service
    pairs, where the work runs there)."""

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self.t = time.perf_counter()
        self.times: list[float] = []
        self.cpu_marks: list[float] = []

    def cpu(self) -> float:
        own = time.process_time()
        return own + (tree_cpu_s(self.server_pid) if self.server_pid else 0.0)

    def start(self) -> None:
        self.t = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self.t)
        self.cpu_marks.append(self.cpu())
        self.t = now
