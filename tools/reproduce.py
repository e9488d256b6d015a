"""Check published throughput claims: physics under each reading of the unit, our
prediction with the planner's best plan on 1, 8 and 64 nodes, and a verdict.

    python -m tools.reproduce [--claims benchmarks/claims.toml] [--out DIR] [--nodes 1,8,64]

Writes DIR/report.md, DIR/report.json and DIR/throughput.png (published vs predicted vs
measured). "Measured" comes from any benchmark JSON under benchmarks/ or outputs/ whose
GPU and model match a claim (keys: a tokens/s-per-GPU figure such as
median_tokens_per_sec_per_gpu, a GPU name such as device/gpu/gpu_name, and a model
flavor or recipe name); otherwise it says "none".
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from core.errors import ConfigError, exit_on_config_error
from core.hardware import MAX_NODES
from core.typed_toml import build_dataclass, doc, read_toml, show
from tools.cli import ROOT, ArgumentParser, out_dir_arg, positive_arg, run

DEFAULT_CLAIMS = ROOT / "benchmarks" / "claims.toml"
DEFAULT_OUT = ROOT / "benchmarks" / "reproduce"

# Beyond this fraction of the dense peak no published dense-transformer training run goes
# (the best we know are ~55-60% MFU); above it a claim is implausible, above 100% impossible.
PLAUSIBLE_MFU_PCT = 70.0


@dataclass
class Claim:
    id: str = field(default="", metadata=doc("Short identifier."))
    source: str = field(default="", metadata=doc("Where the claim was published."))
    quote: str = field(default="", metadata=doc("The claim's words."))
    model: Literal["8B", "70B", "405B"] = field(default="70B", metadata=doc("Llama 3 flavor."))
    gpu: Literal["H100", "H200", "B200", "GB200"] = field(default="H100", metadata=doc("GPU."))
    precision: Literal["bf16", "fp8"] = field(default="bf16", metadata=doc("Stated precision."))
    value: float = field(default=0.0, metadata=doc("The number as published."))
    unit: str = field(default="", metadata=doc("The unit as worded by the source."))
    readings: list[str] = field(
        default_factory=lambda: ["per_gpu", "per_node"],
        metadata=doc("Readings to check: per_gpu, per_node."),
    )
    gpus_per_node: int = field(default=8, metadata=doc("GPUs per node for the per_node reading."))
    seq_len: int = field(default=8192, metadata=doc("Sequence length (stated or assumed)."))
    assumed_seq: bool = field(default=False, metadata=doc("true when seq_len is our assumption."))
    recipe: str = field(default="", metadata=doc("Our recipe for this hardware (path)."))
    cluster: str = field(default="", metadata=doc("Cluster profile for this hardware."))

    def __post_init__(self) -> None:
        if not self.id:
            raise ConfigError("every claim needs an id", key="id")
        if self.value <= 0:
            raise ConfigError(f"expected a positive value, got {self.value}", key="value")
        for r in self.readings:
            if r not in ("per_gpu", "per_node"):
                raise ConfigError(
                    f"unknown reading {r!r}; known: per_gpu, per_node", key="readings"
                )


@dataclass
class ClaimsFile:
    claim: list[Claim] = field(default_factory=list, metadata=doc("The claims."))


def load_claims(path: str | Path) -> list[Claim]:
    data = read_toml(path)
    return build_dataclass(ClaimsFile, data, file=str(path), prefix="").claim


def physics(claim: Claim) -> list[dict]:
    """Each reading's tokens/s/GPU, FLOP/s per GPU and share of the dense peaks."""
    from core.hardware import peak_flops
    from core.models import model_shape

    fpt = model_shape(claim.model).flops_per_token(claim.seq_len)
    out = []
    for reading in claim.readings:
        tps = claim.value if reading == "per_gpu" else claim.value / claim.gpus_per_node
        flops = tps * fpt
        bf16 = peak_flops(claim.gpu, "bf16") or 0
        fp8 = peak_flops(claim.gpu, "fp8") or 0
        prec = peak_flops(claim.gpu, claim.precision) or bf16
        pct_prec = 100 * flops / prec
        if flops > fp8:
            verdict = "impossible: above even the FP8 dense peak"
        elif flops > prec:
            verdict = f"impossible at {claim.precision.upper()}: above its dense peak"
        elif pct_prec > PLAUSIBLE_MFU_PCT:
            verdict = f"implausible: {pct_prec:.0f}% MFU is beyond any published run"
        else:
            verdict = f"physically possible: {pct_prec:.0f}% MFU"
        out.append(
            {
                "reading": reading,
                "tokens_per_sec_per_gpu": tps,
                "pflops_per_gpu": flops / 1e15,
                "pct_of_bf16_peak": 100 * flops / bf16 if bf16 else None,
                "pct_of_fp8_peak": 100 * flops / fp8 if fp8 else None,
                "verdict": verdict,
            }
        )
    return out


