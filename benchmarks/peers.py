"""titanscale side by side with the tools a post-training user would pick instead.

    python benchmarks/peers.py [--quick] [--repeats R] [--pairs a,b] [--threads T]
                               [--out benchmarks/peers] [--work outputs/peers]

One invocation runs every pair on the same base, data and hyperparameters, the two sides of
a pair interleaved (ours, peer, peer, ours, ...) so that both see the same machine load, and
writes `<out>.md` and `<out>.json` (command, machine, versions, date, load averages, median
and spread over the repeats, ratios ours/peer with > 1 = titanscale faster).

The base: the debug Llama (6 layers, dim 256, vocabulary 2048) trained from scratch by
`train.py` on the arithmetic task's train split for --base-steps steps, saved as a DCP
checkpoint (what titanscale loads) and exported to a Hugging Face folder (what the peers
load; float32, so both hold the same numbers). Built once and cached under --work.

Pairs (titanscale is driven only through its public entry points: `train.py` recipes with
`--set`, `tools.serve` through the tinker SDK, the generator's API):
- sft_lora_packed / sft_lora_unpacked: LoRA SFT, recipes/sft_debug.toml vs TRL SFTTrainer +
  PEFT LoraConfig (same rank, alpha, target modules), packing on (bfd) and off.
- full_ft: full fine-tune, recipes/sft_debug.toml with finetune.mode=full vs transformers
  Trainer.
- generate: rl.generator.Generator vs transformers `generate` (KV cache), greedy and sampled
  (group of 8 per prompt).
- grpo: recipes/rl_debug.toml (arithmetic) vs TRL GRPOTrainer, same group size, steps and
  reward; held-out reward is greedy decoding on every held-out prompt.
- dpo: DPO through tools.serve (tinker SDK forward_backward_custom) vs TRL DPOTrainer + PEFT.
- service: one tinker SDK script (forward_backward + optim_step + sample) against tools.serve
  and against skyrl-tx's Tinker server (its own virtual environment, see --skyrl-python).

Each side runs in its own process (`peers.py --worker NAME ARGS_JSON` for the peers), one
process at a time. Step times are wall time between consecutive optimizer steps, the median
over the steps after the first few (warm-up); a pair's figure is the median over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAIRS = (
    "sft_lora_packed",
    "sft_lora_unpacked",
    "full_ft",
    "generate",
    "grpo",
    "dpo",
    "service",
)
SKYRL_INSTALL = (
    "python3.11 -m venv .venv-skyrl && .venv-skyrl/bin/pip install 'skyrl-tx[tinker]==0.3.0' "
    "'jax[cpu]>=0.8,<1.0' 'flax>=0.12.2' 'optax>=0.2.5' 'tinker==0.16.1'"
)
API_KEY = "tml-peers-benchmark-key"  # service.tenants: at least 16 characters after tml-
TOL = 1e-4  # step-0 loss agreement the issue asks for (SFT and DPO)

# Shared hyperparameters (both sides of a pair get these).
LORA = {"rank": 16, "alpha": 32.0}
# titanscale's LoRA targets (torchtitan names) and the same layers in transformers' Llama.
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}  # torchtitan's AdamW defaults


# -- small helpers --------------------------------------------------------------------------
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

    def log(self, name: str) -> Path:
        self.n_run += 1
        return self.runs / f"{self.n_run:03d}_{name}.log"

    def load(self) -> float:
        x = os.getloadavg()[0]
        self.loads.append(x)
        return x

    def worker(self, name: str, wargs: dict[str, Any], *, python: str | None = None,
               timeout: float = 900) -> dict[str, Any]:  # fmt: skip
        log = self.log(name)
        cmd = [
            python or self.py,
            str(Path(__file__).resolve()),
            "--worker",
            name,
            json.dumps(wargs),
        ]
        load0 = self.load()
        wall = run_logged(cmd, log, self.env, timeout)
        out = worker_result(log)
        out.update(process_wall_s=wall, load_before=load0, load_after=self.load(), log=str(log))
        return out


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


# -- pairs -----------------------------------------------------------------------------------
def sft_pair(ctx: Ctx, *, lora: bool, packed: bool) -> dict[str, Any]:
    q = ctx.quick
    steps = 6 if q else 12
    skip = 2 if q else 3
    # Rows of up to 256 pairs (recipes/sft_debug.toml). Packed, titanscale's row holds a whole
    # number of examples exactly (8 x 25 pairs = 200; seq_len must be a multiple of 8): its
    # bfd packer holds back rows that are not full (within 256 // 512 = 0 pairs) for a later
    # round, so with a partly filled row the first batches would hold other examples than
    # TRL's, whose packer emits rows in order.
    pairs = ctx.example_tokens - 1
    per_row = next(k for k in range(256 // pairs, 0, -1) if k * pairs % 8 == 0) if packed else 1
    seq_len = per_row * pairs if packed else 256
    batch = 4 if packed else 8  # rows per step
    lr = 3e-3 if lora else 1e-4
    sets = [
        f"data.source={ctx.sft_jsonl}",
        "data.eval_source=",
        f"data.packing={'bfd' if packed else 'none'}",
        f"checkpoint.load_from={ctx.base_dcp}",
        "checkpoint.interval=0",
        f"training.steps={steps}",
        "training.warmup_steps=0",
        f"training.seq_len={seq_len}",
        f"training.local_batch_size={batch}",
        f"training.lr={lr}",
        "training.weight_decay=0.0",
        "training.max_norm=1.0",
        "metrics.log_every=1",
        "metrics.tensorboard=false",
        "finetune.export_merged=false",
        f"finetune.mode={'lora' if lora else 'full'}",
    ]
    if lora:
        sets += [f"lora.rank={LORA['rank']}", f"lora.alpha={LORA['alpha']}"]
    wargs = {
        "hf": ctx.base_hf,
        "data": ctx.sft_tokens,
        "steps": steps,
        "batch": batch,
        "lr": lr,
        "lora": lora,
        "packed": packed,
        # TRL counts tokens, titanscale counts next-token pairs: a row of seq_len pairs holds
        # per_row examples of n tokens = per_row * n tokens in TRL's row.
        "max_length": per_row * ctx.example_tokens if packed else seq_len,
        "threads": ctx.threads,
        "work": str(ctx.runs),
        "trainer": "trl" if lora else "transformers",
    }
    name = ("lora" if lora else "full") + ("_packed" if packed else "_unpacked")
    ours, peer = interleave(
        ctx,
        lambda: ts_train(ctx, f"ts_{name}", "recipes/sft_debug.toml", sets),
        lambda: ctx.worker("trl_sft" if lora else "hf_full", wargs),
    )
    tokens_per_step = batch * per_row * ctx.example_tokens
    trained_per_step = batch * per_row * 6  # 5 letters + EOS (the completion)
    t_ours = summarize([steady(r["step_times"], skip) for r in ours])
    t_peer = summarize([steady(r["step_times"], skip) for r in peer])
    c_ours = summarize([steady_cpu(r["cpu_marks"], skip) for r in ours])
    c_peer = summarize([steady_cpu(r["cpu_marks"], skip) for r in peer])
    loss0 = [ours[0]["losses"][0], peer[0]["losses"][0]]
    lossN = [ours[0]["losses"][-1], peer[0]["losses"][-1]]
    # Every repeat is the same computation: its step-0 loss must be bit-stable per side.
    loss0_spread = max(
        max(r["losses"][0] for r in side) - min(r["losses"][0] for r in side)
        for side in (ours, peer)
    )
    return {
        "config": {
            "steps": steps,
            "warmup_steps_excluded": skip,
            "rows_per_step": batch,
            "examples_per_row": per_row,
            "examples_per_step": batch * per_row,
            "tokens_per_step": tokens_per_step,
            "trained_tokens_per_step": trained_per_step,
            "seq_len_titanscale_pairs": seq_len,
            "max_length_peer_tokens": wargs["max_length"],
            "lr": lr,
            "lora": LORA if lora else None,
            "titanscale_sets": sets,
        },
        "ours_step_s": t_ours,
        "peer_step_s": t_peer,
        "ours_tokens_per_s": tokens_per_step / t_ours["median"],
        "peer_tokens_per_s": tokens_per_step / t_peer["median"],
        "ratio": t_peer["median"] / t_ours["median"],
        "ours_cpu_s_per_step": c_ours,
        "peer_cpu_s_per_step": c_peer,
        "ours_tokens_per_cpu_s": tokens_per_step / c_ours["median"],
        "peer_tokens_per_cpu_s": tokens_per_step / c_peer["median"],
        "cpu_ratio": c_peer["median"] / c_ours["median"],
        "loss_step0": {"ours": loss0[0], "peer": loss0[1], "abs_diff": abs(loss0[0] - loss0[1])},
        "loss_stepN": {"ours": lossN[0], "peer": lossN[1], "step": steps},
        "loss_step0_spread_over_repeats": loss0_spread,
        "agree": abs(loss0[0] - loss0[1]) < TOL,
        "losses_by_step": {"ours": ours[0]["losses"], "peer": peer[0]["losses"]},
        "process_wall_s": {
            "ours": summarize([r["process_wall_s"] for r in ours]),
            "peer": summarize([r["process_wall_s"] for r in peer]),
        },
        "load": [r["load_before"] for r in ours + peer],
    }


def gen_pair(ctx: Ctx) -> dict[str, Any]:
    q = ctx.quick
    wargs = {
        "hf": ctx.base_hf,
        "dcp": ctx.base_dcp,
        "prompts": 8 if q else 16,
        "group": 8,
        "max_new": 8 if q else 16,
        "repeats": ctx.repeats,
        "threads": ctx.threads,
    }
    r = ctx.worker("gen", wargs)
    out: dict[str, Any] = {
        "config": wargs,
        "greedy_identical": r["greedy_identical"],
        "prompt_lengths": r["prompt_lengths"],
    }
    for mode in ("greedy", "sampled"):
        a, b = summarize(r[f"ours_{mode}_s"]), summarize(r[f"peer_{mode}_s"])
        ca, cb = summarize(r[f"ours_{mode}_cpu_s"]), summarize(r[f"peer_{mode}_cpu_s"])
        toks = r[f"{mode}_tokens"]
        out[mode] = {
            "ours_s": a,
            "peer_s": b,
            "tokens": toks,
            "ours_tokens_per_s": toks / a["median"],
            "peer_tokens_per_s": toks / b["median"],
            "ratio": b["median"] / a["median"],
            "ours_cpu_s": ca,
            "peer_cpu_s": cb,
            "cpu_ratio": cb["median"] / ca["median"],
        }
    out["load"] = [r["load_before"], r["load_after"]]
    return out


def grpo_pair(ctx: Ctx) -> dict[str, Any]:
    q = ctx.quick
    steps = 3 if q else 8
    prompts = 4 if q else 16
    group = 8
    lr = 1e-4
    sets = [
        "model.layers=0",  # the whole base (rl_debug.toml slices 2 layers)
        f"checkpoint.load_from={ctx.base_dcp}",
        "checkpoint.interval=0",
        f"training.steps={steps}",
        "training.warmup_steps=0",
        "training.weight_decay=0.0",
        f"training.lr={lr}",
        "rl.sft_warmup_steps=0",
        f"rl.eval_every={steps}",
        "rl.eval_prompts=64",  # every held-out prompt (the task has 55)
        f"rl.prompts_per_step={prompts}",
        f"rl.group_size={group}",
        "rl.max_new_tokens=4",
        "metrics.log_every=1",
    ]
    wargs = {
        "hf": ctx.base_hf,
        "steps": steps,
        "prompts": prompts,
        "group": group,
        "lr": lr,
        "threads": ctx.threads,
        "work": str(ctx.runs),
    }
    ours, peer = interleave(
        ctx,
        lambda: ts_train(ctx, "ts_grpo", "recipes/rl_debug.toml", sets),
        lambda: ctx.worker("trl_grpo", wargs),
    )
    # First update excluded (warm-up); titanscale's last update also runs the held-out
    # evaluation inside its timed step, so it is excluded too.
    t_ours = summarize([steady(r["step_times"], 1, drop_last=1) for r in ours])
    t_peer = summarize([steady(r["step_times"], 1) for r in peer])
    c_ours = summarize([steady_cpu(r["cpu_marks"], 1, drop_last=1) for r in ours])
    c_peer = summarize([steady_cpu(r["cpu_marks"], 1) for r in peer])

    def evals(r: dict) -> tuple[float, float]:
        ev = [e for e in r["events"] if e.get("event") == "rl_eval"]
        return ev[0]["eval_reward_mean"], ev[-1]["eval_reward_mean"]

    return {
        "config": {**wargs, "titanscale_sets": sets, "max_new_tokens": 4},
        "ours_step_s": t_ours,
        "peer_step_s": t_peer,
        "ratio": t_peer["median"] / t_ours["median"],
        "ours_cpu_s_per_step": c_ours,
        "peer_cpu_s_per_step": c_peer,
        "cpu_ratio": c_peer["median"] / c_ours["median"],
        "heldout_reward": {
            "ours_before": summarize([evals(r)[0] for r in ours]),
            "ours_after": summarize([evals(r)[1] for r in ours]),
            "peer_before": summarize([r["heldout_before"] for r in peer]),
            "peer_after": summarize([r["heldout_after"] for r in peer]),
        },
        "train_reward_mean": {
            "ours": summarize(
                [statistics.mean(x["reward_mean"] for x in r["records"]) for r in ours]
            ),
            "peer": summarize([statistics.mean(r["rewards"]) for r in peer]),
        },
        "process_wall_s": {
            "ours": summarize([r["process_wall_s"] for r in ours]),
            "peer": summarize([r["process_wall_s"] for r in peer]),
        },
        "load": [r["load_before"] for r in ours + peer],
    }


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


def dpo_data(ctx: Ctx, n: int) -> list[dict[str, list[int]]]:
    """Preference pairs on letter sorting: chosen = the sorted letters, rejected = reversed.
    The prompt ends at "Assistant:" and completions start with a space, so tokenizing
    prompt + completion as one string (what TRL does) splits exactly at the boundary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ctx.base_hf)
    recs = [json.loads(x) for x in Path(ctx.sft_jsonl).read_text().splitlines()[:n]]
    out = []
    for r in recs:
        letters = r["completion"].split()
        prompt = f"{tok.bos_token}User: {r['prompt']}\nAssistant:"
        chosen = " " + " ".join(letters) + tok.eos_token
        rejected = " " + " ".join(reversed(letters)) + tok.eos_token
        enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        out.append(
            {
                "prompt": prompt,
                "chosen": chosen,
                "rejected": rejected,
                "prompt_ids": enc(prompt),
                "chosen_ids": enc(chosen),
                "rejected_ids": enc(rejected),
            }
        )
    return out


