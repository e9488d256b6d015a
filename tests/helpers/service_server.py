"""Start `python -m tools.serve` on the tiny debug model for the service tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.helpers.runs import child_env, python

ROOT = Path(__file__).resolve().parents[2]
KEY = "tml-test-key-7f3a91c2"
# A second tenant ("bob", two keys) for the isolation tests: `start_server(..., keys=TWO_TENANTS)`.
KEY_B = "tml-bob-first-key-0d9e4f71"
KEY_B2 = "tml-bob-second-key-66a2c0b8"
TWO_TENANTS = (
    f"# tenant by fingerprint, and tenant bob with two keys\n{KEY}\nbob {KEY_B}\nbob {KEY_B2}\n"
)
BASE_MODEL = "titanscale/debug"
# Two layers, 64 tokens: the debug model's width and vocabulary, small enough that a
# forward_backward takes ~0.1 s on one loaded CPU core.
TINY = ["model.layers=2", "training.seq_len=64"]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    storage: Path
    log: Path

    def tenant_dir(self, key: str = KEY, name: str | None = None) -> Path:
        """Where the tenant of `key` (or the named tenant) keeps its checkpoints."""
        from service.tenants import fingerprint

        return self.storage / "tenants" / (name or fingerprint(key))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    tmp: Path,
    *extra: str,
    storage: Path | None = None,
    sets=TINY,
    keys: str | None = None,
    procs: int = 1,
    recipe: str = "recipes/debug.toml",
    start_timeout: float = 180.0,
    real_process: bool = False,
) -> Server:
    """`procs` > 1: a model resource, `python -m tools.torchrun --standalone
    --nproc-per-node procs -m tools.serve ...` (rank 0 serves). `start_timeout`: seconds
    until the health check answers (a vLLM engine takes a minute more). The server runs in
    the suite's preloaded interpreter (tests/helpers/zygote.py) unless `real_process`: a
    test that reads the server's /proc/PID needs PID to be the server's own."""
    tmp.mkdir(parents=True, exist_ok=True)
    keyfile = tmp / "keys.txt"
    keyfile.write_text(keys or f"# test keys\n{KEY}\n")
    keyfile.chmod(0o600)  # the service refuses a key file others can read
    port = free_port()
    storage = storage or tmp / "storage"
    log = tmp / f"server-{port}.log"
    # No launch variables of the test's own: a resource's ranks come from its own torchrun
    # (whose workers' interpreter is PYTHON_EXEC, the preloaded one unless real_process).
    env = child_env(preloaded=not real_process)
    launch = ["-m", "tools.torchrun", "--standalone", f"--nproc-per-node={procs}"]
    cmd = [
        sys.executable if real_process else python(),
        *(launch if procs > 1 else []),
        "-m",
        "tools.serve",
        "--recipe",
        recipe,
        "--port",
        str(port),
        "--api-key-file",
        str(keyfile),
        "--storage",
        str(storage),
        "--drain",
        "30",
        *extra,
    ]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + start_timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return Server(proc, url, storage, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")


def fetch_tokenizer(url: str, into: Path, key: str = KEY) -> Path:
    """`python -m tools.tokenizer` as a client runs it: the served tokenizer written to
    `into/<tokenizer_id>/` (where the SDK's get_tokenizer() loads it when run in `into`)."""
    env = dict(os.environ, TINKER_API_KEY=key)
    p = subprocess.run(
        [sys.executable, "-m", "tools.tokenizer", "--url", url, "--dir", str(into)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return into


# A 12-token sequence of the debug vocabulary, and its next-token datum (weights 1).
SEQ = [7, 300, 41, 1200, 55, 9, 801, 23, 64, 1999, 5, 77]


def sft_datum(tokens=SEQ):
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def wait_outcome(fut, timeout: float = 10.0):
    """A service Future's outcome once completed (None past `timeout`): polls, no loop."""
    end = time.monotonic() + timeout
    while fut.outcome is None and time.monotonic() < end:
        time.sleep(0.01)
    return fut.outcome


def importance_sampling_datums(prompt: list[int], sequences, advantages) -> list:
    """The tinker Datums of one RL step: each sampled sequence after `prompt`, with the
    sampler's logprobs and the sequence's advantage on its tokens (the prompt's padded with 0)."""
    from tinker import types

    pad = [0.0] * (len(prompt) - 1)
    data = []
    for s, a in zip(sequences, advantages, strict=True):
        toks = prompt + list(s.tokens)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": toks[1:],
                    "logprobs": pad + list(s.logprobs),
                    "advantages": pad + [float(a)] * len(s.tokens),
                },
            )
        )
    return data
