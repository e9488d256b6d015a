"""Rollout throughput: our KV-cache generator (rl/generator.py) against vLLM (rl/vllm_engine.py)
on the same model, prompts, sampling settings and machine.

Model: torchtitan's debug Llama cut to --layers layers (rl_debug's model), float32, random
weights from seed 0 (throughput does not depend on the values: no stop token, every sample runs
to max_tokens, so both engines decode the same number of tokens). Prompts: --prompts random
token prompts of 8-24 tokens (seed 1), --n samples each, --max-tokens new tokens, temperature 1,
top_p 1. Each engine: one warm-up call, then --reps timed calls; the median is reported. vLLM's
start-up (process, model load, KV-cache allocation) is reported apart.

    python benchmarks/rollouts.py                        # CPU (needs .venv-vllm)
    python benchmarks/rollouts.py --device cuda --layers 6 --prompts 256   # a GPU machine

On CUDA the engine serves the model's own head size (no padding) and the native generator runs
on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(layers: int, device: str):
    import dataclasses
    import importlib

    import torch

    from kernels.attention import set_inner_attention
    from kernels.dense_attention import DenseMaskAttention

    spec = importlib.import_module("torchtitan.models.llama3").model_registry("debugmodel")
    cfg = spec.model
    cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=256)
    set_inner_attention(cfg, DenseMaskAttention.Config())
    torch.manual_seed(0)
    with torch.device(device):
        model = cfg.build()
    model.init_states(buffer_device=torch.device(device))
    return model.eval(), cfg, spec.state_dict_adapter(cfg, None)


def timed(fn, reps: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/rollouts")
    args = ap.parse_args()
    import torch

    from rl.generator import Generator, SamplingParams
    from rl.vllm_engine import EngineConfig, HFView, VllmEngine, VllmGenerator, served_head_dim

    model, cfg, sda = build(args.layers, args.device)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(1, cfg.vocab_size, (int(torch.randint(8, 25, (1,), generator=g)),),
                      generator=g).tolist()
        for _ in range(args.prompts)
    ]  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, n=args.n, seed=3)
    rows = args.prompts * args.n
    new_tokens = rows * args.max_tokens
    results = []

    native = Generator.from_model(model, max_batch=rows)
    med, times = timed(lambda: native.generate(prompts, params), args.reps)
    results.append({"engine": "native (rl/generator.py)", "seconds": med, "times": times})

    view = HFView(cfg, sda)
    view.head_dim = served_head_dim(view.heads()[2], cpu=args.device == "cpu")
    folder = tempfile.mkdtemp(prefix="rollouts-bench-")
    view.write_folder(folder, model.state_dict())
    t0 = time.perf_counter()
    engine = VllmEngine(EngineConfig(folder, max_model_len=256, max_num_seqs=max(rows, 8)))
    startup = time.perf_counter() - t0
    try:
        gen = VllmGenerator(engine, view)
        med, times = timed(lambda: gen.generate(prompts, params), args.reps)
        results.append(
            {"engine": "vLLM (rl/vllm_engine.py)", "seconds": med, "times": times,
             "startup_s": startup}
        )  # fmt: skip
    finally:
        engine.close()
    for r in results:
        r["rollouts_per_s"] = rows / r["seconds"]
        r["new_tokens_per_s"] = new_tokens / r["seconds"]
    vllm_version = subprocess.run(
        [str(ROOT / ".venv-vllm/bin/python"), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
        check=False,
    ).stdout.strip()  # fmt: skip
    meta = {
        "command": "python benchmarks/rollouts.py " + " ".join(sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({args.device}), load "
        f"average at end {os.getloadavg()[0]:.1f}",
        "versions": {"torch (native)": torch.__version__, "vllm": vllm_version},
        "workload": f"debug Llama {args.layers} layers float32; {args.prompts} prompts x n "
        f"{args.n} = {rows} rollouts of {args.max_tokens} new tokens; temperature 1, top_p 1",
    }
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
    lines = [
        "# Rollout throughput: built-in generator vs vLLM",
        "",
        f"`{meta['command']}` on {meta['date']} (commit {commit}); {meta['machine']}; "
        f"{meta['versions']}. Workload: {meta['workload']}. Median of {args.reps} timed calls "
        "after one warm-up; vLLM's start-up is apart.",
        "",
        "| engine | rollouts/s | new tokens/s | seconds per call (median) | start-up s |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        start = f"{r['startup_s']:.0f}" if "startup_s" in r else "0"
        lines.append(
            f"| {r['engine']} | {r['rollouts_per_s']:.1f} | {r['new_tokens_per_s']:.0f} | "
            f"{r['seconds']:.2f} | {start} |"
        )
    lines += ["", '(Read the figures against docs/vllm.md\'s "when to use which".)']
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