def dpo_pair(ctx: Ctx, serve: Server) -> dict[str, Any]:
    q = ctx.quick
    steps = 3 if q else 8
    pairs_per_step = 8
    lr, beta = 1e-3, 0.1
    data = dpo_data(ctx, steps * pairs_per_step)
    data_path = ctx.work / "dpo_pairs.json"
    data_path.write_text(json.dumps(data))
    common = {
        "data": str(data_path),
        "steps": steps,
        "batch": pairs_per_step,
        "lr": lr,
        "beta": beta,
        "threads": ctx.threads,
        "work": str(ctx.runs),
    }
    ours, peer = interleave(
        ctx,
        lambda: ctx.worker(
            "tinker_dpo", {**common, "url": serve.url, "server_pid": serve.proc.pid}
        ),
        lambda: ctx.worker("trl_dpo", {**common, "hf": ctx.base_hf}),
    )
    t_ours = summarize([steady(r["step_times"], 1) for r in ours])
    t_peer = summarize([steady(r["step_times"], 1) for r in peer])
    c_ours = summarize([steady_cpu(r["cpu_marks"], 1) for r in ours])
    c_peer = summarize([steady_cpu(r["cpu_marks"], 1) for r in peer])
    o, p = ours[0], peer[0]
    return {
        "config": {**common, "lora": LORA, "pairs_per_step": pairs_per_step},
        "ours_step_s": t_ours,
        "peer_step_s": t_peer,
        "ratio": t_peer["median"] / t_ours["median"],
        "ours_cpu_s_per_step": c_ours,
        "peer_cpu_s_per_step": c_peer,
        "cpu_ratio": c_peer["median"] / c_ours["median"],
        "loss_step0": {
            "ours": o["losses"][0],
            "peer": p["losses"][0],
            "abs_diff": abs(o["losses"][0] - p["losses"][0]),
        },
        "logps_step0": {
            k: {"ours": o[k], "peer": p[k], "abs_diff": abs(o[k] - p[k])}
            for k in ("logps_chosen", "logps_rejected")
        },
        "loss_stepN": {"ours": o["losses"][-1], "peer": p["losses"][-1], "step": steps},
        "losses_by_step": {"ours": o["losses"], "peer": p["losses"]},
        "agree": abs(o["losses"][0] - p["losses"][0]) < TOL,
        "load": [r["load_before"] for r in ours + peer],
    }


