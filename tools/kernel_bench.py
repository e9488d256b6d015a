"""Kernel benchmark CLI: GEMM and attention shapes of Llama 3 per TP degree, per backend.

    python -m tools.kernel_bench [--json] [--model 70B,8B] [--tp 1,2,4,8] [--tokens N]
                                 [--out benchmarks/kernel_bench_cpu]

On CPU the defaults are small (tp 8, 32 tokens per GEMM, attention seq 256) so it runs in
a few minutes and checks every backend end to end; its timings are correctness-only. On a
GPU the defaults are the real shapes (tp 1,2,4,8, 8192 tokens per GEMM, seq 8192) with
warmup, CUDA events and torch.compile; attention flex and varlen (dense is opt-in there).
See docs/kernels.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from core.errors import ConfigError, exit_on_config_error
from tools.cli import ArgumentParser, run


def _csv(kind, choices=None):
    def parse(text: str):
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(map(str, choices or []))}"
            )
        return items

    return parse


@exit_on_config_error
def main(argv: list[str] | None = None) -> int:
    from core.models import LLAMA3_FLAVORS
    from kernels.bench import ATTENTION_NAMES, LINEAR_NAMES, markdown, run, to_json
    from kernels.caps import DeviceCaps

    caps = DeviceCaps.detect()
    gpu = caps.is_cuda
    ap = ArgumentParser(prog="python -m tools.kernel_bench", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    ap.add_argument("--model", type=_csv(str, LLAMA3_FLAVORS), default=["70B", "8B"])
    ap.add_argument("--tp", type=_csv(int), default=[1, 2, 4, 8] if gpu else [8])
    ap.add_argument(
        "--tokens",
        type=int,
        default=8192 if gpu else 32,
        help="tokens per GEMM (local batch x seq / cp)",
    )
    ap.add_argument("--attn-batch", type=int, default=1)
    ap.add_argument("--attn-seq", type=int, default=8192 if gpu else 256)
    ap.add_argument("--linear", type=_csv(str, LINEAR_NAMES), default=list(LINEAR_NAMES))
    ap.add_argument(
        "--attention",
        type=_csv(str, ATTENTION_NAMES),
        # dense materialises seq^2 masks: a CPU/test backend, opt-in on GPU
        default=["flex", "varlen"] if gpu else list(ATTENTION_NAMES),
    )
    ap.add_argument("--warmup", type=int, default=5 if gpu else 0)
    ap.add_argument("--iters", type=int, default=20 if gpu else 1)
    ap.add_argument(
        "--no-compile", action="store_true", help="GPU: time eager linears (default compiles)"
    )
    ap.add_argument("--out", help="also write OUT.md and OUT.json")
    args = ap.parse_args(argv)
    from tools.cli import positive_arg

    # Bounds: the tensors are allocated for real (tokens x dim per GEMM, batch x seq per
    # attention call; dense attention also seq^2 for its mask), and iterations are timed.
    bounds = {"tokens": 2**20, "attn_batch": 1024, "attn_seq": 2**17, "iters": 10000}
    for name, bound in bounds.items():
        positive_arg(getattr(args, name), f"--{name.replace('_', '-')}", bound)
    if not 0 <= args.warmup <= 10000:
        raise ConfigError(f"expected 0 to 10000, got {args.warmup}", key="--warmup")
    if args.attn_batch * args.attn_seq > 2**20:
        raise ConfigError(
            f"{args.attn_batch} x {args.attn_seq} tokens per attention call; at most 2**20",
            key="--attn-seq",
        )
    if args.out:
        from tools.cli import out_file_arg

        for ext in (".md", ".json"):
            out_file_arg(args.out + ext, "--out")
    if "dense" in args.attention and args.attn_seq > 16384:
        raise ConfigError(
            f"dense attention materialises a seq^2 mask: at most 16384, got {args.attn_seq}",
            key="--attn-seq",
        )
    for tp in args.tp:
        for m in args.model:
            from core.models import model_shape

            s = model_shape(m)
            if tp <= 0 or s.n_kv_heads % tp or s.n_heads % tp:
                raise ConfigError(f"tp={tp} must divide the heads of {m}", key="--tp")

    result = run(
        models=args.model,
        tps=args.tp,
        tokens=args.tokens,
        attn_batch=args.attn_batch,
        attn_seq=args.attn_seq,
        linear=args.linear,
        attention=args.attention,
        warmup=args.warmup,
        iters=args.iters,
        compile=not args.no_compile,
        caps=caps,
    )
    command = "python -m tools.kernel_bench " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    result["command"] = command.strip()
    text = to_json(result) if args.json else markdown(result, command.strip())
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".md").write_text(markdown(result, command.strip()))
        Path(args.out + ".json").write_text(to_json(result) + "\n")
    return 0


if __name__ == "__main__":
    run(main)
