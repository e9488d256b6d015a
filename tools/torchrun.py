"""`python -m tools.torchrun [torchrun options] train.py [train.py options]`: torchrun, with bad
input reported once and no launcher traceback.

Plain `torchrun` ends every failed job by raising ChildFailedError out of its own `main`
(torch.distributed.run, decorated with `@record`, which re-raises it): a recipe error that
each rank already reported in one line (exit 2) is followed by torchrun's Python traceback,
a failure table and exit 1. Nothing in the child can prevent that (the parent raises it), so
this wrapper runs the same launcher through torch's API (`torch.distributed.run.parse_args`
and `run`: same options, same agent, same rendezvous) and catches ChildFailedError:

- every failed process exited 2 (bad input), or was stopped by the agent's SIGTERM after one
  did: each distinct message the ranks handed over is printed once, exit 2;
- anything else: one line per failed rank (rank, exit code or signal, host, error file, and
  the first line of the error torchelastic recorded), no traceback, and the root cause's exit
  code (128 + N for a signal N, as a shell reports it).

The ranks hand their one-line message over through a folder named in TITANSCALE_ERROR_DIR
(`core.errors.exit_on_config_error`; only for processes whose parent is this wrapper), so a
job of 8 ranks prints the line once, not 8 times. The job script (launch/job.sbatch) and the
README use this wrapper; plain torchrun still works and still prints its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.errors import (
    EXIT_BAD_INPUT,
    HANDOVER_DIR_ENV,
    HANDOVER_PID_ENV,
    ConfigError,
    exit_on_config_error,
    shown,
)
from core.launch_env import MAX_WORLD_SIZE, check_torch_env
from tools.cli import run


def exit_code(code: int) -> int:
    """A child's exit status as a shell shows it: -N (killed by signal N) -> 128 + N."""
    return 128 - code if code < 0 else code


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def is_bad_input(codes: Mapping[int, int]) -> bool:
    """True when the job failed on bad input: some rank exited 2 and every other failed rank
    exited 2 too or was ended by the agent's SIGTERM (sent to the others once one fails)."""
    exited = list(codes.values())
    return EXIT_BAD_INPUT in exited and all(c in (EXIT_BAD_INPUT, -signal.SIGTERM) for c in exited)


def read_messages(folder: Path) -> list[str]:
    """The distinct one-line messages the ranks handed over, in rank order."""
    lines: list[str] = []
    for f in sorted(folder.glob("rank-*.txt"), key=lambda p: _rank_of(p.name)):
        text = f.read_text(errors="replace").strip()
        if text and text not in lines:
            lines.append(text)
    return lines


def _rank_of(name: str) -> int:
    try:
        return int(name.split("-")[1])
    except (IndexError, ValueError):
        return 1 << 30


def failure_lines(failures: Mapping[int, Any], host: str = "") -> list[str]:
    """One line per failed rank (ProcessFailure: local_rank, exitcode, error_file, message)."""
    out = []
    term = -signal.SIGTERM
    others_failed = any(f.exitcode != term for f in failures.values())
    for rank in sorted(failures):
        f = failures[rank]
        code = f.exitcode
        how = f"killed by {_signal_name(code)}" if code < 0 else f"exit {code}"
        msg = str(f.message or "").strip().splitlines()
        noise = ("To enable traceback", "Signal ")  # torchelastic's text when it has none
        first = f": {msg[0][:200]}" if msg and not msg[0].startswith(noise) else ""
        if code == term and others_failed:
            how, first = "stopped by torchrun (SIGTERM) after another rank failed", ""
        where = f" on {host}" if host else ""
        err = f" (error file {f.error_file})" if f.error_file and f.error_file != "<N/A>" else ""
        out.append(f"torchrun: rank {rank} (local rank {f.local_rank}){where} {how}{first}{err}")
    return out


# More processes per node than any node runs (the largest have a few hundred cores):
# "--nproc-per-node=100000" would fork that many Pythons before anything fails.
MAX_PROCS_PER_NODE = 1024
_HOST_PORT = re.compile(r"[A-Za-z0-9_.\[\]:%-]{1,260}")