def service_pair(ctx: Ctx, serve: Server, serve_start_s: float) -> dict[str, Any]:
    q = ctx.quick
    wargs = {
        "data": ctx.sft_tokens,
        "steps": 4 if q else 8,
        "batch": 8,
        "lr": 1e-3,
        "samples": 3 if q else 5,
        "max_tokens": 16,
        "threads": ctx.threads,
    }
    out: dict[str, Any] = {"config": wargs, "tools_serve_start_s": serve_start_s}
    python = ctx.args.skyrl_python
    if not python or not Path(python).exists():
        out["skyrl"] = f"not run: no skyrl-tx interpreter at {python!r} (install: {SKYRL_INSTALL})"
        return out
    try:
        sky, sky_start = start_skyrl(ctx, python)
    except RunFailed as e:
        out["skyrl"] = f"skyrl-tx did not start: {str(e)[-1500:]}"
        return out
    out["skyrl_start_s"] = sky_start
    try:
        ours, peer = interleave(
            ctx,
            lambda: ctx.worker(
                "tinker_script", {**wargs, "url": serve.url, "server_pid": serve.proc.pid}
            ),
            lambda: ctx.worker(
                "tinker_script",
                {**wargs, "url": sky.url, "server_pid": sky.proc.pid},
                python=python,
            ),
        )
    except RunFailed as e:
        out["skyrl"] = f"skyrl-tx failed during the script: {str(e)[-1500:]}"
        return out
    finally:
        sky.stop()
    for key, marks in (("train_step_s", "train_cpu_marks"), ("sample_s", "sample_cpu_marks")):
        a = summarize([steady(r[key], 1) for r in ours])
        b = summarize([steady(r[key], 1) for r in peer])
        ca = summarize([steady_cpu(r[marks], 1) for r in ours])
        cb = summarize([steady_cpu(r[marks], 1) for r in peer])
        out[key] = {"ours": a, "peer": b, "ratio": b["median"] / a["median"], "ours_cpu": ca,
                    "peer_cpu": cb, "cpu_ratio": cb["median"] / ca["median"]}  # fmt: skip
    out["first_call_s"] = {
        "ours": summarize([r["train_step_s"][0] for r in ours]),
        "peer": summarize([r["train_step_s"][0] for r in peer]),
    }
    out["loss_step0"] = {
        "ours": ours[0]["losses"][0],
        "peer": peer[0]["losses"][0],
        "abs_diff": abs(ours[0]["losses"][0] - peer[0]["losses"][0]),
    }
    out["sdk"] = {"ours": ours[0]["sdk"], "peer": peer[0]["sdk"]}
    out["load"] = [r["load_before"] for r in ours + peer]
    return out


# -- workers (peers.py --worker NAME ARGS): one side of a pair in its own process ---------
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


