"""Running train.py and the tools as a user would (1 process or torchrun) and reading metrics.

Imported by tests as `tests.helpers.runs`; never import `tests.conftest`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Small, fast settings shared by the multi-process tests: seq 128, 5 steps.
FAST = [
    "training.seq_len=128",
    "training.steps=5",
    "metrics.tensorboard=false",
    "metrics.summary_skip_steps=1",
]


# recipes/rl_debug.toml cut to seconds per update (1 layer, 3 prompts x 2 samples, 3 tokens).
RL_TINY = [
    "model.layers=1",
    "training.seq_len=32",
    "rl.prompts_per_step=3",
    "rl.group_size=2",
    "rl.max_new_tokens=3",
    "rl.sft_warmup_steps=1",
    "rl.eval_prompts=0",
    "metrics.summary_skip_steps=0",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python() -> str:
    """The interpreter for a test's command line: the suite's preloaded one
    (tests/helpers/zygote.py; its ENTRY_POINTS fork a process that has imported torch and
    torchtitan, anything else runs the real interpreter), or sys.executable with
    TITANSCALE_TEST_ZYGOTE=0."""
    from tests.helpers.zygote import python as preloaded

    return preloaded()


def child_env(preloaded: bool = True) -> dict[str, str]:
    """The environment of a test's child: one OpenMP thread, unbuffered, no launch variables
    of the test's own, and with `preloaded` PYTHON_EXEC (torchrun's interpreter for its
    workers) = python(); without, no PYTHON_EXEC: every process of the command is a real
    interpreter (the README's commands, a child in another mount namespace)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if preloaded:
        env["PYTHON_EXEC"] = python()
    else:
        env.pop("PYTHON_EXEC", None)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_train(
    out: Path,
    overrides: list[str],
    *,
    nproc: int = 1,
    recipe: str | None = None,
    extra_args: list[str] | None = None,
    timeout: int = 600,
    check: bool = True,
    launcher: str = "torch.distributed.run",
) -> subprocess.CompletedProcess:
    """Run train.py (torchrun when nproc > 1: `launcher`, plain torchrun or the README's
    `tools.torchrun` wrapper) with job.output_dir=out."""
    args = ["--set", f"job.output_dir={out}"]
    for o in overrides:
        args += ["--set", o]
    if recipe:
        args = ["--recipe", recipe, *args]
    if nproc == 1:
        cmd = [python(), str(ROOT / "train.py"), *args]
    else:
        cmd = [
            python(), "-m", launcher,
            f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}",
            *(extra_args or []),
            str(ROOT / "train.py"), *args,
        ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def read_losses(out: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (later records win: a restart replays steps)."""
    losses: dict[int, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "event" not in rec:
            losses[rec["step"]] = rec["loss"]
    return losses


def train_main_error(argv: list[str], capsys) -> tuple[int, list[str]]:
    """Run train.main in-process expecting bad input: (exit code, its `error:` lines).

    The launch variables train.main sets for a 1-process job are restored afterwards; torch's
    own import-time warnings on stderr are not `error:` lines."""
    import pytest

    import train

    saved = dict(os.environ)
    try:
        with pytest.raises(SystemExit) as e:
            train.main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    return int(e.value.code or 0), err
