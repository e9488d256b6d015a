"""The harness: one invocation's context (paths, settings, load readings), the shared base
and SFT data, titanscale's train.py side of a pair (per-step times, losses and CPU readings
from its metrics), running a peer worker in its own process, the ABBA interleaving of the two
sides, and the two servers (tools.serve, skyrl-tx's Tinker API) the service pairs talk to."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.peerbench.config import API_KEY, ENTRY, LORA, ROOT
from benchmarks.peerbench.measure import (
    RunFailed,
    child_env,
    free_port,
    proc_cpu_s,
    run_logged,
    worker_result,
)


class Ctx:
    """Paths, settings and the shared inputs of one benchmark invocation."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.work = Path(args.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.threads: int = args.threads
        self.repeats: int = args.repeats
        self.env = child_env(self.threads)
        self.py = sys.executable
        self.runs = self.work / "runs"
        shutil.rmtree(self.runs, ignore_errors=True)
        self.runs.mkdir()
        self.n_run = 0
        self.loads: list[float] = []
        # set by prepare()
        self.base_dcp = ""
        self.base_hf = ""
        self.sft_jsonl = ""
        self.sft_tokens = ""
        self.example_tokens = 0
        self.examples_per_row = 0
        # --one-worker-process: the shared worker process, started on first use
        self._loop: subprocess.Popen[str] | None = None
        self._loop_err = self.runs / "worker_loop.stderr.log"

    def log(self, name: str) -> Path:
        self.n_run += 1
        return self.runs / f"{self.n_run:03d}_{name}.log"

    def load(self) -> float:
        x = os.getloadavg()[0]
        self.loads.append(x)
        return x

    def worker(self, name: str, wargs: dict[str, Any], *, python: str | None = None,
               timeout: float = 900) -> dict[str, Any]:  # fmt: skip
        """One side's run: `peers.py --worker NAME ARGS_JSON` in its own process (in another
        venv with `python`), or with --one-worker-process a request to the shared worker
        process of this venv."""
        log = self.log(name)
        load0 = self.load()
        if self.args.one_worker_process and python is None:
            t0 = time.perf_counter()
            out = self._shared_worker(name, wargs, log)
            wall = time.perf_counter() - t0
        else:
            cmd = [python or self.py, str(ENTRY), "--worker", name, json.dumps(wargs)]
            wall = run_logged(cmd, log, self.env, timeout)
            out = worker_result(log)
        out.update(process_wall_s=wall, load_before=load0, load_after=self.load(), log=str(log))
        return out

    def _shared_worker(self, name: str, wargs: dict[str, Any], log: Path) -> dict[str, Any]:
        """A request to `peers.py --worker-loop` (started on first use); its output lines go
        to `log` until its RESULT / FAILED line."""
        if self._loop is None:
            self._loop_err = self.runs / "worker_loop.stderr.log"
            self._loop = subprocess.Popen(
                [self.py, str(ENTRY), "--worker-loop"], cwd=ROOT, env=self.env, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._loop_err.open("w"),
            )  # fmt: skip
        assert self._loop.stdin is not None and self._loop.stdout is not None
        self._loop.stdin.write(json.dumps([name, wargs]) + "\n")
        self._loop.stdin.flush()
        with log.open("w") as f:
            for line in self._loop.stdout:
                if line.startswith("RESULT "):
                    return json.loads(line[len("RESULT ") :])
                if line.startswith("FAILED "):
                    raise RunFailed(f"{name} failed ({log}):\n{json.loads(line[7:])[-2500:]}")
                f.write(line)
        tail = self._loop_err.read_text(errors="replace")[-2500:]
        raise RunFailed(f"the shared worker process exited ({self._loop_err}):\n{tail}")

    def close(self) -> None:
        """Ends the shared worker process, if one was started."""
        if self._loop is not None:
            assert self._loop.stdin is not None
            self._loop.stdin.close()
            try:
                self._loop.wait(60)
            except subprocess.TimeoutExpired:
                self._loop.kill()
                self._loop.wait(10)
            self._loop = None