def _callback(clock: StepClock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.start()

        def on_step_end(self, args, state, control, **kw):
            clock.tick()

    return Clock()


def _hf_args(a: dict, **extra: Any) -> dict[str, Any]:
    """TrainingArguments both trainer peers share (titanscale's schedule: no warmup, linear
    decay to 0 at the last step, torchtitan's AdamW betas, clipping at 1, float32 on CPU)."""
    return dict(
        output_dir=str(Path(a["work"]) / f"hf_out_{os.getpid()}"),
        max_steps=a["steps"],
        learning_rate=a["lr"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=ADAM["beta1"],
        adam_beta2=ADAM["beta2"],
        adam_epsilon=ADAM["eps"],
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device() == "cpu",
        bf16=False,
        fp16=False,
        seed=0,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )


def device() -> str:
    """Where the peers run: CUDA when this machine has it, as train.py and tools.serve choose
    (only the CPU path has run: no GPU was lent)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )


def _peft_config():
    from peft import LoraConfig

    return LoraConfig(
        r=LORA["rank"],
        lora_alpha=LORA["alpha"],
        lora_dropout=0.0,
        target_modules=PEFT_TARGETS,
        bias="none",
        task_type="CAUSAL_LM",
    )


def w_trl_sft(a: dict) -> dict:
    """TRL SFTTrainer (+ PEFT LoRA) on the pre-tokenized examples."""
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(x) for x in Path(a["data"]).read_text().splitlines()]
    ds = datasets.Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(a["hf"])
    clock, losses = StepClock(), []

    class Recorded(SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kw):  # the raw loss, not the log's
            out = super().compute_loss(model, inputs, *args, **kw)
            loss = out[0] if isinstance(out, tuple) else out
            losses.append(float(loss.detach()))
            return out

    cfg = SFTConfig(
        **_hf_args(a),
        per_device_train_batch_size=a["batch"],
        max_length=a["max_length"],
        packing=a["packed"],
        packing_strategy="bfd",
        completion_only_loss=True,
        shuffle_dataset=False,
        train_sampling_strategy="sequential",
    )
    trainer = Recorded(
        model=_hf_model(a["hf"]),
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        peft_config=_peft_config() if a["lora"] else None,
        callbacks=[_callback(clock)],
    )
    first = trainer.get_train_dataloader().__iter__().__next__()
    trainer.train()
    return {
        "step_times": clock.times,
        "cpu_marks": clock.cpu_marks,
        "losses": losses,
        "first_batch_shape": list(first["input_ids"].shape),
    }


def w_hf_full(a: dict) -> dict:
    """transformers Trainer, full fine-tune, on the pre-tokenized examples (padded per batch)."""
    import datasets
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    rows = []
    for x in Path(a["data"]).read_text().splitlines():
        r = json.loads(x)
        ids, m = r["input_ids"], r["completion_mask"]
        rows.append(
            {"input_ids": ids, "labels": [t if k else -100 for t, k in zip(ids, m, strict=True)]}
        )
    ds = datasets.Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(a["hf"])
    clock, losses = StepClock(), []

    class Recorded(Trainer):
        def compute_loss(self, model, inputs, *args, **kw):
            out = super().compute_loss(model, inputs, *args, **kw)
            loss = out[0] if isinstance(out, tuple) else out
            losses.append(float(loss.detach()))
            return out

    args = TrainingArguments(
        **_hf_args(a),
        per_device_train_batch_size=a["batch"],
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
    )
    trainer = Recorded(
        model=_hf_model(a["hf"]),
        args=args,
        train_dataset=ds,
        data_collator=DataCollatorForSeq2Seq(tok, padding=True),
        callbacks=[_callback(clock)],
    )
    trainer.train()
    return {"step_times": clock.times, "cpu_marks": clock.cpu_marks, "losses": losses}


def _titan_model(dcp: str):
    """The base as torchtitan's model (recipes/debug.toml's model), weights from the DCP
    checkpoint (single process: torch.distributed.checkpoint without a process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp_api

    from recipe.loader import load_recipe
    from runtime.build import recipe_model_spec

    recipe = load_recipe(str(ROOT / "recipes" / "debug.toml"), [])
    model = recipe_model_spec(recipe).model.build()
    model.init_states()
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp_api.load(sd, checkpoint_id=dcp)
    model.load_state_dict(sd)
    return model.eval()  # float32 already (never `.to(dtype)`: it would cast RoPE's complex cache)


def w_gen(a: dict) -> dict:
    """rl.generator.Generator vs transformers generate, both sides in this process, timed
    interleaved; greedy outputs compared token for token."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from data.chat import make_renderer
    from rl.envs import make_env
    from rl.generator import Generator, SamplingParams

    torch.set_num_threads(a["threads"])
    tok = AutoTokenizer.from_pretrained(a["hf"])
    # Half arithmetic prompts (what the base was trained on), half letter-sorting chat prompts
    # of 3-5 letters (other lengths: left padding on both sides).
    n_ar = a["prompts"] // 2
    tasks = make_env("arithmetic", timeout_s=0).tasks("train", n_ar, seed=1)
    prompts = [
        [tok.bos_token_id] + tok(t.prompt, add_special_tokens=False)["input_ids"] for t in tasks
    ]
    renderer = make_renderer(a["hf"])
    lines = (ROOT / "data" / "tasks" / "letter_sort" / "train.jsonl").read_text().splitlines()
    for line in lines[: a["prompts"] - n_ar]:
        prompts.append(
            renderer.prompt_ids([{"role": "user", "content": json.loads(line)["prompt"]}])
        )
    dev = device()
    titan = _titan_model(a["dcp"]).to(dev)
    gen = Generator(titan, dtype=torch.float32, pad_id=tok.pad_token_id)
    hf = _hf_model(a["hf"]).to(dev).eval()
    hf.generation_config.eos_token_id = None  # fixed length on both sides (no stop token)
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), tok.pad_token_id)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    T, G = a["max_new"], a["group"]

    def ours(greedy: bool):
        params = SamplingParams(
            max_tokens=T, temperature=1.0, top_p=1e-9 if greedy else 1.0, n=1 if greedy else G,
            seed=0,
        )  # fmt: skip
        return [s.tokens for s in gen.generate(prompts, params)]

    def peer(greedy: bool):
        cfg = GenerationConfig(
            max_new_tokens=T, min_new_tokens=T, do_sample=not greedy, temperature=1.0, top_k=0,
            top_p=1.0, num_return_sequences=1 if greedy else G, pad_token_id=tok.pad_token_id,
            eos_token_id=None, use_cache=True,
        )  # fmt: skip
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, P:].tolist()

    res: dict[str, Any] = {
        f"{who}_{mode}_{unit}": []
        for who in ("ours", "peer")
        for mode in ("greedy", "sampled")
        for unit in ("s", "cpu_s")
    }
    ours(True), peer(True)  # warm-up (first-call allocations), not timed
    for r in range(a["repeats"] + 1):
        for mode, greedy in (("greedy", True), ("sampled", False)):
            order = [("ours", ours), ("peer", peer)]
            if r % 2:
                order.reverse()
            for who, fn in order:
                t0, c0 = time.perf_counter(), time.process_time()
                out = fn(greedy)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if r > 0:  # repeat 0 is a second warm-up
                    res[f"{who}_{mode}_s"].append(dt)
                    res[f"{who}_{mode}_cpu_s"].append(dc)
                if mode == "greedy":
                    res[f"_{who}_greedy_out"] = out
                lengths = {len(x) for x in out}
                assert lengths == {T}, f"{who} {mode}: completion lengths {lengths}, expected {T}"
    a_out, b_out = res.pop("_ours_greedy_out"), res.pop("_peer_greedy_out")
    same = sum(x == y for x, y in zip(a_out, b_out, strict=True))
    first_diff = [next((j for j, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), None)
                  for x, y in zip(a_out, b_out, strict=True)]  # fmt: skip
    res["greedy_identical"] = {
        "rows": len(a_out),
        "identical": same,
        "first_difference_at": first_diff,
    }
    res["prompt_lengths"] = sorted({len(p) for p in prompts})
    res["greedy_tokens"] = len(prompts) * T
    res["sampled_tokens"] = len(prompts) * G * T
    return res


def _heldout_reward(model, tok, env) -> float:
    """Greedy decoding (transformers generate, KV cache) on every held-out prompt; the mean
    reward (what titanscale's rl_eval reports for its own model)."""
    import torch

    tasks = env.tasks("eval", 10_000, seed=0)
    prompts = [
        [tok.bos_token_id] + tok(t.prompt, add_special_tokens=False)["input_ids"] for t in tasks
    ]
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
            max_new_tokens=4, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    rs = []
    for t, row in zip(tasks, out[:, P:].tolist(), strict=True):
        text = tok.decode(row, skip_special_tokens=True)
        rs.append(env.reward(t, text))
    return sum(rs) / len(rs)


def w_trl_grpo(a: dict) -> dict:
    """TRL GRPOTrainer on the arithmetic environment of rl/envs.py, full weights."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rl.envs import Task, make_env

    env = make_env("arithmetic", timeout_s=0)  # the whole split below: no 60 s hook guard
    tok = AutoTokenizer.from_pretrained(a["hf"])
    tasks = env.tasks("train", 100_000, seed=0)
    ds = datasets.Dataset.from_list(
        [{"prompt": tok.bos_token + t.prompt, "answer": t.answer} for t in tasks]
    )
    rewards: list[float] = []

    def reward(prompts, completions, answer, **kw):
        rs = [
            env.reward(Task(p, x), c) for p, c, x in zip(prompts, completions, answer, strict=True)
        ]
        rewards.extend(rs)
        return rs

    model = _hf_model(a["hf"])
    before = _heldout_reward(model, tok, env)
    clock = StepClock()
    cfg = GRPOConfig(
        **_hf_args(a),
        per_device_train_batch_size=a["prompts"] * a["group"],
        num_generations=a["group"],
        steps_per_generation=1,
        max_completion_length=4,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token mean over the batch: rl.losses' token_mean
        scale_rewards="group",
        num_iterations=1,
    )
    model.train()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
        callbacks=[_callback(clock)],
    )  # fmt: skip
    trainer.train()
    after = _heldout_reward(trainer.model, tok, env)
    return {"step_times": clock.times, "cpu_marks": clock.cpu_marks, "heldout_before": before,
            "heldout_after": after, "rewards": rewards}  # fmt: skip


def w_trl_dpo(a: dict) -> dict:
    """TRL DPOTrainer + PEFT LoRA (reference = the base, adapters disabled)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    data = json.loads(Path(a["data"]).read_text())
    ds = datasets.Dataset.from_list(
        [{k: d[k] for k in ("prompt", "chosen", "rejected")} for d in data]
    )
    tok = AutoTokenizer.from_pretrained(a["hf"])
    clock, losses, metrics = StepClock(), [], []

    class Recorded(DPOTrainer):
        def compute_loss(self, model, inputs, *args, **kw):
            out = super().compute_loss(model, inputs, *args, **kw)
            loss = out[0] if isinstance(out, tuple) else out
            losses.append(float(loss.detach()))
            m = self._metrics["train"]
            metrics.append({k: m[k][-1] for k in ("logps/chosen", "logps/rejected")})
            return out

    cfg = DPOConfig(
        **_hf_args(a),
        per_device_train_batch_size=a["batch"],
        beta=a["beta"],
        loss_type=["sigmoid"],
        train_sampling_strategy="sequential",
    )
    trainer = Recorded(
        model=_hf_model(a["hf"]), args=cfg, train_dataset=ds, processing_class=tok,
        peft_config=_peft_config(), callbacks=[_callback(clock)],
    )  # fmt: skip
    # Same tokens as the service side: TRL's own tokenization of the first pair.
    first = trainer.train_dataset[0]
    for k in ("prompt_ids", "chosen_ids", "rejected_ids"):
        if list(first[k]) != data[0][k]:
            raise AssertionError(f"TRL tokenized {k} differently: {list(first[k])} vs {data[0][k]}")
    trainer.train()
    return {
        "step_times": clock.times,
        "cpu_marks": clock.cpu_marks,
        "losses": losses,
        "logps_chosen": metrics[0]["logps/chosen"],
        "logps_rejected": metrics[0]["logps/rejected"],
    }


def _tinker_client(url: str):
    import tinker

    sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    base = sc.get_server_capabilities().supported_models[0].model_name
    return sc, base


def w_tinker_dpo(a: dict) -> dict:
    """DPO through the Tinker API: reference log-probs from `forward` before training (the
    policy is then the base: LoRA B = 0), then forward_backward_custom with the DPO loss and
    optim_step per batch."""
    import torch
    import torch.nn.functional as F
    from tinker import types

    torch.set_num_threads(a["threads"])
    data = json.loads(Path(a["data"]).read_text())
    sc, base = _tinker_client(a["url"])
    tc = sc.create_lora_training_client(base_model=base, rank=LORA["rank"], seed=0)

    def datum(prompt: list[int], completion: list[int]):
        toks = prompt + completion
        w = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
        return types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": w},
        )

    B = a["batch"]
    batches = []
    for s in range(a["steps"]):
        rows = data[s * B : (s + 1) * B]
        ds = []
        for d in rows:  # [chosen, rejected] per pair
            ds += [
                datum(d["prompt_ids"], d["chosen_ids"]),
                datum(d["prompt_ids"], d["rejected_ids"]),
            ]
        batches.append(ds)

    def seq_logps(ds, logprobs) -> list[torch.Tensor]:
        return [
            (lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum()
            for d, lp in zip(ds, logprobs, strict=True)
        ]

    refs = []
    for ds in batches:  # the policy is the base until the first optim_step
        out = tc.forward(ds, "cross_entropy").result()
        refs.append(
            [
                float(x)
                for x in seq_logps(ds, [o["logprobs"].to_torch() for o in out.loss_fn_outputs])
            ]
        )
    clock, losses, first = StepClock(a["server_pid"]), [], {}
    beta, lr, N = a["beta"], a["lr"], a["steps"]
    clock.start()
    for s, ds in enumerate(batches):
        ref = torch.tensor(refs[s])

        def dpo_loss(data_, logprobs, ref=ref):
            lp = torch.stack(seq_logps(data_, logprobs))
            c, r = lp[0::2], lp[1::2]
            margin = (c - ref[0::2]) - (r - ref[1::2])
            loss = -F.logsigmoid(beta * margin).mean()
            if not first:
                first.update(chosen=float(c.mean()), rejected=float(r.mean()))
            return loss, {"dpo_loss": float(loss)}

        res = tc.forward_backward_custom(ds, dpo_loss).result()
        # TRL's linear schedule: step k (0-based) uses lr * (1 - k / N).
        tc.optim_step(types.AdamParams(learning_rate=lr * (1 - s / N), beta1=ADAM["beta1"],
                                       beta2=ADAM["beta2"], eps=ADAM["eps"])).result()  # fmt: skip
        clock.tick()
        losses.append(float(res.metrics["dpo_loss"]))
    sc.close("success").result() if hasattr(sc, "close") else None
    return {"step_times": clock.times, "cpu_marks": clock.cpu_marks, "losses": losses,
            "logps_chosen": first["chosen"], "logps_rejected": first["rejected"]}  # fmt: skip


def w_tinker_script(a: dict) -> dict:
    """The service script: LoRA client, forward_backward + optim_step per step, then a
    sampling client and `sample` (8 samples per call). Runs in any venv with the SDK."""
    import numpy as np
    import tinker
    from tinker import types

    rows = [json.loads(x) for x in Path(a["data"]).read_text().splitlines()[: a["batch"]]]
    data = []
    for r in rows:
        ids, m = r["input_ids"], r["completion_mask"]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [float(x) for x in m[1:]]},
            )
        )
    sc, base = _tinker_client(a["url"])
    tc = sc.create_lora_training_client(base_model=base, rank=LORA["rank"], seed=0)
    train, sample, losses = StepClock(a["server_pid"]), StepClock(a["server_pid"]), []
    train.start()
    for _ in range(a["steps"]):
        fb = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=a["lr"], beta1=ADAM["beta1"],
                                       beta2=ADAM["beta2"], eps=ADAM["eps"])).result()  # fmt: skip
        train.tick()
        lp = np.concatenate([np.asarray(o["logprobs"].tolist()) for o in fb.loss_fn_outputs])
        w = np.concatenate([np.asarray(d.loss_fn_inputs["weights"].tolist()) for d in data])
        losses.append(float(-(lp * w).sum() / w.sum()))
        train.start()  # the loss bookkeeping above is not the service's time
    sampler = tc.save_weights_and_get_sampling_client(name="peers")
    prompt = types.ModelInput.from_ints(rows[0]["input_ids"][: rows[0]["completion_mask"].index(1)])
    sample.start()
    for _ in range(a["samples"]):
        sampler.sample(prompt=prompt, num_samples=8,
                       sampling_params=types.SamplingParams(max_tokens=a["max_tokens"],
                                                            temperature=1.0)).result()  # fmt: skip
        sample.tick()
    return {"train_step_s": train.times, "train_cpu_marks": train.cpu_marks,
            "sample_s": sample.times, "sample_cpu_marks": sample.cpu_marks, "losses": losses,
            "sdk": f"tinker {tinker.__version__}"}  # fmt: skip


