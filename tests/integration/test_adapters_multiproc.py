"""[[adapters]] on 2 processes (gloo, FSDP2-sharded frozen base, replicated adapters):
two adapters in one job equal each alone, the base stays bit-identical, a resumed adapter
equals the uninterrupted one, the 2-process job equals the 1-process job over the same
global batch, and tp/pp/cp layouts are refused."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from posttrain.lora import base_state
from tests.helpers.adapter_recipe import STEPS, adapter_weights, write_adapter_recipe
from tests.helpers.runs import ROOT, child_env, free_port, python, train_main_error


def _final(out, name: str) -> dict[str, torch.Tensor]:
    return adapter_weights(out / "adapters" / name / f"step-{STEPS[name]}")


def _losses(out, name: str) -> list[float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r.get("adapter") == name and "loss" in r]


def _maxdiff(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


@pytest.mark.multiproc
def test_adapters_two_processes(tmp_path):
    recipe = write_adapter_recipe(tmp_path)
    out = tmp_path / "dp2"
    cmd = [python(), "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
           str(ROOT / "tests/helpers/adapters_dp_worker.py"), recipe, str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # One frozen base, sharded over both ranks, bit-identical after every job.
    for run in ("turns-a-b", "turns-a", "turns-b"):
        rec = json.loads((out / run / "base_unchanged.json").read_text())
        assert rec["base_unchanged"] and rec["keys"] > 0 and rec["sharded_params"] > 0, (run, rec)

    # Two adapters in one 2-process job equal each trained alone (2 processes): turns are
    # the same arithmetic, so exactly; the claim's tolerance is 1e-5.
    for name in ("a", "b"):
        alone = _final(out / f"turns-{name}", name)
        both = _final(out / "turns-a-b", name)
        assert _maxdiff(both, alone) <= 1e-5, name
        assert _losses(out / "turns-a-b", name) == _losses(out / f"turns-{name}", name)
        # Control: training moved B from its zero init (the comparison is not vacuous).
        assert max(v.abs().max().item() for k, v in alone.items() if "lora_b" in k) > 1e-3
        # train.py under torchrun, batched (segmented multi-LoRA forward): losses within 1e-5.
        got, want = _losses(out / "batched-a-b", name), _losses(out / f"turns-{name}", name)
        assert len(got) == len(want) == STEPS[name]
        assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= 1e-5, name
    assert _maxdiff(_final(out / "turns-a-b", "a"), _final(out / "turns-a-b", "b")) > 1e-3
    # Stopped after 2 steps and resumed on 2 processes: the uninterrupted adapter, exactly.
    resumed, straight = _final(out / "resumed-a", "a"), _final(out / "turns-a", "a")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    assert _losses(out / "resumed-a", "a") == _losses(out / "turns-a", "a")[2:]

    # train.py's job wrote every adapter's metrics, checkpoint, export and summary (rank 0).
    summary = json.loads((out / "batched-a-b" / "adapters_summary.json").read_text())
    assert summary["world_size"] == 2
    assert {n: s["steps"] for n, s in summary["adapters"].items()} == STEPS
    for name in ("a", "b"):
        assert (out / "batched-a-b" / "export" / name / "adapter_model.safetensors").exists()
        # The merged folder (sft_debug sets export_merged): the base all-gathered on both ranks.
        merged_index = (
            out / "batched-a-b" / "export" / name / "merged" / "model.safetensors.index.json"
        )
        assert merged_index.exists()  # runtime.hf's writer: safetensors file(s) + their index
        # Tokens count every rank's rows: 2 processes x 2 rows x 64 per step.
        assert summary["adapters"][name]["tokens"] == STEPS[name] * 2 * 2 * 64

    # The same global batch (4 rows) in one process: data parallel changes only the
    # summation order of the gradients. Losses agree within 1e-5; weights within 1e-4
    # (AdamW's g / sqrt(v) amplifies last-bit differences of near-zero gradients).
    from posttrain import jobs
    from runtime import session

    one = tmp_path / "one"
    saved = dict(__import__("os").environ)
    try:
        job = session.prepare(recipe, [f"job.output_dir={one}", "training.local_batch_size=4"])
        aj = jobs.adapter_job(job)
        aj.train(export=False)
    finally:
        __import__("os").environ.clear()
        __import__("os").environ.update(saved)
    for name in ("a", "b"):
        got, want = _losses(out / "turns-a-b", name), _losses(one, name)
        assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= 1e-5, name
        assert _maxdiff(_final(out / "turns-a-b", name), _final(one, name)) <= 1e-4, name

    # The merged export of the 2-process job holds the full base (all-gathered from both
    # ranks' shards; the 1-process job built the same seeded base) plus alpha/r B A.
    from safetensors.torch import load_file

    base = aj.state_dict_adapter.to_hf(base_state(aj.model))
    scale = job.recipe.lora.alpha / job.recipe.lora.rank
    folder = out / "batched-a-b" / "export" / "a"
    index = json.loads((folder / "merged" / "model.safetensors.index.json").read_text())
    merged = {}
    for f in sorted(set(index["weight_map"].values())):
        merged.update(load_file(folder / "merged" / f))
    assert set(index["weight_map"]) == merged.keys()
    peft = load_file(folder / "adapter_model.safetensors")
    assert merged.keys() == base.keys()
    adapted = 0
    for k, w in base.items():
        lora_a = peft.get(f"base_model.model.{k.removesuffix('.weight')}.lora_A.weight")
        if lora_a is None:
            assert torch.equal(merged[k], w), k
            continue
        lora_b = peft[f"base_model.model.{k.removesuffix('.weight')}.lora_B.weight"]
        assert (merged[k] - (w + scale * lora_b @ lora_a)).abs().max().item() <= 1e-5, k
        adapted += 1
    assert adapted == 7 * 2  # wqkv -> q, k, v; wo, w1, w2, w3: 7 per layer, 2 layers


@pytest.mark.parametrize("axis", ["tp", "pp", "cp"])
def test_adapters_refuse_model_parallel(tmp_path, monkeypatch, capsys, axis):
    """tp/pp/cp > 1 with [[adapters]]: one line naming the key, exit 2, no process group."""
    recipe = write_adapter_recipe(tmp_path)
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    code, err = train_main_error(["--recipe", recipe, "--set", f"parallel.{axis}=2"], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"parallel.{axis}" in err[0] and "[[adapters]]" in err[0], err
    assert not torch.distributed.is_initialized()