# -- the base and the data -------------------------------------------------------------------
def prepare(ctx: Ctx) -> None:
    """The base (DCP + Hugging Face folder, cached) and the SFT data both sides read."""
    steps = ctx.args.base_steps
    base = ctx.work / f"base_s{steps}"
    dcp = base / "checkpoint" / f"step-{steps}"
    hf = base / "hf" / f"step-{steps}"
    if not (dcp.is_dir() and (hf / "config.json").is_file()):
        shutil.rmtree(base, ignore_errors=True)
        text = ctx.work / "arithmetic_text.jsonl"
        sys.path.insert(0, str(ROOT))
        import random

        from rl.envs import make_env

        # timeout_s=0: the benchmark's own data, not a user hook (rl.hooks' 60 s guard fired
        # on this whole-split call at load 6).
        tasks = make_env("arithmetic", timeout_s=0).tasks("train", 100_000, seed=0)  # all of train
        rng = random.Random(0)
        with text.open("w") as f:
            for _ in range(40):
                rng.shuffle(tasks)
                for t in tasks:
                    f.write(json.dumps({"text": t.prompt + t.answer}) + "\n")
        sets = [
            f"job.output_dir={base}",
            f"data.source={text}",
            "data.packing=bfd",
            f"training.steps={steps}",
            "training.lr=3e-3",
            f"training.warmup_steps={min(10, steps // 2)}",
            "training.local_batch_size=4",
            f"checkpoint.interval={steps}",
            "checkpoint.export_hf=true",
            "checkpoint.export_dtype=float32",
            "metrics.log_every=25",
            "metrics.tensorboard=false",
        ]
        cmd = [ctx.py, "train.py", "--recipe", "recipes/debug.toml"]
        for s in sets:
            cmd += ["--set", s]
        print(f"[peers] training the base ({steps} steps) -> {base}", flush=True)
        run_logged(cmd, ctx.log("base"), ctx.env, 1800)
    ctx.base_dcp, ctx.base_hf = str(dcp), str(hf)

    # SFT data: the letter-sorting task's 5-letter questions (recipes/sft_debug.toml's data,
    # data/tasks/letter_sort), every example 26 tokens. Equal lengths make both bfd packers
    # put the same examples in the same rows (see the .md), so step 0 sees the same tokens.
    src = ROOT / "data" / "tasks" / "letter_sort" / "train.jsonl"
    recs = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    recs = [r for r in recs if len(r["prompt"].split()) == 6]
    ctx.sft_jsonl = str(ctx.work / "sort5.jsonl")
    Path(ctx.sft_jsonl).write_text("".join(json.dumps(r) + "\n" for r in recs))
    # The same examples tokenized by titanscale's own renderer (data.chat, the embedded
    # template), for the peers: same ids, same trained positions.
    sys.path.insert(0, str(ROOT))
    from data.chat import decode_masked, make_renderer, parse_record

    renderer = make_renderer(hf)
    rows, lens = [], set()
    for r in recs:
        ids, trained = decode_masked(renderer.render(parse_record(r)))
        rows.append({"input_ids": ids.tolist(), "completion_mask": trained.astype(int).tolist()})
        lens.add(len(ids))
    if len(lens) != 1:
        raise SystemExit(f"expected equal-length examples, got lengths {sorted(lens)}")
    ctx.example_tokens = lens.pop()
    ctx.sft_tokens = str(ctx.work / "sort5_tokens.jsonl")
    Path(ctx.sft_tokens).write_text("".join(json.dumps(r) + "\n" for r in rows))


# -- titanscale sides ----------------------------------------------------------------------
def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def ts_train(ctx: Ctx, name: str, recipe: str, sets: list[str]) -> dict[str, Any]:
    """One train.py run; its per-step times and losses from metrics.jsonl, and its CPU time
    at the end of each step (read from /proc when the step's record appears)."""
    out_dir = ctx.runs / f"{ctx.n_run + 1:03d}_{name}"
    cmd = [ctx.py, "train.py", "--recipe", recipe, "--set", f"job.output_dir={out_dir}"]
    for s in sets:
        cmd += ["--set", s]
    log = ctx.log(name)
    load0 = ctx.load()
    metrics = out_dir / "metrics.jsonl"
    cpu_at: dict[int, float] = {}
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ctx.env, stdout=f, stderr=subprocess.STDOUT)
        pos, buf = 0, b""
        while True:
            done = proc.poll() is not None
            if metrics.exists():
                with metrics.open("rb") as m:
                    m.seek(pos)
                    chunk = m.read()
                pos += len(chunk)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    r = json.loads(line) if line.strip() else {}
                    if "step" in r and "loss" in r and "event" not in r:
                        cpu_at[r["step"]] = proc_cpu_s(proc.pid)
            if done:
                break
            time.sleep(0.01)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RunFailed(
            f"exit {proc.returncode} ({log}):\n{log.read_text(errors='replace')[-2500:]}"
        )
    recs = read_metrics(metrics)
    steps = [r for r in recs if "step" in r and "loss" in r and "event" not in r]
    result = {
        "step_times": [r["step_time_s"] for r in steps],
        "cpu_marks": [cpu_at.get(r["step"], float("nan")) for r in steps],
        "losses": [r["loss"] for r in steps],
        "process_wall_s": wall,
        "load_before": load0,
        "load_after": ctx.load(),
        "log": str(log),
        "events": [r for r in recs if r.get("event") in ("rl_eval", "rl_summary")],
        "records": steps,
    }
    shutil.rmtree(out_dir / "checkpoint", ignore_errors=True)
    return result