WORKERS = {
    "trl_sft": w_trl_sft,
    "hf_full": w_hf_full,
    "gen": w_gen,
    "trl_grpo": w_trl_grpo,
    "trl_dpo": w_trl_dpo,
    "tinker_dpo": w_tinker_dpo,
    "tinker_script": w_tinker_script,
}


def run_worker(name: str, raw: str) -> None:
    a = json.loads(raw)
    sys.path.insert(0, str(ROOT))
    if "threads" in a:
        try:
            import torch

            torch.set_num_threads(a["threads"])
        except ImportError:
            pass
    out = WORKERS[name](a)
    print("RESULT " + json.dumps(out), flush=True)


# -- report ----------------------------------------------------------------------------------
def versions(skyrl_python: str | None) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "torchtitan", "transformers", "trl", "peft", "accelerate", "datasets",
                "tinker"):  # fmt: skip
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    if skyrl_python and Path(skyrl_python).exists():
        code = (
            "from importlib.metadata import version as v;"
            "print(' '.join(f'{p}={v(p)}' for p in ('skyrl-tx','jax','transformers','tinker')))"
        )
        p = subprocess.run([skyrl_python, "-c", code], capture_output=True, text=True)
        out["skyrl_venv"] = p.stdout.strip() or p.stderr.strip()[-200:]
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    out["titanscale_commit"] = git.stdout.strip()
    return out


def fmt_s(s: dict, digits: int = 3) -> str:
    if s["median"] is None:
        return "n/a"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _loss0(r: dict, required: bool = True) -> str:
    l0 = r.get("loss_step0")
    if not l0:
        return ""
    mark = "" if l0["abs_diff"] < TOL or not required else " **(> 1e-4)**"
    return f"{l0['ours']:.6f} / {l0['peer']:.6f} ({l0['abs_diff']:.1e}){mark}"


