"""Hugging Face weights in and out against transformers as the external reference.

For a small Llama 3 (torchtitan's debug shape), a small Qwen3, Qwen3-MoE, GPT-OSS and two
DeepSeek-V3 models (deepseek_v3 and kimi_k2_7 `debugmodel_sigmoid`: DeepSeek-V3 671B's and
Moonlight's sigmoid routing with a random `e_score_correction_bias`, MLA with and without a
query LoRA, YaRN and plain RoPE) built with `transformers` (random weights, save_pretrained):
`checkpoint.load_hf` gives float32 logits equal to transformers' within 1e-4 on the same
tokens; after 3 training steps with `export_hf`, the exported folder loads in transformers
and matches our trained model's logits again.
Each case runs in its own process (it starts a one-process gloo group): ~20-40 s each.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT, child_env, python

pytestmark = pytest.mark.slow  # training runs: ~30-120 s on 2 shared cores

WORKER = Path(__file__).with_name("_hf_interop_worker.py")
TOL = 1e-4


def _run(family: str, tmp: Path, *extra: str) -> dict:
    env = child_env()
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(
        [python(), str(WORKER), family, str(tmp), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize(
    "family", ["llama3", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", "kimi_k2_7"]
)
def test_load_hf_and_export_match_transformers(family, tmp_path):
    """Mixture of experts (docs/moe.md): Qwen3MoeConfig and GptOssConfig models (torchtitan's
    qwen3 debugmodel_moe and gpt_oss debugmodel shapes, 2 layers) and DeepseekV3Config models
    (titanscale's deepseek_v3 / kimi_k2_7 debugmodel_sigmoid, 3 layers: one dense, two MoE)
    in and out the same way."""
    r = _run(family, tmp_path)
    # The comparison can fail: before loading, our randomly initialised model is far off.
    assert r["init_gap"] > 100 * TOL
    assert r["diff_load"] < TOL, r
    # Training moved the model, and the export still equals it in transformers.
    assert r["trained_moved"] > 100 * TOL
    assert r["diff_export"] < TOL, r
    files = r["export_files"]
    assert "config.json" in files and "manifest.json" in files and "tokenizer.json" in files
    assert any(f.endswith(".safetensors") for f in files)


def test_export_from_scratch_writes_a_config_transformers_reads(tmp_path):
    """No HF folder to copy config.json from: it is written from torchtitan's model config
    (Llama 3's RoPE scaling included), and transformers reproduces our logits with it."""
    r = _run("llama3", tmp_path, "scratch")
    assert r["trained_moved"] > 100 * TOL
    assert r["diff_export"] < TOL, r
    # Generation stops at eos: the config names the exported tokenizer's eos id.
    assert r["config_eos"] is not None and r["config_eos"] == r["tokenizer_eos"]