def interleave(ctx: Ctx, ours, peer) -> tuple[list[dict], list[dict]]:
    """R repeats of both sides, alternating which goes first (ABBA), so drifting machine load
    lands on both equally."""
    a: list[dict] = []
    b: list[dict] = []
    for r in range(ctx.repeats):
        order = [("ours", ours), ("peer", peer)]
        if r % 2:
            order.reverse()
        for who, fn in order:
            print(f"[peers]   repeat {r + 1}/{ctx.repeats}: {who}", flush=True)
            (a if who == "ours" else b).append(fn())
    return a, b


class Server:
    """A server process on 127.0.0.1 that we started and stop."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str], url: str) -> None:
        self.log, self.url = log, url
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, path: str, timeout: float) -> float:
        import urllib.error
        import urllib.request

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2500:]
                raise RunFailed(f"server exited {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RunFailed(f"server not ready after {timeout:.0f} s: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # Its own session: the signal reaches the children it started (skyrl's engine).
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_serve(ctx: Ctx) -> tuple[Server, float]:
    port = free_port()
    keys = ctx.work / "keys.txt"
    keys.touch(mode=0o600)
    keys.chmod(0o600)  # tools.serve refuses a key file others can read
    keys.write_text(API_KEY + "\n")
    cmd = [
        ctx.py, "-m", "tools.serve", "--recipe", "recipes/debug.toml", "--port", str(port),
        "--api-key-file", str(keys), "--storage", str(ctx.runs / "serve_storage"),
        "--set", f"checkpoint.load_from={ctx.base_dcp}", "--set", f"lora.alpha={LORA['alpha']}",
        "--set", f"job.output_dir={ctx.runs / 'serve'}",
    ]  # fmt: skip
    s = Server(cmd, ctx.log("tools_serve"), ctx.env, f"http://127.0.0.1:{port}")
    return s, s.wait_ready("/api/v1/healthz", 300)


def skyrl_base(ctx: Ctx) -> str:
    """The base for skyrl-tx: the same weight files (symlinked), config.json with the
    transformers-4 RoPE keys (skyrl-tx 0.3.0 pins transformers < 5, whose LlamaConfig reads
    rope_theta / rope_scaling, not transformers 5's rope_parameters)."""
    folder = ctx.work / "hf_skyrl"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for f in Path(ctx.base_hf).iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    cfg = json.loads((Path(ctx.base_hf) / "config.json").read_text())
    rope = dict(cfg["rope_parameters"])
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(folder)


def start_skyrl(ctx: Ctx, python: str) -> tuple[Server, float]:
    """skyrl-tx's API server, which starts its engine as `uv run --extra tinker --extra jax
    -m tx.tinker.engine ...` (it expects a source checkout run by uv); a `uv` shim in a
    folder of ours runs that module with the same interpreter instead."""
    shim_dir = ctx.work / "skyrl_shim"
    shim_dir.mkdir(exist_ok=True)
    shim = shim_dir / "uv"
    shim.write_text(
        "#!/bin/sh\n# `uv run --extra A --extra B -m module args` -> python -m module args\n"
        'shift\nwhile [ "$1" = "--extra" ]; do shift 2; done\n'
        f'exec "{python}" "$@"\n'
    )
    shim.chmod(0o755)
    port = free_port()
    db = ctx.runs / "skyrl_tinker.db"
    env = dict(ctx.env, PATH=f"{shim_dir}:{ctx.env.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    cmd = [
        python, "-m", "tx.tinker.api", "--host", "127.0.0.1", "--port", str(port),
        "--base-model", skyrl_base(ctx), "--database-url", f"sqlite:///{db}",
        "--checkpoints-base", str(ctx.runs / "skyrl_ckpt"),
    ]  # fmt: skip
    s = Server(cmd, ctx.log("skyrl_server"), env, f"http://127.0.0.1:{port}")
    return s, s.wait_ready("/api/v1/healthz", 300)