def predictions(claim: Claim, nodes_list: list[int]) -> list[dict]:
    from parallel.cluster import load_cluster
    from parallel.planner import best_plan
    from recipe.loader import load_recipe

    recipe = load_recipe(
        ROOT / claim.recipe if not Path(claim.recipe).is_absolute() else claim.recipe
    )
    cluster = load_cluster(claim.cluster)
    out = []
    for n in nodes_list:
        try:
            plan = best_plan(recipe, cluster, nodes=n)
        except ConfigError as e:
            out.append({"nodes": n, "error": e.detail})
            continue
        p = plan.prediction
        out.append(
            {
                "nodes": n,
                "plan": plan.describe(),
                "local_batch_size": plan.local_batch_size,
                "global_batch_size": plan.global_batch_size,
                "tokens_per_sec_per_gpu": p.tokens_per_sec_per_gpu,
                "tokens_per_sec_per_node": p.tokens_per_sec_per_node,
                "mfu_pct": p.mfu_pct,
                "memory_gib_per_gpu": p.memory.reserved_gib,
            }
        )
    return out


_TPS_KEYS = ("median_tokens_per_sec_per_gpu", "tokens_per_sec_per_gpu", "tokens_per_sec_per_device")
_GPU_KEYS = ("device", "gpu", "gpu_name", "device_name")
_MODEL_KEYS = ("flavor", "model", "recipe", "model_flavor")


def _walk(obj, depth=0):
    if isinstance(obj, dict):
        yield obj
        if depth < 3:
            for v in obj.values():
                yield from _walk(v, depth + 1)


def find_measurements(claim: Claim, roots: list[Path]) -> list[dict]:
    """Benchmark JSON files measuring this claim's model on this claim's GPU."""
    from core.hardware import gpu_kind

    found = []
    for root in roots:
        if not root.exists():
            continue
        for f in sorted(root.rglob("*.json")):
            if "reproduce" in f.parts:
                continue
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            flat: dict = {}
            for d in _walk(data):
                for k, v in d.items():
                    flat.setdefault(k, v)
            tps = next((flat[k] for k in _TPS_KEYS if isinstance(flat.get(k), (int, float))), None)
            gpu = next((flat[k] for k in _GPU_KEYS if isinstance(flat.get(k), str)), None)
            model = next((str(flat[k]) for k in _MODEL_KEYS if k in flat), "")
            if tps is None or gpu is None or gpu_kind(gpu) != claim.gpu:
                continue
            if claim.model.lower() not in model.lower():
                continue
            found.append({"file": str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f),
                          "tokens_per_sec_per_gpu": float(tps), "gpu": gpu})  # fmt: skip
    return found


