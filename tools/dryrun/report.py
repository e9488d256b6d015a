"""The dry run's report: one rank's measured and planned figures side by side (`compare`),
what the fake backend cannot see (`NOT_COVERED`), and the text rendering (`render`)."""

from __future__ import annotations

from typing import Any

# What this dry run cannot see or carry, in every report (docs/dryrun.md explains each).
NOT_COVERED = [
    "pipeline send/recv carries no data under the fake backend: the boundary tensors' "
    "metadata comes from stage 0's own forward (every boundary carries the residual stream)",
    "tensors are fake on the cpu device type: torch's autograd engine asks the CUDA driver "
    "for a primary context on every backward through a cuda tensor, fake or not",
    "torch.compile, async TP and CUDA graphs are off (eager kernels; compiled memory is the "
    "planner's *_compiled figure)",
    "memory outside the tensors: NCCL buffers, allocator fragmentation, CUDA context and "
    "workspaces (the planner's fragmentation and overhead terms)",
]


def compare(measured: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """One rank's entry: measured and planned side by side, with the differences."""
    peak, want = measured["peak_gib"], plan["planned_gib"]
    keys = sorted(set(measured["collectives"]) | set(plan["predicted_collectives"]))
    zero = {"count": 0, "gib": 0.0}
    colls = {
        k: {
            "measured_count": measured["collectives"].get(k, zero)["count"],
            "predicted_count": plan["predicted_collectives"].get(k, zero)["count"],
            "measured_gib": measured["collectives"].get(k, zero)["gib"],
            "predicted_gib": plan["predicted_collectives"].get(k, zero)["gib"],
        }
        for k in keys
    }
    return {
        **{k: measured[k] for k in ("rank", "world_size", "pp_rank", "stages")},
        "peak_gib": peak,
        "planned_gib": want,
        "error_pct": round(100 * (want - peak) / peak, 1) if peak else None,
        "measured": {k: measured[k] for k in ("peak", "peak_where", "after_step")},
        "planned": {k: v for k, v in plan.items() if k != "planned_gib"},
        "collectives": colls,
        "kernels": {"linear": measured["linear"], "attention": measured["attention"]},
        **({"posttrain": measured["posttrain"]} if measured.get("posttrain") else {}),
        "seconds": measured["seconds"],
    }


def render(result: dict[str, Any]) -> str:
    lay = " x ".join(f"{k}{v}" for k, v in result["layout"].items() if v > 1) or "1 GPU"
    out = [
        f"{result['model']} on {result['world_size']:,} x {result['gpu']} ({result['cluster']}), "
        f"{lay}, local batch {result['local_batch_size']}"
    ]
    out += [f"  note: {n}" for n in result["notes"]]
    for r in result["ranks"]:
        out.append("")
        if "error" in r:
            out.append(f"rank {r['rank']}: FAILED: {r['error']}")
            continue
        m, p = r["measured"]["peak"], r["planned"]["planned"]
        out.append(
            f"rank {r['rank']} (pipeline rank {r['pp_rank']}, stages {r['stages']}): measured "
            f"{r['peak_gib']:.2f} GiB, planned {r['planned_gib']:.2f} GiB ({r['error_pct']:+.1f}%)"
            f"  [{r['seconds']['total']:.0f} s]"
        )
        out.append(f"  peak during {r['measured']['peak_where']}")
        out.append(f"  {'GiB at the peak':<28}{'measured':>10}{'planned':>10}")
        rows = [
            ("parameters (+ unsharded)", m["parameters_gib"], None),
            ("gradients", m["gradients_gib"], None),
            ("optimizer state", m["optimizer_gib"], None),
            ("model states (sharded)", None, p["states"]),
            ("unsharded params + grads", None, p["unsharded_params_grads"]),
            ("activations + temporaries", m["activations_gib"],
             p["activations"] + p["workspace"] + p["logits"] + p["fp8"]),
            *[(k.replace("_", " "), None, p[k])
              for k in ("generator_copies", "reference_copy", "kv_cache") if p.get(k)],
            ("total (allocated)", m["total_gib"], r["planned_gib"]),
            ("+ fragmentation (planner)", None, p["allocator_fragmentation"]),
            ("+ outside allocator (planner)", None, p["runtime_overhead"]),
        ]  # fmt: skip
        for name, a, b in rows:
            sa = f"{a:10.2f}" if a is not None else f"{'':>10}"
            sb = f"{b:10.2f}" if b is not None else f"{'':>10}"
            out.append(f"  {name:<28}{sa}{sb}")
        post = r.get("posttrain")
        if post:
            for name, gib in post["phases_gib"].items():
                out.append(f"  peak of phase: {name:<40}{gib:10.2f}")
            for name, gib in post["resident_gib"].items():
                out.append(f"  measured {name.replace('_', ' '):<40}{gib:10.2f}")
            out += [f"  {n}" for n in post["notes"]]
        out.append(f"  {'collectives (per step)':<28}{'count':>8}{'GiB':>9}{'model count':>13}"
                   f"{'model GiB':>11}")  # fmt: skip
        for k, c in r["collectives"].items():
            out.append(
                f"  {k:<28}{c['measured_count']:>8}{c['measured_gib']:>9.2f}"
                f"{c['predicted_count']:>13g}{c['predicted_gib']:>11.2f}"
            )
    out.append("")
    out += [f"not covered: {n}" for n in result["not_covered"]]
    return "\n".join(out)