def ratio_rows(P: dict[str, Any]) -> list[tuple[str, str, str, str, str, float, float, str]]:
    """(pair, ours, peer, ours' figure, peer's figure, wall ratio, CPU ratio, step-0 loss)."""
    rows = []
    for key, ours, peer in (
        ("sft_lora_packed", "LoRA SFT, packing bfd", "TRL SFTTrainer + PEFT, packing bfd"),
        ("sft_lora_unpacked", "LoRA SFT, packing none", "TRL SFTTrainer + PEFT, no packing"),
        ("full_ft", "full fine-tune, packing none", "transformers Trainer"),
    ):
        r = P.get(key)
        if r and "error" not in r:
            rows.append((key, ours, peer, f"{r['ours_tokens_per_s']:,.0f} tok/s "
                         f"({r['ours_tokens_per_cpu_s']:,.0f}/CPU-s)",
                         f"{r['peer_tokens_per_s']:,.0f} tok/s ({r['peer_tokens_per_cpu_s']:,.0f}/CPU-s)",
                         r["ratio"], r["cpu_ratio"], _loss0(r)))  # fmt: skip
    g = P.get("generate")
    if g and "error" not in g:
        for mode in ("greedy", "sampled"):
            r = g[mode]
            rows.append((f"generate, {mode}", "rl.generator.Generator",
                         "transformers generate (KV cache)", f"{r['ours_tokens_per_s']:,.0f} tok/s",
                         f"{r['peer_tokens_per_s']:,.0f} tok/s", r["ratio"], r["cpu_ratio"], ""))  # fmt: skip
    r = P.get("grpo")
    if r and "error" not in r:
        rows.append(("grpo", "train.py, recipes/rl_debug.toml", "TRL GRPOTrainer",
                     f"{fmt_s(r['ours_step_s'])} s/update", f"{fmt_s(r['peer_step_s'])} s/update",
                     r["ratio"], r["cpu_ratio"], ""))  # fmt: skip
    r = P.get("dpo")
    if r and "error" not in r:
        rows.append(("dpo", "tools.serve, forward_backward_custom", "TRL DPOTrainer + PEFT",
                     f"{fmt_s(r['ours_step_s'])} s/step", f"{fmt_s(r['peer_step_s'])} s/step",
                     r["ratio"], r["cpu_ratio"], _loss0(r)))  # fmt: skip
    s = P.get("service", {})
    for key, what in (
        ("train_step_s", "forward_backward + optim_step"),
        ("sample_s", "sample, 8 x 16 tokens"),
    ):
        if key in s:
            r = s[key]
            rows.append((f"service: {what}", "tools.serve", "skyrl-tx Tinker server",
                         f"{fmt_s(r['ours'])} s", f"{fmt_s(r['peer'])} s", r["ratio"],
                         r["cpu_ratio"], _loss0(s, False) if key == "train_step_s" else ""))  # fmt: skip
    return rows


FINDINGS = """
## Where titanscale was slower, why, and what it takes

Profiles: py-spy 0.4.3 (`py-spy record -f raw -r 100 -- python train.py ...`, the `bench`
group), shares of the samples inside the training step; CPU seconds per step read from /proc
as in the table. Measured on this machine on 2026-12-03, at load averages of 7 to 10.

Fixed by #30 itself (branch `peers`; every column of the table includes them):

1. **Dense CPU attention compiled its masks for every new batch shape** (all pairs on CPU).
   torchtitan builds each BlockMask with a `torch.compile`d `create_block_mask`; on CPU the
   inductor compile took 8 s for the first shape and 27 s when a second shape made torch
   recompile with dynamic shapes (under load). GRPO's rollout lengths change every update,
   so its first two updates took 22-24 s each (4 x 8 rollouts; TRL: 0.7 s), and
   tools.serve's first forward_backward took 25 s. The dense backend reads only the mask's
   `mask_mod`: it now gets a BlockMask of index tensors (all tiles partial) built in
   microseconds, no compile (`kernels/dense_attention.py`, `tests/unit/test_dense_masks.py`).
   The service's first forward_backward + optim_step now takes under 0.5 s (skyrl-tx: 7-30 s
   of JAX compiles).
2. **`packing = "none"` padded every row to seq_len.** 26-token examples at seq_len 256 cost
   10x their tokens: LoRA SFT without packing ran at 0.10-0.17 of TRL's speed (TRL pads to the
   longest row of the batch). Each batch is now cut after its last trained pair, rounded up to
   8 (`data.loader.trim_padding`, enabled by `runtime.build.padding_trim` where shapes may vary;
   loss and gradients unchanged, tested against the full rows and, here, TRL's step-0 loss).

Fixed by the #30 follow-up (branch `perf`, 2026-12-03); the table's 'at a46af49' column is
main just before these three changes (the same command, `--pairs` of the rows they touch),
'at f4fdbcd' the first published run (the `peers` branch, before main's step layer, RL and
generator merges: those moved some rows too, e.g. sampled generation through clients' one
prefill per prompt shared by its samples):

3. **FSDP2 on a single process** (full fine-tune, LoRA without packing). torchtitan's
   `parallelize_llama` applies `fully_shard` even at dp_shard 1 (for its mixed-precision
   policy); its hooks and gradient copies (post-backward `foreach_reduce` copy-in/copy-out of
   every gradient, unshard waits) were 20% of a one-process full fine-tune step.
   `runtime/build.py` `unsharded_when_alone` wraps the model's parallelize function: one
   process with parameters, compute and reductions in float32 and no CPU offload (FSDP2 is
   then the identity) runs the rest of torchtitan's function (spmd-types state, activation
   checkpointing, per-block compile) without `fully_shard`; any other run is unchanged.
   Loss and grad norm bit-identical to the forced-FSDP2 path, the LoRA base frozen also under
   activation checkpointing, a one-process checkpoint resumes under FSDP2 at 2 processes
   (`tests/integration/test_one_process_unsharded.py`).
5. **GRPO recomputed pi_old with a full extra forward** (19% of an update). In sync mode with
   every sample at lag 0, one optimizer step per batch, no KL reference and a built-in loss,
   pi_old is the training forward's own log-probs, detached (TRL skips the extra forward in
   that case, `num_iterations = 1`). `PolicyTrainer.forward_backward_on_policy` (rl/trainer.py,
   runtime/steps.py) forwards each microbatch once; `RLRun.train_on` (rl/loop.py) takes it
   only in that case. The same update as the two-pass path within 1e-6 for every built-in loss
   (`tests/unit/test_rl_on_policy.py`); the held-out reward after 8 updates is the same as
   before (0.705 here).
6. **Greedy decoding sorted the vocabulary** (18% of greedy decoding CPU, plus a multinomial
   draw, 7%). `rl/generator.py` now takes an argmax when top_p keeps only the top token in
   every row (the RL loop's held-out evaluation, top_p 1e-9) or the temperature puts all the
   mass on it (the service's temperature 0 -> 1e-6): the same tokens and log-probs as the
   draw (`tests/unit/test_rl_greedy.py`); 16 of 16 greedy rows identical to transformers.

   Effect, titanscale's CPU seconds per step at a46af49 -> this run (the peer's within noise):
   full fine-tune 0.207 -> 0.144 (-30%), LoRA without packing 0.139 -> 0.107 (-23%), GRPO
   0.79 -> 0.57 per update (-28%: the scoring pass and, in the same one-process run, FSDP2's
   hooks), greedy generation 0.185 -> 0.167 s (-10%). Sampled generation does not take the
   argmax path (1.47 -> 1.43: noise).

Measured, not fixed (what the remaining gaps are; proposals for the lead):

4. **The padding cut rounds up to 8** (what is left of the full fine-tune and unpacked LoRA
   gaps, 0.85 and 0.98; profiled before fixes 3, 5 and 6, not re-profiled) because
   torchtitan's `ChunkedLossWrapper` splits each row into 8 equal chunks: 26-token examples become 32-token rows (+23% tokens against TRL's 26;
   on realistic lengths, hundreds of tokens, this is < 3%). Chunking also costs its own
   overhead (8 lm_head + loss calls per step; 12% of a full fine-tune step including the
   lm_head work itself). What it takes: one chunk when a microbatch's logits are small
   (`local_batch_size x seq_len x vocab x 4 bytes` under ~64 MiB), taken from one function that
   `runtime/build.py`'s loss config, `recipe/model_checks.check_loss_chunks` and
   `padding_trim` all use. Not done here: it changes the loss summation of every small run and
   the seq_len rule existing tests pin.
7. **DPO and the service's forward_backward got slower on main: glibc's mmap threshold**
   (found by this rerun; profiled 2026-12-03). titanscale's CPU per DPO step: 0.275 s at
   f4fdbcd, 0.450 at a46af49, 0.505 here; the service's forward_backward + optim_step 0.113 ->
   0.231 s. Cause: `mallopt(M_MMAP_THRESHOLD, 128 KiB)` in `service/server.py` (#24, to bound
   the RSS across requests) made every tensor over 128 KiB a fresh mapping, zero-filled by page
   faults and unmapped at free. Measured by `python benchmarks/service_step_cpu.py [--dpo]
   [--root <git archive of a commit>]` (the server's CPU time and minor faults; debug model,
   LoRA rank 16, 8 x 96 tokens, 10 steps after 3, 2 runs each, load ~2):
   cross_entropy step 0.68-0.73 CPU s and ~166,000 faults at 128 KiB, 0.37-0.41 s and
   ~11,000-18,000 without the call, 0.35 s at f4fdbcd; forward_backward_custom (DPO's path)
   0.99-1.08 -> 0.54-0.59 s, ~242,000 -> ~32,000 faults. The step layer (#23) is not the cost.
   Fixed on the `svcperf` branch: the threshold is 4 MiB (MMAP_THRESHOLD_BYTES; 0.41-0.45 s,
   ~18,000-30,000 faults); peak RSS of `tests/integration/test_service_admission.py`'s 16
   chunks at a46af49: +117 MiB at 128 KiB, +126 at 2 MiB, +162-169 at 4 MiB, +270 without
   (budget 256). The peers rows above predate the fix.
   TRL's DPO also got faster between the runs (0.318 -> 0.270-0.289 CPU s/step, load 3 ->
   2). skyrl-tx stays 10.8x slower per training step and 7.6x per sample call.

Faster than the peer (not profiled further): LoRA SFT with packing (TRL + PEFT: separate
q/k/v adapters, padding-free attention over one flattened row), sampled generation (one
prefill per prompt shared by its 8 samples), GRPO, and the Tinker service against skyrl-tx (its model runs in JAX on
CPU; its first calls compile for 10-30 s, which the ratios exclude).

Notes on the comparison: TRL's `gradient_checkpointing` (its default True) is off on the peer
side, as titanscale's `activation_checkpoint = "none"`; AdamW betas (0.9, 0.95) on both sides;
the LR schedules are the same (no warmup, linear decay to 0: torchtitan's step t uses
lr x (1 - (t - 1) / T), transformers' step k = t - 1 uses lr x (T - k) / T). titanscale's LoRA
adapts the fused wqkv with one A for q, k and v (PEFT: separate q/k/v adapters): same rank,
alpha and modules, different parametrization, hence equal losses at step 0 (B = 0) and close
but different ones after. The packed pair cuts titanscale's rows at 200 pairs (8 examples)
because its bfd packer holds back rows that are not full, which would put other examples than
TRL's in the first batches. TRL's bfd packing on CPU is exact only because transformers
builds a block-diagonal mask from the position ids when no KV cache is passed (TRL passes
`use_cache=False`); a forward with the cache on attends across the packed documents.
"""


