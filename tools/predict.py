"""Predict step time, tokens/s per GPU and per node, MFU and memory for a recipe.

    python -m tools.predict --recipe R --cluster C [--nodes N] [--stack S] [--set k=v ...] [--json]
    python -m tools.predict --serve --recipe R --cluster C [--nodes N] [--context T]
                            [--generators 0|1] [--generator-tokens T] [--adapters N] [--json]
    python -m tools.predict --calibration [--out benchmarks/calibration.md]
    python -m tools.predict --calibration --fit

The recipe's own layout is priced (with `parallel.auto = true`, the planner's best plan) on
a software stack (`--stack`, a profile in stacks/: torchtitan, what recipes run, or
megatron_te, to price a published Megatron-Core + Transformer Engine run of that layout).
`--calibration` predicts every published row of the calibration set and prints (or
writes) the table of predicted against published, with the error, the leave-one-source-out
cross-validation (every fold a cold fit from a neutral start, rows set apart named) and the
memory rows; with `--out` it writes the table and prints its summary lines. `--fit` cold-fits
the stack constants on every row and prints them beside the profiles' (what stacks/ hold).

Beside tokens_per_sec_per_gpu, `goodput_tokens_per_sec_per_gpu`: what is kept after failures,
checkpoints and restarts (parallel.goodput; the cluster profile's failure rate), for
whole-job restart and for torchft per-replica recovery, each at its best checkpoint interval
(docs/fault_tolerance.md).

`--serve` prices the recipe's base as a model resource of `--nodes` whole nodes (default:
the smallest resource of the profile's GPUs that holds it), as `tools.serve` under torchrun
lays it out (parallel/serve.py): memory per GPU by part, the budgets it would choose, the
estimated forward_backward throughput and decode step; `tools.plan --serve` lists every size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from core.errors import ConfigError, exit_on_config_error
from tools.cli import (
    ArgumentParser,
    add_recipe_cluster_args,
    add_stack_arg,
    load,
    load_stack_arg,
    run,
)


def predict_recipe(recipe, cluster, stack: str = "torchtitan") -> tuple[dict, object]:
    """JSON of the prediction for the recipe's layout (or best plan when auto) on `stack`."""
    from parallel.job_checks import check_job
    from parallel.perf import predict
    from parallel.planner import apply_plan, best_plan
    from parallel.workload import workload_from_recipe

    world = cluster.world_size
    extra: dict[str, object] = {}
    if recipe.parallel.auto:
        plan = best_plan(recipe, cluster, nodes=cluster.nodes, stack=stack)
        # What training checks after applying the plan (runtime.session.prepare).
        check_job(apply_plan(recipe, plan), cluster, world)
        layout, pred = plan.layout, plan.prediction
        extra = {"plan": plan.to_json()}
    else:
        r = recipe
        if r.parallel.world_size and r.parallel.world_size != world:
            # Price the recipe's degrees on this many GPUs (dp_shard takes the rest).
            import copy

            r = copy.deepcopy(recipe)
            r.parallel.world_size = 0
            r.parallel.dp_shard = -1
        try:
            layout = check_job(r, cluster, world)  # training's checks, on the profile's GPU
        except ConfigError as e:
            if r is recipe or e.key != "training.global_batch_size":
                raise
            # The recipe's fixed global batch does not divide this many GPUs' data-parallel
            # size: price the same local batch per rank (weak scaling), and say so.
            r.training.global_batch_size = -1
            extra = {"global_batch_priced": "local_batch_size x data-parallel size"}
            layout = check_job(r, cluster, world)
        w = workload_from_recipe(r, layout, cluster, stack)
        pred = predict(w, cluster)
    out = pred.to_json()
    hbm = cluster.hbm_bytes / 2**30
    prec = pred.mfu_pct_precision_peak
    prec_mfu = None if prec is None else round(prec, 2)
    out.update(
        {
            "mfu_pct_precision_peak": prec_mfu,
            "mfu_at_precision_peak_pct": prec_mfu,  # the training metrics' name, same value
            "layout": {
                "pp": layout.pp,
                "dp_replicate": layout.dp_replicate,
                "dp_shard": layout.dp_shard,
                "cp": layout.cp,
                "tp": layout.tp,
                # MoE only (a dense layout's keys stay as they were).
                **({"ep": pred.moe["ep"]} if pred.moe else {}),
            },
            "world_size": world,
            "stack": stack,
            "gpu": cluster.gpu,
            "memory_fits": pred.memory.required_gib_on(cluster.gpu) <= hbm,
            "memory_breakdown_gib": {
                k: round(v, 2) for k, v in pred.memory.breakdown_gib().items()
            },
            **extra,
        }
    )
    from parallel.goodput import goodput_json

    out.update(goodput_json(recipe, cluster, layout, pred.step_time_s, pred.tokens_per_sec_per_gpu))
    pt = posttrain_prediction(recipe, layout, cluster, stack)
    if pt is not None:
        # What runs is the post-training job, not a pretraining step: its memory replaces
        # the pretraining estimate in the fit verdict.
        out["posttrain"] = pt
        out["memory_fits"] = pt["memory_fits"]
        out["memory_breakdown_gib"] = pt["memory_breakdown_gib"]
    return out, pred


