"""Kernel benchmark: Llama 3 GEMM and attention shapes per TP degree, each backend's TFLOP/s.

Shapes come from torchtitan's llama3 configs (core.models.model_shape). Per TP degree the
GEMMs are the TP-local ones: qkv, w1/w3 and lm_head sharded by output, wo and w2 by input;
attention keeps heads/tp query heads and kv_heads/tp key/value heads. A linear is timed
forward + backward (three GEMMs, 6*M*N*K FLOPs, quantization casts included, as training
sees it); attention forward + backward with the causal FLOP count (4*D per attended
(query, key) pair forward, 2.5x that backward), the same numerator for every backend.

Every row also carries the relative error of the forward output against an fp32 reference
on the same data, so a CPU run checks each backend end to end. On CPU the figures are
correctness-only: FP8/MX run emulated (NVFP4 has no emulation: its rows say why) and nothing
is tuned. On CUDA: warmup, CUDA events,
median of `iters`, optional torch.compile of each linear (torchao's FP8/MX casts need it for
speed).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from core.errors import ConfigError
from core.linear_backends import LINEAR_BACKENDS
from core.models import model_shape
from kernels.caps import DeviceCaps
from recipe.schema import KernelsSection

LINEAR_NAMES = tuple(LINEAR_BACKENDS)
ATTENTION_NAMES = ("flex", "varlen", "dense")


@dataclass(frozen=True)
class GemmShape:
    model: str
    tp: int
    op: str
    m: int  # tokens
    n: int  # output features (TP-local)
    k: int  # input features (TP-local)

    @property
    def flops(self) -> float:
        return 6.0 * self.m * self.n * self.k  # forward + input grad + weight grad


@dataclass(frozen=True)
class AttentionShape:
    model: str
    tp: int
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int

    def flops(self, backward: bool) -> float:
        pairs = self.seq * (self.seq + 1) / 2  # causal: keys at or before each query
        fwd = 4.0 * self.head_dim * pairs * self.batch * self.heads
        return fwd * (3.5 if backward else 1.0)


def gemm_shapes(model: str, tp: int, tokens: int) -> list[GemmShape]:
    s = model_shape(model)
    qkv = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    ops = [
        ("qkv", qkv // tp, s.dim),
        ("wo", s.dim, s.n_heads * s.head_dim // tp),
        ("w1/w3", s.ffn_hidden // tp, s.dim),
        ("w2", s.dim, s.ffn_hidden // tp),
        ("lm_head", s.vocab_size // tp, s.dim),
    ]
    return [GemmShape(model, tp, op, tokens, n, k) for op, n, k in ops]


def attention_shape(model: str, tp: int, batch: int, seq: int) -> AttentionShape:
    s = model_shape(model)
    return AttentionShape(model, tp, batch, seq, s.n_heads // tp, s.n_kv_heads // tp, s.head_dim)


def _peak_tflops(caps: DeviceCaps, precision: str) -> float | None:
    if not caps.is_cuda:
        return None
    try:  # the project's one peak table (the runtime's MFU uses it too)
        from core.hardware import peak_flops
    except ImportError:
        return None
    p = peak_flops(caps.name, precision)
    return p / 1e12 if p else None


def _timer(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_linear(
    shape: GemmShape,
    backend: str,
    caps: DeviceCaps,
    *,
    device: torch.device,
    dtype: torch.dtype,
    warmup: int,
    iters: int,
    compile: bool,
) -> dict:
    from kernels.registry import build_linear, select_kernels

    row = {"kind": "gemm", **asdict(shape), "backend": backend, "flops": shape.flops}
    try:
        choice = select_kernels(
            KernelsSection(linear=backend, attention="dense"),  # type: ignore[arg-type]
            caps,
            compile=compile and not caps.is_cpu,
        )
        mod = build_linear(choice, shape.k, shape.n)
    except (ConfigError, ValueError) as e:
        return {**row, "status": f"unsupported: {getattr(e, 'detail', e)}"}
    precision = choice.linear_precision
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape.n, shape.k, generator=g) / math.sqrt(shape.k)
    x = torch.randn(shape.m, shape.k, generator=g)
    go = torch.randn(shape.m, shape.n, generator=g)
    mod = mod.to(device=device, dtype=dtype)
    with torch.no_grad():
        mod.weight.copy_(w)
    x, go = x.to(device, dtype).requires_grad_(), go.to(device, dtype)
    ref = (x.detach().float() @ mod.weight.detach().float().t()).float()
    run = torch.compile(mod) if compile and device.type == "cuda" else mod

    def step():
        x.grad = None
        mod.weight.grad = None
        run(x).backward(go)

    err = _rel(run(x).detach(), ref)
    ms = _timer(step, device, warmup, iters)
    tflops = shape.flops / (ms * 1e-3) / 1e12
    peak = _peak_tflops(caps, precision)
    return {
        **row,
        "status": "emulated" if choice.emulated else "ok",
        "precision": precision,
        "ms": ms,
        "tflops": tflops,
        "peak_tflops": peak,
        "pct_of_peak": 100 * tflops / peak if peak else None,
        "rel_err_fwd": err,
    }


def _document_inputs(shape: AttentionShape, device, dtype):
    g = torch.Generator().manual_seed(0)
    B, L = shape.batch, shape.seq
    q = torch.randn(B, L, shape.heads, shape.head_dim, generator=g)
    k = torch.randn(B, L, shape.kv_heads, shape.head_dim, generator=g)
    v = torch.randn(B, L, shape.kv_heads, shape.head_dim, generator=g)
    positions = torch.arange(L).repeat(B, 1)  # one document per sequence: causal
    return [t.to(device, dtype) for t in (q, k, v)] + [positions.to(device)]


def bench_attention(
    shape: AttentionShape,
    backend: str,
    caps: DeviceCaps,
    *,
    device: torch.device,
    dtype: torch.dtype,
    warmup: int,
    iters: int,
) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.models.common.attention import (
        create_attention_mask,
        create_varlen_metadata_for_document,
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    from kernels.registry import ATTENTION_BACKENDS, attention_problem

    row = {"kind": "attention", **asdict(shape), "backend": backend}
    problem = attention_problem(backend, caps)
    # Flex runs forward on CPU (compiled); only its backward is missing there.
    forward_only = caps.is_cpu and backend == "flex"
    if problem and not forward_only:
        return {**row, "status": f"unsupported: {problem}"}
    q, k, v, pos = _document_inputs(shape, device, dtype)
    enable_gqa = shape.kv_heads != shape.heads
    # Reference: fp32 causal SDPA with K/V repeated to the query heads (no GQA flag, no mask),
    # so on CUDA it stays on a fused kernel instead of materialising the L x L scores.
    rep = shape.heads // shape.kv_heads
    qf, kf, vf = (
        t.float().repeat_interleave(r, dim=2).transpose(1, 2)
        for t, r in ((q, 1), (k, rep), (v, rep))
    )
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True).transpose(1, 2)
    del qf, kf, vf
    mod = ATTENTION_BACKENDS[backend].make_config().build()
    if backend == "varlen":
        masks = create_varlen_metadata_for_document(pos)
    else:
        masks = create_attention_mask(
            and_masks(
                get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(pos)
            ),
            shape.batch,
            None,
            shape.seq,
            shape.seq,
            device=device,
        )
    qkv = [t.detach().requires_grad_(not forward_only) for t in (q, k, v)]
    go = torch.randn_like(q)

    def step():
        out = mod(*qkv, attention_masks=masks, enable_gqa=enable_gqa)
        if not forward_only:
            for t in qkv:
                t.grad = None
            out.backward(go)

    with torch.no_grad():
        err = _rel(mod(*qkv, attention_masks=masks, enable_gqa=enable_gqa), ref)
    ms = _timer(step, device, warmup, iters)
    flops = shape.flops(backward=not forward_only)
    tflops = flops / (ms * 1e-3) / 1e12
    peak = _peak_tflops(caps, "bf16")
    return {
        **row,
        "status": "ok (forward only: no CPU backward)" if forward_only else "ok",
        "passes": "fwd" if forward_only else "fwd+bwd",
        "flops": flops,
        "ms": ms,
        "tflops": tflops,
        "peak_tflops": peak,
        "pct_of_peak": 100 * tflops / peak if peak else None,
        "rel_err_fwd": err,
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    load = f", load avg {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (
        f"{platform.node()} {platform.machine()}: {cpu}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads{load}"
    )


def versions() -> dict:
    import torchao
    import torchtitan

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "0.3.0"),
        "torchao": torchao.__version__,
        "cuda": torch.version.cuda,
    }


def run(
    *,
    models: list[str],
    tps: list[int],
    tokens: int,
    attn_batch: int,
    attn_seq: int,
    linear: list[str],
    attention: list[str],
    warmup: int,
    iters: int,
    compile: bool,
    caps: DeviceCaps | None = None,
) -> dict:
    caps = caps or DeviceCaps.detect()
    device = torch.device("cuda" if caps.is_cuda else "cpu")
    # CPU: fp32, the dtype CPU training uses (bf16 matmuls on CPU measure nothing useful).
    dtype = torch.bfloat16 if caps.is_cuda else torch.float32
    if caps.is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references stay fp32
    rows = []
    for model in models:
        for tp in tps:
            for shape in gemm_shapes(model, tp, tokens):
                for b in linear:
                    rows.append(
                        bench_linear(
                            shape,
                            b,
                            caps,
                            device=device,
                            dtype=dtype,
                            warmup=warmup,
                            iters=iters,
                            compile=compile,
                        )
                    )
            ashape = attention_shape(model, tp, attn_batch, attn_seq)
            for b in attention:
                rows.append(
                    bench_attention(
                        ashape, b, caps, device=device, dtype=dtype, warmup=warmup, iters=iters
                    )
                )
    return {
        "device": caps.describe(),
        "device_type": caps.device_type,
        "dtype": str(dtype).replace("torch.", ""),
        "correctness_only": not caps.is_cuda,
        "tokens_per_gemm": tokens,
        "attention_batch": attn_batch,
        "attention_seq": attn_seq,
        "warmup": warmup,
        "iters": iters,
        "compile": compile and caps.is_cuda,
        "machine": machine(),
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "rows": rows,
    }


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict, command: str = "") -> str:
    """The result as a Markdown report (command, machine, versions, date, two tables)."""
    v = result["versions"]
    lines = [f"# Kernel benchmark: {result['device']}", ""]
    if command:
        lines.append(f"- command: `{command}`")
    lines += [
        f"- date: {result['date']}",
        f"- machine: {result['machine']}",
        f"- versions: python {v['python']}, torch {v['torch']}, torchtitan {v['torchtitan']}, "
        f"torchao {v['torchao']}, CUDA {v['cuda']}",
        f"- dtype {result['dtype']}; tokens per GEMM {result['tokens_per_gemm']}; attention "
        f"batch {result['attention_batch']} x seq {result['attention_seq']}; warmup "
        f"{result['warmup']}, median of {result['iters']}; compile {result['compile']}",
    ]
    if result["correctness_only"]:
        lines += [
            "",
            "**CPU run: correctness only.** FP8/MXFP8 are emulated (fp32 matmuls of "
            "dequantized values; fp8_tensorwise with its FP8-all-gather weight) and the "
            "timings say nothing about GPU throughput; NVFP4 has no CPU emulation (its rows "
            "say why); `rel err` is the forward output against an fp32 reference on the same "
            "data.",
        ]
    lines += [
        "",
        "## GEMMs (forward + backward of one linear, TP-local shapes)",
        "",
        "| model | tp | op | M x N x K | backend | status | ms | TFLOP/s | % of peak | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["kind"] != "gemm":
            continue
        lines.append(
            f"| {r['model']} | {r['tp']} | {r['op']} | {r['m']} x {r['n']} x {r['k']} | "
            f"{r['backend']} | {r['status']} | {_fmt(r.get('ms'), '.2f')} | "
            f"{_fmt(r.get('tflops'), '.3g')} | {_fmt(r.get('pct_of_peak'), '.1f')} | "
            f"{_fmt(r.get('rel_err_fwd'), '.2e')} |"
        )
    lines += [
        "",
        "## Attention (causal, one document per sequence; TP-local heads)",
        "",
        "| model | tp | B x L | heads (q/kv) x dim | backend | status | ms | TFLOP/s | "
        "% of peak | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["kind"] != "attention":
            continue
        lines.append(
            f"| {r['model']} | {r['tp']} | {r['batch']} x {r['seq']} | {r['heads']}/"
            f"{r['kv_heads']} x {r['head_dim']} | {r['backend']} | {r['status']} | "
            f"{_fmt(r.get('ms'), '.2f')} | {_fmt(r.get('tflops'), '.3g')} | "
            f"{_fmt(r.get('pct_of_peak'), '.1f')} | {_fmt(r.get('rel_err_fwd'), '.2e')} |"
        )
    return "\n".join(lines) + "\n"


def to_json(result: dict) -> str:
    return json.dumps(result, indent=1, sort_keys=False)