def details(P: dict[str, Any]) -> list[str]:
    """Per pair: what was run, the loss agreement, quality figures, start-up costs."""
    L = ["", "## Per pair", ""]
    for key in ("sft_lora_packed", "sft_lora_unpacked", "full_ft"):
        r = P.get(key)
        if not r or "error" in r:
            continue
        c = r["config"]
        ln = r["loss_stepN"]
        L.append(
            f"- **{key}**: {c['steps']} steps ({c['warmup_steps_excluded']} warm-up steps not "
            f"timed), {c['rows_per_step']} rows x {c['examples_per_row']} examples = "
            f"{c['tokens_per_step']} tokens per step ({c['trained_tokens_per_step']} trained), "
            f"lr {c['lr']}, no warmup then linear decay, AdamW betas (0.9, 0.95), clip 1.0, "
            f"float32; titanscale rows of {c['seq_len_titanscale_pairs']} next-token pairs"
            + (
                " (each batch cut after its last trained pair, rounded up to 8: "
                "data.loader.trim_padding)"
                if "unpacked" in key or key == "full_ft"
                else ""
            )
            + f", the peer's max_length {c['max_length_peer_tokens']} tokens. Step-0 loss "
            f"{_loss0(r)}; the same in every repeat on each side (spread "
            f"{r['loss_step0_spread_over_repeats']:.1e}). Loss after step {ln['step']}: "
            f"{ln['ours']:.4f} ours, {ln['peer']:.4f} peer. Process wall (start-up, training, "
            f"exit): {fmt_s(r['process_wall_s']['ours'], 1)} s ours, "
            f"{fmt_s(r['process_wall_s']['peer'], 1)} s peer."
        )
    g = P.get("generate")
    if g and "error" not in g:
        gi, c = g["greedy_identical"], g["config"]
        L.append(
            f"- **generate**: {c['prompts']} prompts (lengths {g['prompt_lengths']} tokens: half "
            f"arithmetic, half letter-sorting chat prompts, left-padded), {c['max_new']} new "
            f"tokens per row with no stop token, float32, KV cache on both sides; sampled: "
            f"{c['group']} samples per prompt at temperature 1 (transformers: top_k 0). Greedy "
            f"outputs identical in {gi['identical']} of {gi['rows']} rows (first differing "
            f"position per row: {gi['first_difference_at']})."
        )
    r = P.get("grpo")
    if r and "error" not in r:
        c, h = r["config"], r["heldout_reward"]
        L.append(
            f"- **grpo**: arithmetic (rl/envs.py), {c['steps']} updates of {c['prompts']} prompts "
            f"x {c['group']} samples, max 4 new tokens, lr {c['lr']}, clip 0.2 / 0.28, no KL, "
            "token-mean loss (TRL loss_type 'dapo'), group-normalized advantages, one optimizer "
            "step per batch, full weights. Held-out reward (greedy, all 55 held-out prompts): "
            f"ours {fmt_s(h['ours_before'])} -> {fmt_s(h['ours_after'])}, TRL "
            f"{fmt_s(h['peer_before'])} -> {fmt_s(h['peer_after'])} (ours: titanscale's rl_eval; "
            "TRL: transformers generate on its trained model; the two evaluators agree on the "
            "base, the 'before' column). Mean training reward "
            f"{fmt_s(r['train_reward_mean']['ours'])} ours, {fmt_s(r['train_reward_mean']['peer'])} "
            "TRL. The first update is not timed, nor titanscale's last (it runs the held-out "
            "evaluation inside its timed step)."
        )
    r = P.get("dpo")
    if r and "error" not in r:
        lp = r["logps_step0"]
        ln = r["loss_stepN"]
        L.append(
            f"- **dpo**: letter-sorting pairs (chosen = sorted, rejected = reversed), "
            f"{r['config']['pairs_per_step']} pairs per step, beta {r['config']['beta']}, "
            f"LoRA rank {LORA['rank']} alpha {LORA['alpha']:g}, lr {r['config']['lr']} linear "
            "decay. titanscale: tinker SDK against tools.serve, reference log-probs from "
            "`forward` before training, the DPO loss in forward_backward_custom (the SDK "
            "computes it client-side and sends per-token gradients). Step 0: loss "
            f"{_loss0(r)} (policy = reference: ln 2 on both sides); sequence log-probs "
            f"chosen {lp['logps_chosen']['ours']:.5f} / {lp['logps_chosen']['peer']:.5f} "
            f"(diff {lp['logps_chosen']['abs_diff']:.1e}), rejected "
            f"{lp['logps_rejected']['ours']:.5f} / {lp['logps_rejected']['peer']:.5f} (diff "
            f"{lp['logps_rejected']['abs_diff']:.1e}). Loss after step {ln['step']}: "
            f"{ln['ours']:.4f} ours, {ln['peer']:.4f} TRL. CPU: the service's process plus the "
            "client's against TRL's one process."
        )
    s = P.get("service")
    if s and "train_step_s" in s:
        f = s["first_call_s"]
        L.append(
            f"- **service**: the same script (peers.py `w_tinker_script`: LoRA rank {LORA['rank']}, "
            f"{s['config']['steps']} x (forward_backward of {s['config']['batch']} examples + "
            f"optim_step), save_weights_and_get_sampling_client, {s['config']['samples']} x "
            f"sample(8 x {s['config']['max_tokens']} tokens)); SDK {s['sdk']['ours']} against "
            f"tools.serve, {s['sdk']['peer']} against skyrl-tx (0.3.0 predates the SDK's "
            "/api/v1/client/config; tools.serve needs the newer SDK's protobuf requests). "
            f"Step-0 loss {_loss0(s, False)}. First forward_backward + optim_step (not in the ratios): "
            f"{fmt_s(f['ours'], 1)} s ours, {fmt_s(f['peer'], 1)} s skyrl-tx (JAX compiles). "
            f"Server start to healthy: {s['tools_serve_start_s']:.0f} s tools.serve, "
            f"{s.get('skyrl_start_s', float('nan')):.0f} s skyrl-tx (its engine process loads "
            "the model after that)."
        )
    return L