def verdict(claims: list[Claim], results: dict[str, dict]) -> list[str]:
    lines = []
    for c in claims:
        r = results[c.id]
        phys = {p["reading"]: p for p in r["physics"]}
        preds = {p["nodes"]: p for p in r["predictions"] if "error" not in p}
        best8 = preds.get(8) or next(iter(preds.values()), None)
        s = f"**{c.id}** ({c.gpu}, {c.value:,.0f} {c.unit}): "
        if "per_gpu" in phys:
            g = phys["per_gpu"]
            s += (
                f"read per GPU it is {g['pflops_per_gpu']:.2f} PFLOP/s per GPU, "
                f"{g['pct_of_bf16_peak']:.0f}% of the BF16 peak: {g['verdict']}. "
            )
        if "per_node" in phys:
            n = phys["per_node"]
            s += (
                f"Read per {c.gpus_per_node}-GPU node it is {n['tokens_per_sec_per_gpu']:,.0f} "
                f"tokens/s/GPU, {n['pct_of_bf16_peak']:.0f}% BF16 MFU: {n['verdict']}. "
            )
            if best8:
                ratio = n["tokens_per_sec_per_gpu"] / best8["tokens_per_sec_per_gpu"]
                s += (
                    f"Our model's best BF16 plan on {best8['nodes']} nodes ({best8['plan']}) "
                    f"predicts {best8['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU "
                    f"({best8['mfu_pct']:.0f}% MFU); the per-node reading is {ratio:.2f}x that"
                    + (
                        " (within the model's calibration error: consistent)."
                        if abs(ratio - 1) <= 0.15
                        else " (faster than our calibrated model: kernels beyond torchtitan's "
                        "would be needed)."
                        if ratio > 1
                        else " (slower than our model predicts)."
                    )
                )
        lines.append(s)
    ids = {c.id: c for c in claims}
    if "together_b200" in ids and "together_h100" in ids:
        b, h = results["together_b200"], results["together_h100"]
        pb = {p["nodes"]: p for p in b["predictions"] if "error" not in p}
        ph = {p["nodes"]: p for p in h["predictions"] if "error" not in p}
        claimed = ids["together_b200"].value / ids["together_h100"].value
        if 8 in pb and 8 in ph:
            from core.hardware import peak_flops

            pred = pb[8]["tokens_per_sec_per_gpu"] / ph[8]["tokens_per_sec_per_gpu"]
            peak_ratio = (peak_flops("B200") or 1) / (peak_flops("H100") or 1)
            gpu_b = b["physics"][0]
            if claimed <= max(pred, peak_ratio) * 1.15:
                judged = (
                    f"below the {peak_ratio:.2f}x BF16 peak ratio and our {pred:.2f}x, so "
                    "physically consistent (B200 software reaching less of its peak than "
                    "H100's would explain the gap)"
                    if claimed < min(pred, peak_ratio)
                    else "in line with the hardware"
                )
            else:
                judged = f"above both the {peak_ratio:.2f}x peak ratio and our {pred:.2f}x"
            lines.append(
                f"**B200 vs H100**: claimed {claimed:.2f}x; our model predicts {pred:.2f}x on 8 "
                f"nodes each (BF16, best plans); the BF16 peaks differ by {peak_ratio:.2f}x. "
                f"Verdict: the 15,264 figure can only be tokens/s per 8-GPU node (per GPU it "
                f"would be {gpu_b['pct_of_bf16_peak']:.0f}% of the B200's BF16 peak). So read, "
                f"both Together numbers are physically possible, and the claimed ratio is "
                f"{judged}."
            )
    return lines


