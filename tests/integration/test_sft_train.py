"""train.py with finetune.mode = "lora" on the Trainer path: the base checkpoint's weights are
bit-identical after training, the adapters moved, held-out scores and the PEFT export written."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from posttrain.tasks import letter_sort
from runtime.safe_load import SafeFileSystemReader, safe_dcp_load
from tests.helpers.runs import run_train

pytestmark = pytest.mark.slow  # training runs: ~1-3 min on 2 shared cores


def _read(path: str, keep) -> dict[str, torch.Tensor]:
    md = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.items()
        if isinstance(m, TensorStorageMetadata) and keep(k)
    }
    safe_dcp_load(sd, path)
    return sd


def test_lora_sft_keeps_base_bit_identical(tmp_path, seed_checkpoint):
    train, held = letter_sort(200, 10, seed=1)
    for name, rows in (("train", train), ("held", held)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    run_train(out, [
        f"data.source={tmp_path / 'train.jsonl'}", f"data.eval_source={tmp_path / 'held.jsonl'}",
        f"checkpoint.load_from={seed_checkpoint}", "checkpoint.interval=3",
        "training.steps=3", "training.warmup_steps=0", "training.seq_len=64",
        "training.local_batch_size=2", "training.lr=0.01", "metrics.log_every=1",
    ], recipe="recipes/sft_debug.toml", timeout=900)  # fmt: skip
    # Model weights only (the seed also holds optimizer / scheduler / data entries).
    base = _read(
        seed_checkpoint, lambda k: k.startswith(("tok_embeddings.", "layers.", "norm.", "lm_head."))
    )
    assert base and not any(".lora_" in k for k in base)
    final = _read(str(out / "checkpoint" / "step-3"), lambda k: k in base or ".lora_b" in k)
    for k, v in base.items():
        assert torch.equal(final[k], v), k
    lora_b = [v for k, v in final.items() if ".lora_b" in k]
    assert lora_b and max(v.abs().max().item() for v in lora_b) > 0  # the adapters trained
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    held_steps = [r["step"] for r in recs if r.get("event") == "heldout"]
    assert held_steps == [0, 3]
    assert all(0.0 <= r["exact_match"] <= 1.0 for r in recs if r.get("event") == "heldout")
    export = out / "export" / "sft_debug"
    assert (export / "adapter_model.safetensors").exists()
    assert json.loads((export / "adapter_config.json").read_text())["r"] == 16
    assert (export / "merged" / "model.safetensors.index.json").exists()  # runtime.hf writer
