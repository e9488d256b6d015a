"""Packing benchmark on the embedded standard-library corpus, one core, one run.

    python -m benchmarks.bench_packing [--seq-lens 2048 8192] [--core 0]

For each seq_len: our loader's stream end to end (read + tokenize + pack + materialize) with
concat, bfd and none, next to torchtitan's HuggingFaceTextDataset on the same documents and
the same tokenizer; then the packers alone on the documents' token counts (the packing
decision without tokenization), with a bfd window sweep. Writes benchmarks/packing.json
and benchmarks/packing.md (command, machine, versions, date, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "platform": platform.platform()}


def _versions() -> dict:
    from importlib.metadata import version

    import datasets
    import tokenizers
    import torch
    import torchtitan  # noqa: F401

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchtitan": version("torchtitan"),
        "datasets": datasets.__version__,
        "tokenizers": tokenizers.__version__,
    }


def packers_only(lengths: list[int], seq_len: int, packing: str, window: int) -> dict:
    from data.packing import make_packer

    # Best of 5: a pass takes milliseconds, so one scheduler stall on a shared machine
    # would dominate a single timing.
    dt = float("inf")
    for _ in range(5):
        p = make_packer(packing, seq_len, window=window)
        t0 = time.perf_counter()
        rows = []
        for d, n in enumerate(lengths):
            rows += p.push(d, n)
        rows += p.flush()
        dt = min(dt, time.perf_counter() - t0)
    s = p.stats
    # Attention work under the document mask vs plain causal, from the rows' pieces (the
    # padding pseudo-document included): what the mfu_doc_masked_pct variant discounts.
    tri = lambda n: n * (n + 1) // 2  # noqa: E731
    doc_pairs = sum(sum(tri(q.size) for q in r.pieces) + tri(r.padding) for r in rows)
    return {
        "packing": packing,
        "window": window if packing == "bfd" else None,
        "seq_len": seq_len,
        "sequences": len(rows),
        "padding_fraction": s.padding_fraction,
        "split_documents_fraction": s.split_documents_fraction,
        "documents_per_sec": len(lengths) / dt if dt > 0 else None,
        "doc_masked_over_causal_attention": doc_pairs / (len(rows) * tri(seq_len)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--core", type=int, default=0, help="CPU core to pin to")
    ap.add_argument("--out", default=str(HERE / "packing"))
    ap.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    args = ap.parse_args(argv)
    if args.render:
        Path(args.out + ".md").write_text(render(json.loads(Path(args.out + ".json").read_text())))
        return

    # One core: pin this process and stop `tokenizers` from spawning its thread pool.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    import torch

    torch.set_num_threads(1)
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from core.models import model_shape
    from data.loader import encode_documents
    from data.packstats import (
        TextListSource,
        measure_packing,
        measure_torchtitan,
        stdlib_texts,
    )
    from data.tokenizer import resolve_tokenizer

    load_before = os.getloadavg()
    vocab = model_shape("debugmodel").vocab_size
    tok_path = resolve_tokenizer("embedded", vocab_size=vocab)
    tok = HuggingFaceTokenizer(tokenizer_path=tok_path)
    texts = stdlib_texts()
    lengths = [len(ids) - 1 for ids in encode_documents(tok, texts)]

    results: dict = {
        "command": "python -m benchmarks.bench_packing " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": _machine(),
        "versions": _versions(),
        "pinned_core": args.core,
        "tokenizer": f"embedded byte-level BPE, vocab {vocab} ({tok_path})",
        "corpus": {"documents": len(texts), "pairs": sum(lengths)},
        "end_to_end": [],
        "packers_only": [],
    }
    mem = TextListSource(texts, description="stdlib (in memory)")
    for L in args.seq_lens:
        for packing in ("concat", "bfd", "none"):
            r = measure_packing(mem, tok, seq_len=L, packing=packing, window=args.window)
            print(json.dumps(r), flush=True)
            results["end_to_end"].append(r)
        # The loader's real path for 'stdlib': the same, plus reading the files.
        r = measure_packing("stdlib", tok, seq_len=L, packing="bfd", window=args.window)
        r["packing"] = "bfd, reading the files"
        print(json.dumps(r), flush=True)
        results["end_to_end"].append(r)
        r = measure_torchtitan(texts, tok, seq_len=L)
        print(json.dumps(r), flush=True)
        results["end_to_end"].append(r)
        for packing, window in [
            ("concat", 0),
            ("none", 0),
            ("bfd", 64),
            ("bfd", 256),
            ("bfd", 1024),
        ]:
            results["packers_only"].append(packers_only(lengths, L, packing, window))
    results["load_average_before_after"] = [load_before, os.getloadavg()]
    Path(args.out + ".json").write_text(json.dumps(results, indent=1) + "\n")
    Path(args.out + ".md").write_text(render(results))
    print(f"wrote {args.out}.json and {args.out}.md")


def render(r: dict) -> str:
    m, v = r["machine"], r["versions"]
    lines = [
        "# Packing benchmark: standard-library corpus",
        "",
        f"- command: `{r['command'].strip()}`",
        f"- date: {r['date']}",
        f"- machine: {m['cpu']}, {m['logical_cores']} logical cores (pinned to core "
        f"{r['pinned_core']}; `TOKENIZERS_PARALLELISM=false`), {m['platform']}",
        f"- load average (1/5/15 min) before / after: {r['load_average_before_after'][0]} / "
        f"{r['load_average_before_after'][1]} (the machine is shared: speeds are indicative)",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- tokenizer: {r['tokenizer']}",
        f"- corpus: {r['corpus']['documents']} documents (stdlib .py files, bad ones "
        f"skipped), {r['corpus']['pairs']:,} label-bearing tokens",
        "",
        "## End to end, one core (tokenize + pack + build rows)",
        "",
        "Both sides read the same documents from memory (a list of strings; torchtitan's "
        "through an in-memory `datasets.Dataset` registered in its `DATASETS`), except the "
        "row marked 'reading the files'. `tokens` = positions with a label; torchtitan's "
        "dataset has no padding but drops the final partial row (`dropped`). Its rows are "
        "identical to our concat rows (tests/integration/test_packstats.py), so its split-documents "
        "fraction is concat's. tokens/s (CPU time) = tokens / CPU seconds of the pinned "
        "process, i.e. the rate of one dedicated core; wall-clock rates on this shared "
        "2-core machine are also given but depend on the other jobs.",
        "",
        "| seq_len | packing | sequences | padding % | dropped % | split docs % | tokens/s "
        "(wall) | tokens/s (CPU time) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for e in r["end_to_end"]:
        name = e["packing"] + (f" (window {e['window']})" if e.get("window") else "")
        split = e.get("split_documents_fraction")
        if split is None:
            same = [
                x
                for x in r["end_to_end"]
                if x["packing"] == "concat" and x["seq_len"] == e["seq_len"]
            ]
            split = same[0]["split_documents_fraction"] if same else None
        lines.append(
            f"| {e['seq_len']} | {name} | {e['sequences']:,} | {100 * e['padding_fraction']:.3f} "
            f"| {100 * e.get('dropped_fraction', 0.0):.3f} "
            f"| {'' if split is None else f'{100 * split:.1f}'} | {e['tokens_per_sec']:,.0f} "
            f"| {e['tokens_per_cpu_sec']:,.0f} |"
        )
    lines += [
        "",
        "## Packers alone (token counts in, row decisions out; no tokenization)",
        "",
        "`attention` = (query, key) pairs the document mask keeps / pairs of plain causal "
        "attention over the same rows (what `mfu_doc_masked_pct` discounts).",
        "",
        "| seq_len | packing | sequences | padding % | split docs % | documents/s | attention |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for e in r["packers_only"]:
        name = e["packing"] + (f" (window {e['window']})" if e.get("window") else "")
        lines.append(
            f"| {e['seq_len']} | {name} | {e['sequences']:,} | {100 * e['padding_fraction']:.3f} "
            f"| {100 * e['split_documents_fraction']:.1f} | {e['documents_per_sec']:,.0f} "
            f"| {e['doc_masked_over_causal_attention']:.3f} |"
        )
    lines += [
        "",
        "Reading: bfd pads under 1% (target) and splits only documents longer than seq_len "
        "(their full seq_len chunks are rows of their own); concat splits every document "
        "that straddles a row boundary; none pads heavily on this corpus of long files. "
        "Tokenization dominates the end-to-end time and the packing decision itself is "
        "cheap, so every packer runs at torchtitan's speed within this machine's noise "
        "(CPU-time rates moved by about 15% between runs on the shared 2 cores). The "
        "document mask keeps 74-95% of plain causal attention's (query, key) pairs here: "
        "bfd keeps more than concat because it splits fewer documents. With the global "
        "stream (every rank tokenizes every document, data/loader.py), one core's "
        "end-to-end rate bounds dp x tokens/s per data-parallel replica for one loader "
        "process.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
