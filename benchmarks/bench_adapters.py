"""Tokens/s per adapter with 1, 2 and 4 LoRA adapters in one job (turns and batched) against
a single full fine-tune, on this CPU, plus the performance model's prediction for one H100
node. Writes benchmarks/adapters.json and prints a markdown table.

    OMP_NUM_THREADS=1 python benchmarks/bench_adapters.py [--steps 8] [--skip 2] [--repeats 3]

Same model, data and shapes in every run: the debug model (recipes/sft_debug.toml, seq 256,
2 rows per adapter per step), letter_sort data; full fine-tune = the same loop with every
parameter trained (AdamW over all of them).

Two clocks per round: wall time, and this process's CPU time (one thread with
OMP_NUM_THREADS=1). On a CPU shared with other jobs, time slicing stretches wall time by
whatever share the others take (2x-10x here), while CPU time counts only this job's work;
the configurations run interleaved, `--repeats` times each, and the medians are reported.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from posttrain.adapters import AdapterJob  # noqa: E402
from recipe.schema import AdapterSection  # noqa: E402
from runtime import session  # noqa: E402


def measure(job, n_adapters: int, schedule: str, steps: int, skip: int, out: str) -> dict:
    r = copy.deepcopy(job.recipe)
    r.job.output_dir = out
    r.checkpoint.resume = False
    r.metrics.summary_skip_steps = skip
    r.adapters = [
        AdapterSection(
            name=f"a{i}",
            source="data/tasks/letter_sort/train.jsonl",
            lr=1e-3,
            steps=steps,
            seed=i,
            local_batch_size=2,
        )  # fmt: skip
        for i in range(n_adapters)
    ]
    aj = AdapterJob(r, job.config.model_spec.model, tokenizer_path=job.tokenizer_path,
                    schedule=schedule)  # fmt: skip
    s = aj.train(export=False)
    per = [a["tokens_per_sec"] for a in s["adapters"].values()]
    per_cpu = [a["tokens_per_cpu_sec"] for a in s["adapters"].values()]
    return {"adapters": n_adapters, "schedule": schedule,
            "tokens_per_sec_per_adapter": sum(per) / len(per),
            "tokens_per_cpu_sec_per_adapter": sum(per_cpu) / len(per_cpu)}  # fmt: skip


def measure_full(job, steps: int, skip: int, out: str) -> dict:
    """The same loop, every weight trained (the full fine-tune baseline)."""
    r = copy.deepcopy(job.recipe)
    r.job.output_dir = out
    r.checkpoint.resume = False
    r.adapters = [AdapterSection(name="full", source="data/tasks/letter_sort/train.jsonl",
                                 steps=steps, local_batch_size=2)]  # fmt: skip
    aj = AdapterJob(r, job.config.model_spec.model, tokenizer_path=job.tokenizer_path)
    a = aj.adapters[0]
    params = [p for n, p in aj.model.named_parameters() if ".lora_" not in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), foreach=False)
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        x, pos, y = next(a.batches)
        from runtime.logprobs import token_logprobs
        from runtime.rows import Rows

        loss_fn, _ = aj._ce(y)
        loss = loss_fn(token_logprobs(aj.model, Rows(x, y, pos)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    t, c = times[skip:], cpu[skip:]
    tokens = 2 * r.training.seq_len
    return {"adapters": 0, "schedule": "full fine-tune",
            "tokens_per_sec_per_adapter": tokens * len(t) / sum(t),
            "tokens_per_cpu_sec_per_adapter": tokens * len(c) / sum(c)}  # fmt: skip


def predicted_h100() -> list[dict]:
    """tools.predict's model for Llama 3 8B on one 8 x H100 node: full vs LoRA r=16 with
    1, 2, 4 adapters (batched: every token passes one adapter; the base is shared)."""
    from core.axes import Layout
    from core.models import model_shape
    from parallel.cluster import load_cluster
    from parallel.perf import predict
    from parallel.workload import Workload

    cl = load_cluster("hgx_h100_ib", nodes=1)
    base = Workload(shape=model_shape("8B"), seq_len=8192, local_batch_size=1,
                    layout=Layout(dp_shard=8), ac="selective", compile=True)  # fmt: skip
    rows = [{"adapters": 0, "schedule": "full fine-tune",
             "tokens_per_sec_per_gpu": predict(base, cl).tokens_per_sec_per_gpu}]  # fmt: skip
    for n in (1, 2, 4):
        # n adapters: each GPU's batch holds one row per adapter (local batch n).
        w = base.with_(lora_rank=16, lora_adapters=n, local_batch_size=n)
        tps = predict(w, cl).tokens_per_sec_per_gpu
        rows.append({"adapters": n, "schedule": "batched",
                     "tokens_per_sec_per_gpu": tps, "per_adapter": tps / n})  # fmt: skip
    return rows


def _median_rows(runs: list[dict]) -> dict:
    """Median of each figure over the repeats of one configuration (+ the spread)."""
    out = {k: runs[0][k] for k in ("adapters", "schedule")}
    for key in ("tokens_per_sec_per_adapter", "tokens_per_cpu_sec_per_adapter"):
        vals = [r[key] for r in runs]
        out[key] = statistics.median(vals)
        out[key + "_range"] = [min(vals), max(vals)]
    n = max(out["adapters"], 1)
    out["tokens_per_sec_total"] = out["tokens_per_sec_per_adapter"] * n
    out["tokens_per_cpu_sec_total"] = out["tokens_per_cpu_sec_per_adapter"] * n
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="/tmp/bench_adapters")
    a = p.parse_args()
    job = session.prepare(
        "recipes/sft_debug.toml", [f"job.output_dir={a.out}", "checkpoint.load_from="]
    )
    load_before = os.getloadavg()[0]
    configs = [("full", 0)] + [(sched, n) for n in (1, 2, 4) for sched in ("turns", "batched")]
    runs: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    for rep in range(a.repeats):  # interleaved: a load spike hits one repeat of each, not one row
        for sched, n in configs:
            out = f"{a.out}/{sched}{n}-{rep}"
            runs[(sched, n)].append(
                measure_full(job, a.steps, a.skip, out)
                if sched == "full"
                else measure(job, n, sched, a.steps, a.skip, out)
            )
    rows = [_median_rows(runs[c]) for c in configs]
    pred = predicted_h100()
    import torchtitan

    res = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/bench_adapters.py "
        f"--steps {a.steps} --skip {a.skip} --repeats {a.repeats}",
        "machine": f"{platform.machine()} x{os.cpu_count()} (shared), load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "0.3.0"),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu": rows,
        "cpu_runs": {f"{k[0]}{k[1]}": v for k, v in runs.items()},
        "predicted_h100_node_llama3_8b": pred,
    }
    with open("benchmarks/adapters.json", "w") as f:
        json.dump(res, f, indent=1)
    print("| job | schedule | per adapter, CPU time | total, CPU time | per adapter, wall |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['adapters'] or 'full'} | {r['schedule']} | "
              f"{r['tokens_per_cpu_sec_per_adapter']:.0f} | {r['tokens_per_cpu_sec_total']:.0f} | "
              f"{r['tokens_per_sec_per_adapter']:.0f} |")  # fmt: skip
    for r in pred:
        print(r)


if __name__ == "__main__":
    main()