def chart(claims: list[Claim], results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.hardware import peak_flops
    from core.models import model_shape

    fig, axes = plt.subplots(1, len(claims), figsize=(6 * len(claims), 4.8), squeeze=False)
    for ax, c in zip(axes[0], claims, strict=True):
        r = results[c.id]
        labels, vals, colors = [], [], []
        for p in r["physics"]:
            labels.append(f"published\n({p['reading'].replace('_', ' ')})")
            vals.append(p["tokens_per_sec_per_gpu"])
            colors.append("#d62728" if "impossible" in p["verdict"] else "#1f77b4")
        for p in r["predictions"]:
            if "error" in p:
                labels.append(
                    f"predicted\n{p['nodes']} node{'s' if p['nodes'] > 1 else ''}\n(no fit)"
                )
                vals.append(0)
                colors.append("#cccccc")
                continue
            labels.append(f"predicted\n{p['nodes']} node{'s' if p['nodes'] > 1 else ''}")
            vals.append(p["tokens_per_sec_per_gpu"])
            colors.append("#2ca02c")
        if r["measured"]:
            for m in r["measured"]:
                labels.append("measured")
                vals.append(m["tokens_per_sec_per_gpu"])
                colors.append("#9467bd")
        else:
            labels.append("measured\n(none)")
            vals.append(0)
            colors.append("#cccccc")
        ax.bar(range(len(vals)), vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        peak = (peak_flops(c.gpu, "bf16") or 0) / model_shape(c.model).flops_per_token(c.seq_len)
        ax.axhline(peak, color="k", ls="--", lw=1)
        ax.text(len(vals) - 0.5, peak, f"100% BF16 peak = {peak:,.0f}", ha="right",
                va="bottom", fontsize=8)  # fmt: skip
        ax.set_xticks(range(len(vals)), labels, fontsize=8)
        ax.set_ylabel("tokens/s per GPU")
        ax.set_title(f"{c.id}: Llama 3 {c.model} on {c.gpu}, {c.precision.upper()}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(claims: list[Claim], results: dict[str, dict], nodes_list: list[int]) -> str:
    lines = [
        "# Reproduction report: published throughput claims",
        "",
        "Generated by `python -m tools.reproduce` from `benchmarks/claims.toml`. Model FLOPs",
        "per token as torchtitan counts them (6 x non-embedding params + 12 x layers x dim x",
        "seq); peaks from core/hardware.py; predictions from parallel/perf.py (calibration:",
        "benchmarks/calibration.md) with the planner's best plan (parallel/planner.py).",
        "",
    ]
    for c in claims:
        r = results[c.id]
        lines += [
            f"## {c.id}",
            "",
            f"> {c.quote}",
            "",
            f"Source: {c.source}. Model Llama 3 {c.model}, {c.gpu}, {c.precision.upper()}, "
            f"seq {c.seq_len}{' (assumed; not stated)' if c.assumed_seq else ''}.",
            "",
            "| reading | tokens/s/GPU | PFLOP/s per GPU | % of BF16 peak | % of FP8 peak | physics |",
            "|---|---|---|---|---|---|",
        ]
        for p in r["physics"]:
            lines.append(
                f"| {p['reading']} | {p['tokens_per_sec_per_gpu']:,.0f} | {p['pflops_per_gpu']:.2f} "
                f"| {p['pct_of_bf16_peak']:.0f}% | {p['pct_of_fp8_peak']:.0f}% | {p['verdict']} |"
            )
        lines += [
            "",
            f"Predicted with `{c.recipe}` on `{c.cluster}` (planner's best plan, "
            f"{c.precision.upper()}):",
            "",
            "The recipe's global batch is kept; at many nodes it caps data parallelism (64 "
            "sequences allow at most 64 data-parallel ranks), so pipeline and context "
            "parallelism fill the rest.",
            "",
            "| nodes | best plan | tokens/s/GPU | tokens/s/node | MFU | memory GiB/GPU |",
            "|---|---|---|---|---|---|",
        ]
        for p in r["predictions"]:
            if "error" in p:
                lines.append(f"| {p['nodes']} | no plan fits: {p['error']} | - | - | - | - |")
                continue
            lines.append(
                f"| {p['nodes']} | {p['plan']} (local batch {p['local_batch_size']}, global "
                f"{p['global_batch_size']}) | {p['tokens_per_sec_per_gpu']:,.0f} | "
                f"{p['tokens_per_sec_per_node']:,.0f} | {p['mfu_pct']:.1f}% | "
                f"{p['memory_gib_per_gpu']:.1f} |"
            )
        meas = r["measured"]
        lines += [
            "",
            "Measured: "
            + (
                ", ".join(
                    f"{m['tokens_per_sec_per_gpu']:,.0f} tokens/s/GPU ({m['file']})" for m in meas
                )
                if meas
                else "none (no benchmark JSON for this model on this GPU)"
            ),
            "",
        ]
    lines += ["## Verdict", ""]
    lines += [f"- {v}" for v in verdict(claims, results)]
    lines += ["", "![published vs predicted vs measured](throughput.png)", ""]
    return "\n".join(lines)


@exit_on_config_error
def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--claims", default=str(DEFAULT_CLAIMS), help="claims TOML")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output folder")
    p.add_argument("--nodes", default="1,8,64", help="node counts to predict (comma list)")
    p.add_argument("--only", default=None, help="comma list of claim ids")
    args = p.parse_args(argv)
    try:
        nodes_list = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"expected a comma list of integers, got {show(args.nodes)}", key="--nodes"
        ) from None
    if not nodes_list or min(nodes_list) < 1:
        raise ConfigError(f"expected positive node counts, got {show(args.nodes)}", key="--nodes")
    if len(nodes_list) > 16:  # each count is a prediction per claim
        raise ConfigError(f"expected at most 16 node counts, got {len(nodes_list)}", key="--nodes")
    for n in nodes_list:
        positive_arg(n, "--nodes", MAX_NODES)
    claims = load_claims(args.claims)
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {c.id for c in claims}
        if unknown:
            raise ConfigError(
                f"unknown claim ids {show(sorted(unknown))}", file=args.claims, key="--only"
            )
        claims = [c for c in claims if c.id in want]
    if not claims:
        raise ConfigError("no claims to check", file=args.claims, key="claim")
    roots = [ROOT / "benchmarks", ROOT / "outputs"]
    results = {
        c.id: {
            "claim": {
                k: getattr(c, k)
                for k in ("source", "quote", "model", "gpu", "precision", "value", "unit")
            },
            "physics": physics(c),
            "predictions": predictions(c, nodes_list),
            "measured": find_measurements(c, roots),
        }
        for c in claims
    }
    out = out_dir_arg(args.out, "--out")
    (out / "report.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(markdown(claims, results, nodes_list))
    chart(claims, results, out / "throughput.png")
    for v in verdict(claims, results):
        print(v)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, {out / 'throughput.png'}")


if __name__ == "__main__":
    run(main)