def check_torchrun_args(args: argparse.Namespace) -> None:
    """torchrun's own options, checked before it starts anything (torch raises ValueError,
    RuntimeError or a bare AssertionError deep in its launcher for these)."""
    from torch.distributed.run import determine_local_world_size

    n = str(args.nproc_per_node)
    want = f"expected 1 to {MAX_PROCS_PER_NODE} processes, cpu, gpu or auto"
    if not re.fullmatch(r"[0-9]{1,7}|[a-z]{1,16}", n):
        raise ConfigError(f"{want}, got {shown(n)}", key="--nproc-per-node")
    try:
        procs = determine_local_world_size(n)  # counts cpu / gpu / auto on this machine
    except ValueError as e:
        raise ConfigError(f"{want}, got {shown(n)} ({e})", key="--nproc-per-node") from None
    if not 1 <= procs <= MAX_PROCS_PER_NODE:
        raise ConfigError(f"{want}, got {shown(n)}", key="--nproc-per-node")
    m = re.fullmatch(r"([0-9]{1,7})(?::([0-9]{1,7}))?", str(args.nnodes))
    lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not 1 <= lo <= hi <= MAX_WORLD_SIZE:
        raise ConfigError(
            f"expected N or MIN:MAX nodes, 1 <= MIN <= MAX <= {MAX_WORLD_SIZE}, got "
            f"{shown(str(args.nnodes))}",
            key="--nnodes",
        )
    if not 0 <= args.node_rank < hi:
        raise ConfigError(f"expected 0 to {hi - 1}, got {args.node_rank}", key="--node-rank")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ConfigError(f"expected 1 to 65535, got {args.master_port}", key="--master-port")
    for key, v in (("--master-addr", args.master_addr), ("--rdzv-endpoint", args.rdzv_endpoint)):
        if v and not _HOST_PORT.fullmatch(v):
            raise ConfigError(f"expected a host name or address, got {shown(v)}", key=key)
    if args.max_restarts < 0:
        raise ConfigError(f"expected 0 or more, got {args.max_restarts}", key="--max-restarts")
    script = args.training_script
    if not (args.module or args.no_python) and not os.path.isfile(script):
        raise ConfigError(f"no such file: {shown(script)}", key="training_script")


class _DropChildExitNoise(logging.Filter):
    """torchelastic logs 'failed (exitcode: N)' and 'Sending process ... SIGTERM' per rank;
    our summary says the same once, so those two records are dropped (others are kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("failed (exitcode") or msg.startswith("Sending process"))


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    # Before importing torch: LOGLEVEL=x would fail inside torch's import with a traceback.
    # (RANK, WORLD_SIZE ... are torchrun's to set for the children, not checked here.)
    check_torch_env(os.environ)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    args = parse_args(argv)  # torchrun's own options and its usage errors (exit 2)
    check_torchrun_args(args)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        _DropChildExitNoise()
    )
    with tempfile.TemporaryDirectory(prefix="titanscale-errors-") as d:
        os.environ[HANDOVER_DIR_ENV] = d
        os.environ[HANDOVER_PID_ENV] = str(os.getpid())
        try:
            torchrun(args)
        except ChildFailedError as e:
            codes = {r: f.exitcode for r, f in e.failures.items()}
            if is_bad_input(codes):
                for line in read_messages(Path(d)):
                    print(line, file=sys.stderr)
                return EXIT_BAD_INPUT
            for line in failure_lines(e.failures, socket.gethostname()):
                print(line, file=sys.stderr)
            for line in read_messages(Path(d)):  # a rank's bad-input line among other failures
                print(line, file=sys.stderr)
            _, root = e.get_first_failure()
            return exit_code(root.exitcode)
        except SignalException as e:  # scancel, a time limit, Ctrl-C: the agent stopped the ranks
            name = _signal_name(-int(e.sigval))
            print(f"torchrun: stopped by {name}; the ranks were stopped", file=sys.stderr)
            return exit_code(-int(e.sigval))
    return 0


if __name__ == "__main__":
    run(main)