def before_of(earlier: dict[str, Any]) -> dict[str, Any]:
    """An earlier run's ratios per table row, with its date, commit and load: the 'before'
    columns of a rerun (`--before`), kept in the new .json so the report stands alone."""
    m = earlier["meta"]
    return {
        "date": m["date"],
        "commit": m["versions"].get("titanscale_commit", "?"),
        "command": m["command"],
        "load_median": m["load_median"],
        "ratios": {row[0]: [row[5], row[6]] for row in ratio_rows(earlier["pairs"])},
    }


def write_report(results: dict[str, Any], out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    m = results["meta"]
    P = results["pairs"]
    L: list[str] = [
        "# titanscale side by side with its peers (CPU)",
        "",
        f"`{m['command']}`, {m['date']}, {m['wall_minutes']:.1f} minutes. {m['machine']}; "
        f"{m['threads']} thread(s) per process, one process at a time, {m['repeats']} "
        "repeat(s) per side, the sides interleaved (ours, peer, peer, ours, ...).",
        "",
        f"Load average (1 min) at the start of each run: {m['load_min']:.1f} to "
        f"{m['load_max']:.1f}, median {m['load_median']:.1f}, on 2 cores: other jobs shared "
        "the machine. Wall times therefore depend on the moment; CPU time (user + system of "
        "the processes doing the work: train.py, the peer's process, the server's process tree "
        "plus its client) counts the work itself and is the figure to compare. Both are given.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        "",
        f"skyrl-tx install (its own venv, it pins transformers < 5): `{m['skyrl_install']}`.",
        "",
        "## Ratios: ours / peer (> 1 = titanscale faster)",
        "",
        "Median over repeats [min-max]; per run, the median step after the warm-up steps (wall) "
        "or the mean CPU seconds per step over the same steps.",
        "",
    ]
    befores = results.get("before", [])
    for b in befores:
        L.append(
            f"- 'at {b['commit']}': CPU ratio (wall ratio) of `{b['command']}` at titanscale "
            f"commit {b['commit']}, {b['date']}, median load {b['load_median']:.1f} (`--before`)."
        )
    L += [
        "" if befores else None,
        "| pair | titanscale | peer | ours | peer | wall ratio | CPU ratio | "
        + "".join(f"at {b['commit']} | " for b in befores)
        + "step-0 loss ours / peer (abs diff) |",
        "|---|---|---|---|---|---|---|" + "---|" * len(befores) + "---|",
    ]
    L = [x for x in L if x is not None]
    for name, ours, peer, a, b, wr, cr, loss in ratio_rows(P):
        was = "".join(
            f"{r[1]:.2f} ({r[0]:.2f}) | " if r else "| "
            for r in (bf["ratios"].get(name) for bf in befores)
        )
        L.append(
            f"| {name} | {ours} | {peer} | {a} | {b} | {wr:.2f} | **{cr:.2f}** | {was}{loss} |"
        )
    L.append("")
    for name, r in P.items():
        if isinstance(r, dict) and "error" in r:
            L.append(f"- **{name} did not run**: {r['error'][-600:]}")
    s = P.get("service", {})
    if isinstance(s.get("skyrl"), str):
        L.append(f"- **service / skyrl-tx**: {s['skyrl']}")
    L += details(P)
    L += ["", FINDINGS.strip()]
    out.with_suffix(".md").write_text("\n".join(L) + "\n")


# -- main --------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("NAME", "ARGS_JSON"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smoke test: few steps, 1 repeat")
    ap.add_argument(
        "--repeats", type=int, default=None, help="repeats per pair (default 2; quick 1)"
    )
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"subset of {','.join(PAIRS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument(
        "--base-steps", type=int, default=None, help="base training steps (150; quick 30)"
    )
    ap.add_argument("--out", default="benchmarks/peers", help="writes OUT.md and OUT.json")
    ap.add_argument(
        "--before",
        action="append",
        default=[],
        help="an earlier run's .json: its ratios as a column (repeatable)",
    )
    ap.add_argument("--work", default="outputs/peers", help="base cache and run folders")
    ap.add_argument(
        "--skyrl-python",
        default=str(ROOT / ".venv-skyrl" / "bin" / "python"),
        help="interpreter of the skyrl-tx venv ('' = skip skyrl-tx)",
    )
    args = ap.parse_args()
    if args.worker:
        run_worker(*args.worker)
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_data_scale import cpu_name

    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        ap.error(f"--pairs: unknown {unknown}; expected a subset of {','.join(PAIRS)}")
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.base_steps is None:
        args.base_steps = 30 if args.quick else 150
    befores = [before_of(json.loads(Path(b).read_text())) for b in args.before]
    t_start = time.perf_counter()
    ctx = Ctx(args)
    try:
        prepare(ctx)
    except RunFailed as e:
        raise SystemExit(f"peers: the base could not be prepared: {e}") from None
    results: dict[str, Any] = {"pairs": {}}
    serve: Server | None = None
    serve_start = 0.0
    try:
        for name in pairs:
            print(f"[peers] {name}", flush=True)
            try:
                if name == "sft_lora_packed":
                    r = sft_pair(ctx, lora=True, packed=True)
                elif name == "sft_lora_unpacked":
                    r = sft_pair(ctx, lora=True, packed=False)
                elif name == "full_ft":
                    r = sft_pair(ctx, lora=False, packed=False)
                elif name == "generate":
                    r = gen_pair(ctx)
                elif name == "grpo":
                    r = grpo_pair(ctx)
                else:
                    if serve is None:
                        serve, serve_start = start_serve(ctx)
                    r = (
                        dpo_pair(ctx, serve)
                        if name == "dpo"
                        else service_pair(ctx, serve, serve_start)
                    )
            except RunFailed as e:
                r = {"error": str(e)[-3000:]}
                print(f"[peers] {name} failed: {r['error']}", flush=True)
            results["pairs"][name] = r
            print(json.dumps({name: {k: v for k, v in r.items() if k != "config"}}, default=str)[:1500],
                  flush=True)  # fmt: skip
    finally:
        if serve is not None:
            serve.stop()
    loads = ctx.loads or [os.getloadavg()[0]]
    cmd = "python benchmarks/peers.py " + " ".join(sys.argv[1:])
    results["meta"] = {
        "command": cmd.strip(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_minutes": (time.perf_counter() - t_start) / 60,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_name()}), "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, no GPU",
        "threads": args.threads,
        "repeats": args.repeats,
        "quick": args.quick,
        "base_steps": args.base_steps,
        "load_min": min(loads),
        "load_max": max(loads),
        "load_median": statistics.median(loads),
        "loads": loads,
        "versions": versions(args.skyrl_python),
        "skyrl_install": SKYRL_INSTALL,
    }
    if befores:
        results["before"] = befores
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(results, out)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
