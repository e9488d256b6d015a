"""Adapter jobs ([[adapters]], [lora]): bad recipes and changed resumes are one line.

Before: a 300-character adapter name passed the recipe and failed at the first save with
`OSError: File name too long`; an unknown `lora.target_modules` entry was a warning, and a
list matching no layer failed inside the optimizer; `warmup_steps` above `steps` was refused
under [training] but accepted under [[adapters]]; resuming with another `lora.rank` or with
the adapters' sources swapped was a traceback. References: the file system's own name limit,
torchtitan's model config tree and its LoRA converter (no trainable tensor for a list that
matches nothing), and the shapes of a real adapter's tensors.
"""

from __future__ import annotations

import os

import pytest

from core.errors import ConfigError
from posttrain.adapter_checks import resume_problem
from recipe.loader import check_recipe, load_recipe
from recipe.model_checks import model_linear_names
from recipe.schema import LORA_TARGETS, MAX_ADAPTER_NAME
from tools.reliability_report import record_case

SFT = "recipes/sft_debug.toml"


def adapters(name: str = "a", **kw) -> str:
    extra = "".join(f", {k}={v}" for k, v in kw.items())
    return f'adapters=[{{name="{name}", source="x.jsonl"{extra}}}]'


def refused(overrides: list[str], key: str, *needles: str, kind: str, model: bool = False):
    with pytest.raises(ConfigError) as e:
        r = load_recipe(SFT, ["finetune.mode=lora", *overrides])
        if model:
            check_recipe(r, 1)
    msg = str(e.value)
    assert e.value.key == key and "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    record_case("adapter jobs", kind)
    return msg


def test_adapter_names_are_folder_names(tmp_path):
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    with pytest.raises(OSError):  # the failure the recipe used to reach, at the first save
        (tmp_path / ("a" * 300)).mkdir()
    refused([adapters("a" * 300)], "adapters[0].name", "at most 128", kind="name too long")
    refused([adapters("é" * 100)], "adapters[0].name", "ASCII", kind="name not ASCII")
    refused([adapters("a/b")], "adapters[0].name", "ASCII letters", kind="name with a slash")
    ok = "a" * MAX_ADAPTER_NAME
    assert load_recipe(SFT, ["finetune.mode=lora", adapters(ok)]).adapters[0].name == ok
    assert MAX_ADAPTER_NAME + len("step-2147483647") < name_max
    (tmp_path / ok).mkdir()  # the longest accepted name is a folder name


def test_adapter_warmup_above_steps_is_refused_as_in_training():
    with pytest.raises(ConfigError, match="warmup_steps"):  # the [training] rule, for reference
        load_recipe(SFT, ["training.steps=2", "training.warmup_steps=3"])
    refused([adapters(steps=2, warmup_steps=3)], "adapters[0].warmup_steps",
            "warmup_steps (3) exceeds steps (2)", kind="warmup above steps")  # fmt: skip


def test_lora_targets_are_torchtitans_linear_names():
    """Every known target is a Linear of some model and every Linear of every model is known
    (reference: torchtitan's config trees of both families, small and large flavors)."""
    seen: set[str] = set()
    for family, flavor in (("llama3", "debugmodel"), ("llama3", "8B"), ("qwen3", "debugmodel"),
                           ("qwen3", "0.6B")):  # fmt: skip
        names = model_linear_names(family, flavor)
        assert names <= set(LORA_TARGETS), names - set(LORA_TARGETS)
        seen |= names
    assert {"wqkv", "wo", "w1", "w2", "w3", "lm_head"} <= seen


def test_unknown_or_absent_lora_targets_are_refused():
    refused(['lora.target_modules=["wqkv", "w4"]'], "lora.target_modules", "unknown module 'w4'",
            kind="unknown target module")  # fmt: skip
    refused(['lora.target_modules=["attention"]'], "lora.target_modules", "known: wqkv",
            kind="unknown target module")  # fmt: skip
    refused(['lora.target_modules=["wq", "wkv"]'], "lora.target_modules",
            "name no Linear layer of llama3 debugmodel", kind="targets absent from the model",
            model=True)  # fmt: skip


def test_absent_targets_train_nothing_in_torchtitan():
    """Why the model-level check: torchtitan's converter with targets the model lacks makes
    no trainable tensor (it only warns), so the optimizer would get an empty list."""
    import torch
    from torchtitan.components.lora import LoRAConverter

    from core.models import model_config

    cfg = LoRAConverter(LoRAConverter.Config(rank=2, target_modules=["wq"])).convert(
        model_config("debugmodel", "llama3")
    )
    with torch.device("meta"):
        model = cfg.build()
    assert not [n for n, p in model.named_parameters() if p.requires_grad]


SHAPES = {
    "layers.0.attention.wqkv.lora_a.weight": (8, 256),
    "layers.0.attention.wqkv.lora_b.weight": (768, 8),
    "layers.0.feed_forward.w1.lora_a.weight": (8, 256),
    "layers.0.feed_forward.w1.lora_b.weight": (512, 8),
}
DATA = {"source": "jsonl:a.jsonl (1 file)", "seq_len": 64, "packing": "bfd", "window": 256,
        "vocab_size": 2048, "format": "sft:embedded:truncate=False", "text_field": "text"}  # fmt: skip


def problem(saved_shapes=SHAPES, shapes=SHAPES, saved_data=DATA, data=DATA):
    return resume_problem(adapter="a", index=1, checkpoint="out/adapters/a/step-2",
                          saved_shapes=saved_shapes, shapes=shapes, saved_data=saved_data,
                          data=data)  # fmt: skip


def test_resume_problems_name_the_changed_key():
    assert problem() is None
    rank16 = {k: tuple(16 if d == 8 else d for d in s) for k, s in SHAPES.items()}
    key, msg = problem(shapes=rank16)
    assert key == "lora.rank" and "lora.rank = 8, the recipe has 16" in msg
    fewer = {k: s for k, s in SHAPES.items() if "w1" not in k}
    assert problem(shapes=fewer)[0] == "lora.target_modules"
    swapped = {**DATA, "source": "jsonl:b.jsonl (1 file)"}
    key, msg = problem(data=swapped)
    assert key == "adapters[1].source" and "a.jsonl" in msg and "b.jsonl" in msg
    assert problem(data={**DATA, "seq_len": 128})[0] == "training.seq_len"
    wider = {k: tuple(512 if d == 256 else d for d in s) for k, s in SHAPES.items()}
    assert problem(shapes=wider)[0] == "model.flavor"
    record_case("adapter jobs", "resume of another adapter (pure check)", n=5)
