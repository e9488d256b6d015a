"""tools.kernel_bench on CPU: every backend runs (emulated) and the CLI writes JSON or exits 2."""

from __future__ import annotations

import json

import pytest

from kernels.bench import markdown, run
from kernels.caps import DeviceCaps
from tools.kernel_bench import main


@pytest.mark.slow
def test_cpu_run_checks_every_backend():
    result = run(
        models=["debugmodel"],
        tps=[2],
        tokens=32,
        attn_batch=1,
        attn_seq=128,
        linear=["bf16", "fp8_rowwise", "fp8_rowwise_gw_hp", "mxfp8", "fp8_tensorwise", "nvfp4"],
        attention=["flex", "varlen", "dense"],
        warmup=0,
        iters=1,
        compile=False,
        caps=DeviceCaps.cpu(),
    )
    assert result["correctness_only"]
    rows = result["rows"]
    gemm = [r for r in rows if r["kind"] == "gemm"]
    assert len(gemm) == 5 * 6
    for r in gemm:
        if r["backend"] == "bf16":
            assert r["status"] == "ok" and r["rel_err_fwd"] <= 1e-6
        elif r["backend"] == "nvfp4":  # Triton-only in torchao 0.18: the row says so
            assert r["status"].startswith("unsupported") and "no CPU emulation" in r["status"]
            continue
        else:
            assert r["status"] == "emulated" and 0.01 <= r["rel_err_fwd"] <= 0.05, r
        assert r["tflops"] > 0 and r["peak_tflops"] is None  # no peak for a CPU
    att = {r["backend"]: r for r in rows if r["kind"] == "attention"}
    assert att["varlen"]["status"].startswith("unsupported") and "CUDA" in att["varlen"]["status"]
    assert att["flex"]["passes"] == "fwd" and att["flex"]["rel_err_fwd"] <= 1e-5
    assert att["dense"]["passes"] == "fwd+bwd" and att["dense"]["rel_err_fwd"] <= 1e-5
    md = markdown(result, "python -m tools.kernel_bench")
    assert "correctness only" in md and md.count("| debugmodel |") == len(rows)


def test_cli_json_and_bad_input(capsys):
    argv = ["--json", "--model", "debugmodel", "--tp", "4", "--tokens", "16"]
    argv += ["--linear", "fp8_rowwise", "--attention", "dense", "--attn-seq", "64"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["command"].startswith("python -m tools.kernel_bench --json")
    assert {r["backend"] for r in out["rows"]} == {"fp8_rowwise", "dense"}
    with pytest.raises(SystemExit) as e:
        main(["--model", "debugmodel", "--tp", "3"])
    assert e.value.code == 2 and "--tp" in capsys.readouterr().err
