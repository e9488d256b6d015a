"""The MoE post-training recipes through train.py, shortened: RL with Rollout Routing Replay
writes router_agreement and the train/inference KL with and without replay for every update,
and LoRA SFT on attention + routed experts lowers the held-out loss (nll per trained token,
the `heldout` events before and after training) and exports a merged Hugging Face folder that
transformers' Qwen3MoeForCausalLM loads with our adapted model's logits (within 1e-4, float32)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers.runs import child_env, python

pytestmark = pytest.mark.slow  # two CPU trainings of a 64-expert debug MoE: ~2 min on 2 cores

ROOT = Path(__file__).resolve().parents[2]


def _train(recipe: str, out: Path, *sets: str) -> list[dict]:
    argv = [python(), "train.py", "--recipe", recipe, "--set", f"job.output_dir={out}"]
    for s in sets:
        argv += ["--set", s]
    p = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                       timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_rl_moe_debug_with_routing_replay(tmp_path):
    recs = _train("recipes/rl_moe_debug.toml", tmp_path / "rl", "rl.routing_replay=true",
                  "training.steps=2", "rl.sft_warmup_steps=1", "rl.prompts_per_step=2",
                  "rl.group_size=2", "rl.eval_prompts=2")  # fmt: skip
    updates = [r for r in recs if "step" in r and "event" not in r]
    assert [r["step"] for r in updates] == [1, 2]
    for r in updates:
        assert 0.0 <= r["router_agreement"] <= 1.0
        # same weights, float32, same engine: replayed and own routing agree
        assert r["train_infer_kl_replay"] < 1e-6 and r["train_infer_kl_no_replay"] >= 0.0


def test_sft_moe_debug_heldout_loss_falls(tmp_path):
    recs = _train("recipes/sft_moe_debug.toml", tmp_path / "sft", "training.steps=10",
                  "checkpoint.interval=10", "finetune.export_merged=true")  # fmt: skip
    held = [r for r in recs if r.get("event") == "heldout"]
    assert [h["step"] for h in held] == [0, 10]
    assert held[1]["nll_per_trained_token"] < held[0]["nll_per_trained_token"] - 1.0, held
    export = tmp_path / "sft" / "export" / "sft_moe_debug"
    assert (export / "adapter_model.safetensors").is_file()
    assert (export / "routed_experts_lora.safetensors").is_file()  # the experts' pairs
    # The frozen router's expert bias (a buffer torchtitan's load-balancing hook moves every
    # step) has not moved from its initial zeros under LoRA (runtime.build.keep_frozen).
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "sft" / "checkpoint" / "step-10", tmp_path / "ck.pt")
    sd = torch.load(tmp_path / "ck.pt", weights_only=False)
    sd = sd.get("model", sd)
    bias = [v for k, v in sd.items() if k.endswith("expert_bias_E")]
    assert bias and all(float(b.abs().max()) == 0.0 for b in bias)
    _merged_matches_transformers(tmp_path / "sft", sd, export / "merged")


def _merged_matches_transformers(out: Path, state: dict, merged: Path) -> None:
    """The merged export (Linear adapters and the routed experts' pairs folded, runtime.hf's
    qwen3_moe config.json) in transformers against our adapted model rebuilt as train.py
    builds it (recipe -> kernels -> LoRA converter -> expert LoRA) with the run's final
    checkpoint: the same float32 logits within 1e-4."""
    import torch
    import transformers

    from kernels.registry import apply_kernels
    from recipe.loader import load_recipe
    from runtime.build import (
        choose_kernels,
        lora_converter,
        post_train_experts,
        recipe_model_spec,
    )
    from runtime.moe_experts import expert_lora_modules
    from runtime.platform import Platform

    r = load_recipe(ROOT / "recipes/sft_moe_debug.toml", [f"job.output_dir={out}"])
    cfg = apply_kernels(recipe_model_spec(r).model, choose_kernels(r, Platform.detect()))
    cfg = post_train_experts(r, lora_converter(r).build().convert(cfg.model_config), cpu=True)
    ours = cfg.build()
    ours.load_state_dict({k: v for k, v in state.items() if k in ours.state_dict()})
    ours.eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return ours(tokens, positions, ours.get_attention_masks(positions=positions)).float()

    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    assert float((logits() - ref).abs().max()) < 1e-4
    # The comparison can fail: without the trained routed-expert pairs our logits are off.
    for _, m in expert_lora_modules(ours):
        m.scaling = 0.0
    assert float((logits() - ref).abs().max()) > 1e-2
