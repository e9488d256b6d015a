"""Worker for test_hf_interop.py (one process: it starts a gloo process group of one).

    python tests/integration/_hf_interop_worker.py FAMILY WORKDIR [scratch]

FAMILY: llama3, qwen3, or a mixture-of-experts case of MOE_CASES (qwen3_moe, gpt_oss,
deepseek_v3, kimi_k2_7: the last two titanscale's `debugmodel_sigmoid` flavors, each a
transformers `DeepseekV3ForCausalLM`).

1. Builds a small model of FAMILY with `transformers` (random weights), save_pretrained.
2. Loads it through titanscale (`checkpoint.load_hf`, torchtitan's adapter) and compares
   our float32 logits with transformers' on the same tokens.
3. Trains 3 steps with `checkpoint.export_hf = true` (float32), then loads the exported
   folder with transformers and compares its logits with our trained model's.
With `scratch`, no Hugging Face folder is loaded: the model trains from torchtitan's
initialisation and the export's config.json is written from torchtitan's model config
(step 3 only). Prints one JSON line: the max |difference| figures and the export's files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# case -> (model.family, model.flavor, model.layers) of the titanscale recipe it loads into.
MOE_CASES = {
    "qwen3_moe": ("qwen3", "debugmodel_moe", 2),
    "gpt_oss": ("gpt_oss", "debugmodel", 2),
    "deepseek_v3": ("deepseek_v3", "debugmodel_sigmoid", 0),
    "kimi_k2_7": ("kimi_k2_7", "debugmodel_sigmoid", 0),
}
# Formats without a routing bias (the others carry it as e_score_correction_bias).
NO_ROUTING_BIAS = ("qwen3_moe", "gpt_oss")


def hf_model(family: str):
    """transformers' model with the debug flavor's shape (the independent reference)."""
    import transformers

    from tests.helpers.hf_reference import (
        DEEPSEEK_V3_SIGMOID_DEBUG,
        GPT_OSS_DEBUG,
        KIMI_SIGMOID_DEBUG,
        QWEN3_MOE_DEBUG,
    )

    if family in ("deepseek_v3", "kimi_k2_7"):
        kw = DEEPSEEK_V3_SIGMOID_DEBUG if family == "deepseek_v3" else KIMI_SIGMOID_DEBUG
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw))
        # transformers initialises the routing bias to zero: a random one makes the load
        # check that it is read, and that it only chooses experts (never weights them).
        with torch.no_grad():
            for layer in model.model.layers[kw["first_k_dense_replace"] :]:
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
        return model
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE_DEBUG))
    if family == "gpt_oss":
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(**GPT_OSS_DEBUG))
    if family == "llama3":
        cfg = transformers.LlamaConfig(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=6,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=2048,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=False,
        )
        return transformers.LlamaForCausalLM(cfg)
    from tests.helpers.hf_reference import QWEN3_DEBUG

    cfg = transformers.Qwen3Config(**QWEN3_DEBUG)
    return transformers.Qwen3ForCausalLM(cfg)


def our_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    masks = model.get_attention_masks(positions=positions)  # type: ignore[operator]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        # by keyword: Kimi's forward takes both keyword-only (images may come first)
        out = model(tokens, positions=positions, attention_masks=masks)
        if getattr(model, "_skip_lm_head", False):  # the chunked loss applies lm_head itself
            out = model.lm_head(out)  # type: ignore[operator]
    model.train(was_training)
    return out.float()


def hf_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        return m(tokens).logits.float()


def main() -> None:
    family, work = sys.argv[1], Path(sys.argv[2])
    scratch = sys.argv[3:] == ["scratch"]
    torch.manual_seed(0)
    src = work / f"hf_{family}"
    hf_model(family).save_pretrained(src)

    from runtime import session
    from runtime.trainer import TitanscaleTrainer

    fam, flavor, layers = MOE_CASES.get(family, (family, "debugmodel", 0))
    overrides = [
        f"job.output_dir={work / 'run'}",
        f"model.family={fam}",
        f"model.flavor={flavor}",
        f"model.layers={layers}",
        # The Qwen3-MoE / GPT-OSS formats have no routing bias to export (runtime.hf).
        *(["moe.load_balance=none"] if family in NO_ROUTING_BIAS else []),
        *([] if scratch else [f"checkpoint.load_hf={src}"]),
        "checkpoint.export_hf=true",
        "checkpoint.export_dtype=float32",
        "training.steps=3",
        "training.warmup_steps=1",
        "training.seq_len=64",
        "training.local_batch_size=2",
        "training.lr=1e-3",
        "metrics.tensorboard=false",
        "metrics.summary_skip_steps=0",
    ]
    job = session.prepare(None, overrides)
    job.platform.apply()
    trainer = TitanscaleTrainer(job.config)
    try:
        tokens = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(1))
        model = trainer.model_parts[0]
        before = our_logits(model, tokens)  # random init, not yet loaded
        ref = hf_logits(str(src), tokens)
        init_gap = (before - ref).abs().max().item()
        if scratch:
            loaded, diff_load = before, None
        else:
            trainer.checkpointer.load()
            loaded = our_logits(model, tokens)
            diff_load = (loaded - ref).abs().max().item()
        trainer.train()  # loads the HF folder again (no checkpoint of this run yet)
        trained = our_logits(model, tokens)
        export = Path(job.recipe.export_dir) / "step-3"
        exported = hf_logits(str(export), tokens)
        diff_export = (trained - exported).abs().max().item()
        moved = (trained - loaded).abs().max().item()
        import transformers

        config_eos = json.loads((export / "config.json").read_text()).get("eos_token_id")
        tokenizer_eos = transformers.AutoTokenizer.from_pretrained(str(export)).eos_token_id
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    print(
        "RESULT "
        + json.dumps(
            {
                "diff_load": diff_load,
                "diff_export": diff_export,
                "init_gap": init_gap,
                "trained_moved": moved,
                "export_files": sorted(os.listdir(export)),
                "logit_scale": ref.abs().max().item(),
                "config_eos": config_eos,
                "tokenizer_eos": tokenizer_eos,
            }
        )
    )


if __name__ == "__main__":
    main()