def posttrain_prediction(recipe, layout, cluster, stack: str = "torchtitan") -> dict | None:
    """RL and [[adapters]] jobs: memory per GPU with their microbatches (the token budget:
    training.microbatch_tokens, or the largest that fits this GPU), the generator's copies
    (the probe's too in async RL), the KL reference and the KV cache; None otherwise."""
    from dataclasses import replace

    from parallel.memory import fit_microbatch_tokens, posttrain_load, posttrain_memory
    from parallel.workload import workload_from_recipe

    pt = posttrain_load(recipe)
    if pt is None:
        return None
    w = workload_from_recipe(recipe, layout, cluster, stack)
    hbm = cluster.hbm_bytes
    chosen = recipe.training.microbatch_tokens
    tokens = chosen or fit_microbatch_tokens(w, pt, hbm, cluster.gpu) or pt.microbatch_tokens
    est = posttrain_memory(w, replace(pt, microbatch_tokens=tokens))
    need = est.required_gib_on(cluster.gpu)
    return {
        "kind": "rl" if recipe.rl.enabled else "adapters",
        "microbatch_tokens": tokens,
        "microbatch_tokens_from": "training.microbatch_tokens" if chosen else "memory model",
        "memory_gib_per_gpu": round(need, 2),
        "memory_fits": need <= hbm / 2**30,
        "memory_breakdown_gib": {k: round(v, 2) for k, v in est.breakdown_gib().items()},
        "needs": est.describe(cluster.gpu),
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def calibration_markdown() -> str:
    from parallel import memory, perf
    from parallel.calibration import (
        FIT_TOL,
        SOURCES,
        generation_of,
        leave_one_generation_out,
        leave_one_source_out,
        rows,
    )
    from parallel.stacks import load_stack

    rs = rows()
    lines = [
        "# Calibration: predicted against published throughput",
        "",
        "Generated by `python -m tools.predict --calibration --out benchmarks/calibration.md`",
        "from `parallel/calibration.py` (every row with its source, URL, date and stack) and the",
        "stack profiles `stacks/*.toml` (every efficiency constant with its source). No row has",
        "its own constant. tests/integration/test_calibration_cv.py fails if the error bounds",
        "below are broken or if this file is stale.",
        "",
        "## Sources",
        "",
        "| key | source | date | stack | rows |",
        "|---|---|---|---|---|",
    ]
    lines += _source_rows(SOURCES, rs)
    lines += [
        "",
        "## Throughput (in-sample: constants as in stacks/*.toml, cold-fitted on all rows)",
        "",
        "| row | source | stack | GPUs | cluster | published tok/s/GPU | predicted | error | MFU pred |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    errs: list[float] = []
    details = []
    preds = {}
    gpus = set()
    for r in rs:
        p = r.predict()
        preds[r.name + r.source] = p
        gpus.add(r.load_cluster().gpu)
        e = 100 * (p.tokens_per_sec_per_gpu / r.tokens_per_sec_per_gpu - 1)
        errs.append(abs(e))
        lines.append(
            f"| {r.name} | {r.source} | {r.workload.stack} | {r.gpus:,} | {r.cluster} | "
            f"{r.tokens_per_sec_per_gpu:,.0f} | {p.tokens_per_sec_per_gpu:,.0f} | {e:+.1f}% | "
            f"{p.mfu_pct:.1f}% |"
        )
        top = sorted(p.breakdown.items(), key=lambda kv: -kv[1])[:4]
        details.append(
            f"- **{r.name}** ({r.source}): step {p.step_time_s:.2f} s = "
            + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in top)
            + (f". Assumed: {r.assumed}." if r.assumed else ".")
        )
    sizes = sorted({r.gpus for r in rs})
    lines += [
        "",
        f"**Throughput: mean |error| {_mean(errs):.1f}%, max {max(errs):.1f}% over {len(errs)} "
        f"rows** from {len(SOURCES)} sources, {len(gpus)} GPU types ({', '.join(sorted(gpus))}), "
        f"{sizes[0]:,} to {sizes[-1]:,} GPUs.",
        "",
        "## Leave-one-source-out cross-validation (cold start)",
        "",
        "For each source: fit the fitted constants (`parallel.calibration.fit_params`) on the",
        "rows of every other source from a neutral start that no row informed (the middle of",
        "each constant's bounds, never the profiles' values, which were fitted on every row),",
        "by coordinate descent until a whole sweep moves no constant by more than",
        f"{FIT_TOL}, then predict that source's rows. A constant that no remaining row informs",
        "takes the fitted value of its sibling (the same stack's next higher precision; the",
        "previous GPU generation); a row that needs a constant with neither is set apart and",
        "counted separately, never predicted from its own fit.",
        "",
        "| held-out source | rows | mean abs error | max abs error | priced by the sibling rule "
        "| set apart | sweeps |",
        "|---|---|---|---|---|---|---|",
    ]
    loso = leave_one_source_out(rs)
    all_loso: list[float] = []
    apart_rows: list[str] = []
    for k, fold in loso.items():
        es = [abs(e) for _, e in fold.scored]
        all_loso += es
        sib = ", ".join(f"{a} <- {b}" for a, b in fold.by_sibling.items()) or "-"
        apart_rows += [f"{r.name} ({k})" for r in fold.set_apart]
        conv = f"{fold.sweeps}" + ("" if fold.converged else " (not converged)")
        mean = f"{_mean(es):.1f}%" if es else "-"
        most = f"{max(es):.1f}%" if es else "-"
        lines.append(
            f"| {k} | {len(es)} | {mean} | {most} | {sib} | {len(fold.set_apart)} | {conv} |"
        )
    lines += [
        "",
        f"**Leave-one-source-out (cold start): mean |error| {_mean(all_loso):.1f}%, max "
        f"{max(all_loso):.1f}% over {len(all_loso)} rows; set apart: "
        f"{', '.join(apart_rows) if apart_rows else 'none'}.**",
        "",
        *_logo_section(rs, leave_one_generation_out(rs), generation_of),
        "",
        "## Memory against every published memory figure",
        "",
        "| row | source | published GiB | predicted GiB (max reserved) | error |",
        "|---|---|---|---|---|",
    ]
    merrs = []
    for r in rs:
        if not r.memory_gib:
            continue
        mem = preds[r.name + r.source].memory.reserved_gib
        me = 100 * (mem / r.memory_gib - 1)
        merrs.append(abs(me))
        lines.append(f"| {r.name} | {r.source} | {r.memory_gib:.1f} | {mem:.1f} | {me:+.1f}% |")
    lines += [
        "",
        f"**Memory: mean |error| {_mean(merrs):.1f}%, max {max(merrs):.1f}% over {len(merrs)} "
        "rows.** (NVIDIA's and Meta's tables state no memory.)",
        "",
        "## Where each prediction's time goes (largest four terms, seconds per step)",
        "",
        *details,
        "",
        "## The constants",
        "",
        "Stack constants (with their sources) are in `stacks/torchtitan.toml` and",
        "`stacks/megatron_te.toml`:",
        "",
        "| constant | torchtitan | megatron_te |",
        "|---|---|---|",
    ]
    tt, mc = load_stack("torchtitan").constants(), load_stack("megatron_te").constants()
    for k in tt:
        lines.append(f"| {k} | `{tt[k]}` | `{mc[k]}` |")
    lines += [
        "",
        "Hardware and schedule constants (`parallel/perf.py`, `parallel/memory.py`):",
        "",
        "| constant | value | meaning |",
        "|---|---|---|",
    ]
    consts = [
        ("HBM_EFF", perf.HBM_EFF, "achievable HBM bandwidth fraction"),
        ("NVLINK_EFF / NET_EFF", (perf.NVLINK_EFF, perf.NET_EFF), "NCCL bus-bandwidth fractions"),
        ("ALPHA_NVLINK / ALPHA_NET", (perf.ALPHA_NVLINK, perf.ALPHA_NET), "ring hop latency, s"),
        ("POWER_CLOCK_EXPONENT", perf.POWER_CLOCK_EXPONENT, "clock = (power cap / TDP) ** this"),
        ("BUBBLE_FACTOR", perf.BUBBLE_FACTOR, "pipeline bubble per schedule, x (p-1)/v"),
        ("ALLOCATOR_FRAGMENTATION", memory.ALLOCATOR_FRAGMENTATION, "reserved / allocated - 1"),
        ("RUNTIME_OVERHEAD_GIB", memory.RUNTIME_OVERHEAD_GIB, "outside the allocator (fit check only)"),
        ("LOGIT_BYTES eager / compiled", (memory.LOGIT_BYTES_EAGER, memory.LOGIT_BYTES_COMPILED), "bytes per logit at the loss"),
    ]  # fmt: skip
    for name, val, what in consts:
        lines.append(f"| {name} | `{val}` | {what} |")
    lines += ["", "Reasons for each constant: docs/perf_model.md and the profiles' [sources].", ""]
    lines += _moe_section()
    return "\n".join(lines)


def _source_rows(sources, rs) -> list[str]:
    """One markdown row per calibration source: key, linked title, date, stack, rows."""
    out = []
    for k, src in sources.items():
        n = sum(1 for r in rs if r.source == k)
        out.append(f"| {k} | [{src.title}]({src.url}) | {src.date} | {src.stack} | {n} |")
    return out


def _moe_section() -> list[str]:
    """The mixture-of-experts rows (parallel.calibration.moe_rows): their own table and
    leave-one-source-out, every constant refitted from a neutral start in each fold."""
    from parallel.calibration import (
        MOE_SET_APART,
        MOE_SOURCES,
        moe_fit_params,
        moe_leave_one_source_out,
        moe_rows,
    )
    from parallel.stacks import load_stack

    rs = moe_rows()
    lines = [
        "## Mixture-of-experts rows (issue 34)",
        "",
        "A calibration of their own: the dense constants above are fitted on the dense rows",
        "alone (no MoE row moves a dense figure); the MoE constants (`"
        + "`, `".join(p.name for p in moe_fit_params())
        + "`) are fitted on these rows with the dense constants as shipped. MFU counts model",
        "FLOPs on the ACTIVE parameters (6 x active + attention, Megatron's and DeepSeek's",
        "convention) against the dense BF16 peak.",
        "",
        "| key | source | date | stack | rows |",
        "|---|---|---|---|---|",
    ]
    lines += _source_rows(MOE_SOURCES, rs)
    lines += [
        "",
        "| row | source | GPUs | cluster | published tok/s/GPU | predicted | error | MFU pred "
        "| all-to-all s/step | assumed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    errs = []
    for r in rs:
        p = r.predict()
        e = 100 * (p.tokens_per_sec_per_gpu / r.tokens_per_sec_per_gpu - 1)
        errs.append(abs(e))
        mfu = "-" if p.mfu_pct is None else f"{p.mfu_pct:.1f}%"
        lines.append(
            f"| {r.name} | {r.source} | {r.gpus:,} | {r.cluster} | {r.tokens_per_sec_per_gpu:,.0f} "
            f"| {p.tokens_per_sec_per_gpu:,.0f} | {e:+.1f}% | {mfu} | "
            f"{p.breakdown.get('ep_alltoall_s', 0.0):.3f} | {r.assumed} |"
        )
    lines += [
        "",
        f"**MoE throughput: mean |error| {_mean(errs):.1f}%, max {max(errs):.1f}% over "
        f"{len(errs)} rows.**",
        "",
        "Set apart (not priced):",
        "",
        *[f"- {name}: {why}" for name, why in MOE_SET_APART.items()],
        "",
        "### MoE leave-one-source-out",
        "",
        "For each source: every constant, dense and MoE, is reset to the middle of its bounds and",
        "refitted without that source's rows (for mb2511moe also without the dense rows of the",
        "same document, mb2511); then the source's MoE rows are predicted. A row of a stack that",
        "keeps no MoE row in the fold (tt1993, torchtitan's only one) would be priced from the",
        "neutral start alone: it is set apart, not scored.",
        "",
        "| held-out source | rows | mean abs error | max abs error | set apart |",
        "|---|---|---|---|---|",
    ]
    every: list[float] = []
    apart: list[str] = []
    for key, fold in moe_leave_one_source_out(rs).items():
        es = [abs(e) for _, e in fold.scored]
        every += es
        apart += [f"{r.name} ({key})" for r in fold.set_apart]
        mean = f"{_mean(es):.1f}%" if es else "-"
        most = f"{max(es):.1f}%" if es else "-"
        lines.append(f"| {key} | {len(es)} | {mean} | {most} | {len(fold.set_apart)} |")
    lines += [
        "",
        f"**MoE leave-one-source-out: mean |error| {_mean(every):.1f}%, max {max(every):.1f}% "
        f"over {len(every)} rows; set apart: {', '.join(apart) or 'none'}.**",
        "",
        "| MoE constant | torchtitan | megatron_te |",
        "|---|---|---|",
    ]
    tt, mc = load_stack("torchtitan"), load_stack("megatron_te")
    for k in ("grouped_gemm_eff", "moe_layer_overhead_s", "ep_a2a_hidden", "moe_imbalance"):
        lines.append(f"| {k} | `{getattr(tt, k)}` | `{getattr(mc, k)}` |")
    lines.append("")
    return lines


def _logo_section(rs, logo, generation_of) -> list[str]:
    """Leave-one-GPU-generation-out: how well the model prices a generation it was not
    fitted on (the question a user of new hardware asks)."""
    lines = [
        "## Leave-one-GPU-generation-out cross-validation",
        "",
        "For each GPU generation (core.hardware.GPUS: Hopper, Blackwell, Blackwell Ultra): fit",
        "the fitted constants from the neutral start on the rows of every other generation, price the held-out",
        "generation with the efficiency factor of its donor (the nearest earlier generation with",
        "rows, else the nearest later: its own factor has no row left to inform it), then predict",
        "its rows. Rows that need a constant no other generation's row informs (torchtitan's rows",
        "are all Hopper) cannot be held out honestly and are counted apart.",
        "",
        "| held-out generation | GPUs | priced with | rows | mean abs error | max abs error "
        "| not cross-validated |",
        "|---|---|---|---|---|---|---|",
    ]
    every: list[float] = []
    for gen, (donor, res, skipped) in logo.items():
        es = [abs(e) for _, e in res]
        every += es
        kinds = sorted({r.load_cluster().gpu for r in rs if generation_of(r) == gen})
        mean = f"{_mean(es):.1f}%" if es else "-"
        most = f"{max(es):.1f}%" if es else "-"
        apart = (
            f"{len(skipped)} ({', '.join(sorted({r.workload.stack for r in skipped}))} rows)"
            if skipped
            else "0"
        )
        lines.append(
            f"| {gen} | {', '.join(kinds)} | {donor or '-'}'s factor | {len(es)} | {mean} | "
            f"{most} | {apart} |"
        )
    lines += [
        "",
        f"**Leave-one-generation-out: mean |error| {_mean(every):.1f}%, max "
        f"{max(every):.1f}% over {len(every)} rows.**",
    ]
    return lines


def fit_report() -> str:
    """The cold fit on every row (what stacks/*.toml should hold) beside the profiles."""
    from parallel.calibration import base_stacks, fit_cold, fit_params, rows

    f = fit_cold(rows())
    base = base_stacks()
    head = f"cold fit: {f.sweeps} sweeps, " + ("converged" if f.converged else "NOT converged")
    return "\n".join(
        [head]
        + [
            f"{p.name}: profile {p.get(base):.3f} -> fitted {p.get(f.stacks):.3f}"
            for p in fit_params()
        ]
    )


def serve_prediction(args: argparse.Namespace) -> None:
    """--serve: one resource of --nodes nodes (default: the smallest that holds the base)."""
    from dataclasses import replace

    from parallel.serve import plan_on_cluster, resource_sizes
    from tools.plan import serve_inputs

    recipe, cluster, model, res = serve_inputs(args)
    if args.nodes is not None:
        sizes = [args.nodes * cluster.gpus_per_node]
    else:
        sizes = resource_sizes(cluster.gpus_per_node, cluster.nodes)
    for n in sizes:
        cp = plan_on_cluster(model, replace(res, devices=n), cluster)
        if cp.plan.fits:
            break
    if args.json:
        json.dump(cp.to_json(), sys.stdout, indent=2)
        print()
        return
    verdict = "fits" if cp.plan.fits else "DOES NOT FIT"
    print(
        f"{recipe.model.flavor} LoRA resource (rank {model.lora_rank}, context "
        f"{model.context:,}, {recipe.training.dtype}) on {cp.devices} x {cluster.gpu} "
        f"({cp.nodes} node(s), {cluster.name}), the base FSDP2-sharded over all: {verdict}"
    )
    print(f"  {cp.plan.memory.describe(cluster.gpu)}; {cluster.hbm_bytes / 2**30:.1f} GiB per GPU")
    for key, why in cp.plan.problems:
        print(f"  {key}: {why}")
    if cp.speed is not None:
        m = cp.plan.memory
        gen = (
            f"generator: {m.generator_tokens:,} KV-cache tokens ({cp.plan.concurrent_samples} "
            f"full-context samples at once), a decode step {cp.speed.decode_step_s:.3f} s "
            f"(all-gather of the base {cp.speed.decode_allgather_s:.3f} s)"
            if res.generators
            else "no generator"
        )
        print(
            f"  microbatches of {m.microbatch_tokens:,} tokens, forward_backward "
            f"~{cp.speed.forward_backward_tokens_per_s:,.0f} tokens/s over the resource; {gen} "
            "(performance-model estimates)"
        )


@exit_on_config_error
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    if argv is None:
        argv = sys.argv[1:]
    if "--calibration" in argv:
        p.add_argument("--calibration", action="store_true")
        p.add_argument("--out", default=None, help="write the markdown here")
        p.add_argument("--fit", action="store_true", help="refit the stack constants, print them")
        args = p.parse_args(argv)
        if args.out:
            from tools.cli import out_file_arg

            out_file_arg(args.out, "--out")
        if args.fit:
            print(fit_report())
            return
        text = calibration_markdown()
        if args.out:
            Path(args.out).write_text(text)
            print(f"wrote {args.out}")
            print("\n".join(line for line in text.splitlines() if line.startswith("**")))
        else:
            print(text)
        return
    add_recipe_cluster_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    add_stack_arg(p)
    from tools.plan import add_serve_args

    add_serve_args(p)
    args = p.parse_args(argv)
    if args.serve:
        serve_prediction(args)
        return
    stack = load_stack_arg(args)
    recipe, cluster = load(args)
    out, pred = predict_recipe(recipe, cluster, stack)
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
        return
    lay = out["layout"]
    mfu = "n/a" if out["mfu_pct"] is None else f"{out['mfu_pct']:.1f}%"
    print(
        f"{recipe.model.flavor} on {cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu} "
        f"({cluster.name}), stack {args.stack}; layout pp{lay['pp']} rep{lay['dp_replicate']} "
        f"shard{lay['dp_shard']} cp{lay['cp']} tp{lay['tp']}"
    )
    print(
        f"  {out['tokens_per_sec_per_gpu']:,.1f} tokens/s/GPU, "
        f"{out['tokens_per_sec_per_node']:,.1f} tokens/s/node, MFU {mfu}, "
        f"step {out['step_time_s']:.3f} s, memory {out['memory_gib_per_gpu']:.1f} GiB/GPU"
        f"{'' if out['memory_fits'] else '  (DOES NOT FIT)'}"
    )
    for k, v in out["breakdown"].items():
        if v:
            print(f"    {k:<22} {v:9.4f} s")
    gp = out["goodput"]
    for mode in ("whole_job_restart", "per_replica_recovery"):
        g = gp[mode]
        every = g["checkpoint_interval_steps"]
        print(
            f"  goodput, {mode.replace('_', ' ')}: {g['goodput_tokens_per_sec_per_gpu']:,.1f} "
            f"tokens/s/GPU ({100 * g['efficiency']:.1f}%), checkpoint every "
            f"{'never' if every is None else f'{every:,} steps'}"
        )
    pt = out.get("posttrain")
    if pt:
        verdict = "fits" if pt["memory_fits"] else "DOES NOT FIT"
        print(
            f"  {pt['kind']} job: {pt['needs']} ({pt['microbatch_tokens_from']}); "
            f"{cluster.hbm_bytes / 2**30:.1f} GiB per {cluster.gpu}: {verdict}"
        )


if __name__ == "__main__":
    run(main)
