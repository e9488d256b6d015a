"""`python -m tools.serve` with bad arguments or files: one line naming the flag, exit 2, before
the model is built and before anything is served (no "serving ..." line, no traceback, no
hang on a FIFO)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers.service_server import KEY, ROOT


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "tools.serve", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _keyfile(tmp_path, data: bytes, mode: int = 0o600) -> str:
    p = tmp_path / "keys.txt"
    p.write_bytes(data)
    p.chmod(mode)
    return str(p)


def _fifo(tmp_path) -> str:
    p = tmp_path / "keys.fifo"
    os.mkfifo(p, 0o600)
    return str(p)


def _damaged_hf(tmp_path) -> list[str]:
    """A Hugging Face folder of the debug shape whose weights file is not safetensors: refused
    before the port is bound (train.py's check), not a traceback 20 s after serving (#41)."""
    import json

    from tests.helpers.hf_reference import LLAMA3_DEBUG_CONFIG

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA3_DEBUG_CONFIG))
    (d / "model.safetensors").write_bytes(b"garbage, not safetensors")
    return ["--set", f"checkpoint.load_hf={d}"]


CASES = {
    "key file not UTF-8": (
        lambda t: ["--api-key-file", _keyfile(t, b"tml-\xff" + b"x" * 30)],
        "--api-key-file",
    ),
    "key file a FIFO": (lambda t: ["--api-key-file", _fifo(t)], "--api-key-file"),
    "key file readable by others": (
        lambda t: ["--api-key-file", _keyfile(t, KEY.encode() + b"\n", 0o644)],
        "--api-key-file",
    ),
    "a 4-character key": (
        lambda t: ["--api-key-file", _keyfile(t, b"tml-abcd\n")],
        "--api-key-file",
    ),
    "--storage a file": (lambda t: ["--storage", _keyfile(t, b"x")], "--storage"),
    "--session-ttl nan": (lambda t: ["--session-ttl", "nan"], "--session-ttl"),
    "--drain negative": (lambda t: ["--drain", "-1"], "--drain"),
    "--max-body-mb inf": (lambda t: ["--max-body-mb", "inf"], "--max-body-mb"),
    "--max-request-gib 0": (lambda t: ["--max-request-gib", "0"], "--max-request-gib"),
    "--max-queued-per-tenant -5": (
        lambda t: ["--max-queued-per-tenant", "-5"],
        "--max-queued-per-tenant",
    ),
    "--port 70000": (lambda t: ["--port", "70000"], "--port"),
    "damaged Hugging Face folder": (_damaged_hf, "checkpoint.load_hf"),
    "--port not a number": (lambda t: ["--port", "eighty"], "--port"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, case):
    make, flag = CASES[case]
    out = _serve(*make(tmp_path), timeout=180)  # the HF case imports torchtitan (~60 s loaded)
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
    assert out.returncode == 2, (case, out.stdout, out.stderr)
    assert len(lines) == 1 and flag in lines[0], (case, lines)
    assert KEY not in lines[0]


def test_port_in_use_is_one_line_before_any_serving_line(tmp_path):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    try:
        out = _serve("--port", str(port), "--storage", str(tmp_path / "s"))
    finally:
        held.close()
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert len(lines) == 1 and "--port" in lines[0] and "in use" in lines[0], lines
    assert not (tmp_path / "s" / "usage.jsonl").exists()  # nothing started
