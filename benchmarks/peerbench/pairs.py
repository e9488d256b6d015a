"""The pairs: what each comparison runs on both sides (the same base, data and
hyperparameters) and what it reports (step times and CPU seconds with their spread over
repeats, ratios ours/peer with their per-repeat range, step-0 loss agreement, quality
figures). Each pair is one function of the harness's context."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.peerbench.config import LORA, SKYRL_INSTALL, TOL
from benchmarks.peerbench.harness import Ctx, RunFailed, Server, interleave, start_skyrl, ts_train
from benchmarks.peerbench.measure import ratios, steady, steady_cpu, summarize


def sft_pair(ctx: Ctx, *, lora: bool, packed: bool) -> dict[str, Any]:
    q = ctx.quick
    # quick (the test: step-0 loss and that training moves): 3 steps, the last 2 timed.
    steps = 3 if q else 12
    skip = 1 if q else 3
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
    # The peer reads the examples its steps train on and no more: TRL tokenizes and packs its
    # whole dataset before the first step (outside the timed steps, inside the process's CPU;
    # all 4,633 examples cost it 1-2 CPU s). Equal-length examples keep the rows the same.
    peer_data = ctx.work / f"peer_{name}.jsonl"
    with open(ctx.sft_tokens) as f:
        peer_data.write_text("".join(next(f) for _ in range(steps * batch * per_row)))
    wargs["data"] = str(peer_data)
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
        "ours_cpu_s_per_step": c_ours,
        "peer_cpu_s_per_step": c_peer,
        "ours_tokens_per_cpu_s": tokens_per_step / c_ours["median"],
        "peer_tokens_per_cpu_s": tokens_per_step / c_peer["median"],
        **ratios(t_ours, t_peer, c_ours, c_peer),
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
            "ours_cpu_s": ca,
            "peer_cpu_s": cb,
            **ratios(a, b, ca, cb),
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
        "ours_cpu_s_per_step": c_ours,
        "peer_cpu_s_per_step": c_peer,
        **ratios(t_ours, t_peer, c_ours, c_peer),
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
    steps = 2 if q else 8  # quick: step 0 is the claim, the second step is timed
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
        "ours_cpu_s_per_step": c_ours,
        "peer_cpu_s_per_step": c_peer,
        **ratios(t_ours, t_peer, c_ours, c_peer),
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
        out[key] = {"ours": a, "peer": b, "ours_cpu": ca, "peer_cpu": cb, **ratios(a, b, ca, cb)}
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
