"""Numeric extremes of every recipe value through train.py: refused in one line, or run.

Every numeric field of the recipe (found by walking the dataclasses, [[adapters]] and
[[data.sources]] entries included, so a new field is covered without editing this file) is
set to 0, -1, 1 and 2^62 (integers) or 0, -1, 1, 2^62, 1e308, +-inf, nan, 5e-324 and 1e-300
(floats), in the context that makes it matter ([rl] enabled for rl.*, LoRA SFT for lora.* /
finetune.* / adapters, validation and profiling on for theirs). Each case either

- ends in a ConfigError naming that key (one line) at load or in the cross-section checks,
  before any process group; a sample also goes through `train.main` in-process (exit 2,
  one stderr line); or
- is accepted: then it must appear in one of the PROOF runs below, which train with those
  values for a step or two through `train.main` and must finish (exit 0, finite loss where
  the values allow learning). An accepted value that no proof run covers fails the test:
  either refuse it or run it (and list it in docs/reliability.md, section 1).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest
import tomllib

import runtime.session  # noqa: F401  (torch's import-time warnings at collection, not in capsys)
from core.errors import ConfigError
from recipe.limits import numeric_values
from recipe.loader import blamed, check_recipe, load_recipe
from recipe.schema import AdapterSection, DataSourceEntry, Recipe
from tools.reliability_report import record_case

INTS = [0, -1, 1, 2**62]
FLOATS = [0.0, -1.0, 1.0, 2.0**62, 1e308, math.inf, -math.inf, math.nan, 5e-324, 1e-300]
SFT_DATA = "data/tasks/letter_sort/train.jsonl"
SFT = [
    "finetune.mode=lora",
    "data.format=sft",
    f"data.source={SFT_DATA}",
    "data.packing=bfd",
    "finetune.export_merged=false",
]
CONTEXT = {  # section -> overrides that make its values matter
    "rl": ["rl.enabled=true"],
    "lora": SFT,
    "finetune": SFT,
    "adapters": ["finetune.mode=lora"],
    "validation": ["validation.enable=true"],
    "profiling": ["profiling.trace=true", "profiling.every=100"],
}


def lit(v: Any) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def numeric_fields() -> list[tuple[str, type]]:
    template = Recipe()
    template.adapters = [AdapterSection(name="a", source=SFT_DATA)]
    template.data.sources = [DataSourceEntry(source="stdlib")]
    return [(k, tp) for k, tp, _ in numeric_values(template)]


def overrides_for(key: str, value: Any) -> list[str]:
    section = key.split(".")[0].split("[")[0]
    ctx = list(CONTEXT.get(section, []))
    if key.startswith("adapters[0]."):
        field = key.split("].", 1)[1]
        return [*ctx, f'adapters=[{{name="a", source="{SFT_DATA}", {field}={lit(value)}}}]']
    if key.startswith("data.sources[0]."):
        field = key.split("].", 1)[1]
        return [
            *ctx,
            f'data.sources=[{{source="stdlib", {field}={lit(value)}}}, {{source="stdlib"}}]',
        ]
    if key == "profiling.every":
        ctx = ["profiling.trace=true", "profiling.warmup=0"]
    if key == "training.steps":
        ctx = ["training.warmup_steps=0"]  # else warmup_steps (2) > steps names warmup_steps
    return [*ctx, f"{key}={lit(value)}"]


def cases() -> list[tuple[str, Any, list[str]]]:
    out = []
    for key, tp in numeric_fields():
        for v in INTS if tp is int else FLOATS:
            out.append((key, v, overrides_for(key, v)))
    return out


def outcome(overrides: list[str]) -> ConfigError | None:
    """What train.py's checks before the process group say (load, cross-section checks,
    data sources and their mix)."""
    from runtime.session import check_data_source

    try:
        recipe = load_recipe(None, overrides)
        with blamed(recipe):
            check_recipe(recipe, 1)
            check_data_source(recipe)
    except ConfigError as e:
        return e
    return None


# Accepted extremes are trained here (each run 1-2 steps, a 1-2 layer slice of the debug
# model). Values a proof run sets count as covered; the classes below let 1e-300 stand for
# 5e-324 and 1e308 for 2^62 (the same code paths).
PRETRAIN_MIN = [
    "training.seq_len=8", "training.local_batch_size=1", "training.steps=1",
    "training.warmup_steps=0", "training.lr=5e-324", "training.min_lr_ratio=5e-324",
    "training.decay_ratio=5e-324", "training.weight_decay=1.0", "training.max_norm=1e308",
    "training.seed=-1", "model.layers=1", "model.vocab_size=0", "metrics.summary_skip_steps=0",
    "job.collective_timeout_s=1", "job.init_timeout_s=0", "data.packing=bfd", "data.window=1",
    "checkpoint.interval=1", "checkpoint.keep_latest=0", "metrics.log_every=1",
    "parallel.world_size=0", "parallel.pp_microbatches=0", "parallel.pp_stages_per_rank=0",
    "profiling.warmup=0", "profiling.memory_snapshot_every=0", "validation.every=1",
    "validation.steps=1", "training.global_batch_size=-1", "parallel.dp_shard=-1",
]  # fmt: skip
PRETRAIN_MAX = [
    "training.seq_len=64", "training.steps=2", "training.warmup_steps=1", "training.lr=1.0",
    "training.weight_decay=5e-324", "training.max_norm=5e-324", "training.seed=1",
    "training.min_lr_ratio=1.0", "training.decay_ratio=1.0", "model.layers=1",
    "data.packing=none", "parallel.world_size=1", "parallel.pp_microbatches=1",
    "parallel.pp_stages_per_rank=1", "parallel.dp_shard=1", "parallel.dp_replicate=1",
    "parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "metrics.summary_skip_steps=1",
    "checkpoint.interval=0", "profiling.warmup=1", "profiling.memory_snapshot_every=1",
    "job.collective_timeout_s=1", "validation.enable=true",
    "validation.every=1", "validation.steps=1", "training.local_batch_size=1",
    "profiling.every=1", "data.mix_window=1", "data.window=1", "metrics.log_every=1",
    # straggler detection at its extremes; [fault_tolerance] values are read only when
    # enabled (train.py refuses enabled = true: docs/fault_tolerance.md), inert here
    "metrics.straggler_ratio=0.0", "metrics.straggler_steps=1",
    "fault_tolerance.replica_groups=1", "fault_tolerance.quorum_timeout_s=1",
    "fault_tolerance.sync_steps=1",
]  # fmt: skip
RL_COMMON = [
    "rl.enabled=true", "training.steps=1", "rl.prompts_per_step=1", "rl.group_size=2",
    "rl.max_new_tokens=1", "rl.eval_every=1", "model.layers=1", "training.seq_len=64",
    "training.warmup_steps=0", "rl.sft_warmup_steps=1",
]  # fmt: skip
RL = [
    *RL_COMMON, "rl.temperature=1e-6", "rl.top_p=1e-6", "rl.clip_low=1.0", "rl.clip_high=1e6",
    "rl.kl_coef=5e-324", "rl.tis_cap=1e6", "rl.max_policy_lag=0", "rl.sft_warmup_lr=5e-324",
    "rl.eval_prompts=1", "rl.seed=-1", "rl.hook_timeout_s=0",
]  # fmt: skip
RL_MAX = [
    *RL_COMMON, "rl.temperature=1e6", "rl.clip_low=0.0", "rl.clip_high=5e-324", "rl.kl_coef=1.0",
    "rl.tis_cap=5e-324", "rl.sft_warmup_lr=1.0", "rl.eval_prompts=0", "rl.seed=0",
    "rl.hook_timeout_s=1",
]  # fmt: skip
RL_MID = [
    *RL_COMMON, "rl.clip_low=5e-324", "rl.clip_high=1.0", "rl.tis_cap=1.0", "rl.seed=1",
    "rl.sft_warmup_steps=0", "training.microbatch_tokens=1",  # one row per microbatch
]  # fmt: skip
SFT_RUN = [
    *SFT, "training.steps=1", "training.warmup_steps=0", "training.seq_len=64", "model.layers=1",
    "lora.rank=1", "lora.alpha=5e-324", "finetune.eval_every=1", "lora.dropout=0.0",
    "training.local_batch_size=1", "training.weight_decay=0.0", "training.seed=0",
    "checkpoint.load_from=", "data.eval_source=", "training.global_batch_size=1",
]  # fmt: skip
ADAPTERS_RUN = [
    *SFT_RUN, "lora.alpha=1.0",
    f'adapters=[{{name="a", source="{SFT_DATA}", lr=5e-324, seed=-1, steps=1}}, '
    f'{{name="b", source="{SFT_DATA}", lr=1.0, seed=1, steps=2, warmup_steps=1, '
    "local_batch_size=1}]",
]  # fmt: skip
PROOF = {
    "pretrain_min": (None, PRETRAIN_MIN),
    "pretrain_max": (None, PRETRAIN_MAX),
    "rl_min": ("recipes/rl_debug.toml", RL),
    "rl_max": ("recipes/rl_debug.toml", RL_MAX),
    "rl_mid": ("recipes/rl_debug.toml", RL_MID),
    # rl.max_turns matters only in a multi-turn environment: one model turn per episode.
    "rl_multiturn": ("recipes/rl_multiturn_debug.toml", [*RL_COMMON, "rl.max_turns=1"]),
    "sft": ("recipes/sft_debug.toml", SFT_RUN),
    "adapters": ("recipes/sft_debug.toml", ADAPTERS_RUN),
}
# Accepted values that need a condition no 1-step CPU run can show, with the reason (docs).
NOT_RUN = {
    ("job.init_timeout_s", 1): "a 1 s first-step deadline: a slower start ends the job "
    "with the watchdog's message (section 4), as documented",
}


def value_class(v: Any) -> Any:
    if abs(v) < 1e-200:
        return "zero or tiny"  # 0 and 5e-324 / 1e-300: one class (both at the bottom)
    if isinstance(v, (int, float)) and v > 2**61:
        return "huge"
    return float(v)


def _value(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return None


def covered() -> set[tuple[str, Any]]:
    """(key, value class) each proof run trains with (the last override of a key wins),
    plus the schema defaults (every shipped training test runs them)."""
    out: set[tuple[str, Any]] = set()
    for _recipe, ovs in PROOF.values():
        final: dict[str, Any] = {}
        for o in ovs:
            k, _, v = o.partition("=")
            if k == "adapters":
                for entry in tomllib.loads(f"v = {v}")["v"]:
                    for ak, av in entry.items():
                        if isinstance(av, (int, float)):
                            out.add((f"adapters.{ak}", value_class(av)))
            elif _value(v) is not None:
                final[k] = _value(v)
        out |= {(k, value_class(v)) for k, v in final.items()}
    template = Recipe()
    template.adapters = [AdapterSection(name="a", source=SFT_DATA)]
    template.data.sources = [DataSourceEntry(source="stdlib")]
    for k, _tp, v in numeric_values(template):
        out.add((k.replace("[0]", ""), value_class(v)))
    return out


ALL = cases()
# Cross-key refusals: the value is legal alone, the pair is not (the message shows both).
ALSO_NAMED = {"data.sources[0].weight": "data.mix_window"}


def test_every_numeric_field_is_refused_or_proven():
    """The enumeration: a ConfigError naming the key, or covered by a proof run."""
    proven = covered()
    missing, wrong = [], []
    for key, v, ovs in ALL:
        err = outcome(ovs)
        if err is None:
            plain = key.replace("[0]", "")
            ok = (plain, value_class(v)) in proven or (key, v) in NOT_RUN
            if not ok:
                missing.append(f"{key}={lit(v)}")
            else:
                record_case("train.py", "numeric extreme (valid)")
            continue
        msg = str(err)
        named = err.key in (key, ALSO_NAMED.get(key))
        if not named or "\n" in msg:
            wrong.append(f"{key}={lit(v)} -> {msg}")
        else:
            record_case("train.py", "numeric extreme")
    assert not wrong, "errors not naming the key:\n" + "\n".join(wrong)
    assert not missing, "accepted but not run by any proof run:\n" + "\n".join(missing)
    assert len(ALL) > 300  # 332 with the schema of 2026-12


@pytest.fixture
def env():
    saved = dict(os.environ)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_refused_extremes_through_train_main(env, tmp_path, capsys):
    """A sample of the refused cases as `train.main` runs: exit 2, one stderr line, the key."""
    import train

    refused = [(k, v, o) for k, v, o in ALL if outcome(o) is not None]
    for key, v, ovs in refused[::12]:
        capsys.readouterr()
        argv = ["--set", f"job.output_dir={tmp_path / 'out'}"]
        for o in ovs:
            argv += ["--set", o]
        with pytest.raises(SystemExit) as ex:
            train.main(argv)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert ex.value.code == 2 and len(lines) == 1, (key, v, err[-2000:])
        assert lines[0].startswith("error: "), lines[0]
        if key not in ALSO_NAMED:  # a value given with --set is blamed on --set
            assert lines[0].startswith("error: --set ") and key.split("[")[0] in lines[0], lines[0]
        record_case("train.py", "numeric extreme")
    os.environ.pop("WORLD_SIZE", None)


@pytest.mark.parametrize("name", sorted(PROOF))
def test_accepted_extremes_train(name, env, tmp_path):
    """The accepted extremes train: exit 0, the steps logged."""
    import train

    recipe, ovs = PROOF[name]
    out = tmp_path / name
    argv = ["--set", f"job.output_dir={out}", "--set", "metrics.tensorboard=false"]
    if recipe:
        argv = ["--recipe", recipe, *argv]
    for o in ovs:
        argv += ["--set", o]
    train.main(argv)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "loss" in r]
    assert steps, rows[-3:]
    record_case("train.py", "numeric extreme (valid)")


@pytest.mark.parametrize(
    "recipe, sections",
    [
        ("recipes/sft_debug.toml", ("training", "data", "finetune", "lora")),
        ("recipes/rl_debug.toml", ("training", "rl")),
    ],
)
def test_post_training_recipes_extremes(recipe, sections):
    """The same extremes over the post-training recipes' own sections (their values as the
    context): refused naming the key, or a value class the proof runs train."""
    from runtime.session import check_data_source

    proven = covered()
    missing, wrong = [], []
    for key, tp in numeric_fields():
        if key.split(".")[0] not in sections or "[" in key:
            continue
        for v in INTS if tp is int else FLOATS:
            ctx = ["training.warmup_steps=0"] if key == "training.steps" else []
            try:
                r = load_recipe(recipe, [*ctx, f"{key}={lit(v)}"])
                with blamed(r):
                    check_recipe(r, 1)
                    if key.startswith("data."):  # reads the data file: only where it matters
                        check_data_source(r)
            except ConfigError as e:
                if e.key not in (key, ALSO_NAMED.get(key)) or "\n" in str(e):
                    wrong.append(f"{key}={lit(v)} -> {e}")
                else:
                    record_case("train.py", "numeric extreme")
                continue
            if (key, value_class(v)) not in proven:
                missing.append(f"{key}={lit(v)}")
            else:
                record_case("train.py", "numeric extreme (valid)")
    assert not wrong, "\n".join(wrong)
    assert not missing, "\n".join(missing)
