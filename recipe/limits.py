"""Numeric limits of every recipe value, beyond each field's own range check (schema.py).

The schema checks signs and ranges one field at a time; these are the extremes that pass
them but break later, inside torch or the data path, or train silently to nonsense:

- every integer (each section, each [[adapters]] / [[data.sources]] entry) at most
  INT_LIMIT = 2^31 - 1: step and sample counters, sizes and token counts are int32 in
  places (token ids, packing offsets, kernel indices), and timeouts become C++ timedeltas
  (2^62 s overflows them). No real run comes near it (2^31 steps, sequences or seconds);
- `training.local_batch_size x training.seq_len` (tokens in one microbatch) at most
  INT_LIMIT: one tensor's elements, indexed with int32 by attention kernels;
- learning rates (`training.lr`, `rl.sft_warmup_lr`, `adapters[i].lr`) at most 1: AdamW moves
  each weight by about lr per step, so above 1 one step replaces the weights with noise
  (and 1e308 makes them inf, then every loss NaN);
- `training.lr x training.weight_decay` below 1: AdamW multiplies each weight by
  1 - lr x weight_decay every step, so at 1 or more the weights are zeroed or flip sign;
- `rl.temperature` in [1e-6, 1e6]: the generator divides float32 logits by it (5e-324 makes
  them inf, 1e308 becomes inf in float32: NaN probabilities either way); beyond the range
  sampling is already greedy or uniform to float32 precision;
- `rl.top_p` at least 1e-6: compared with float32 probabilities (5e-324 rounds to 0 and
  drops every token, so no sample can be drawn); tiny values keep the top token only;
- `rl.group_size` at least 2 with `[rl] enabled`: advantages are normalised per group, and
  a group of one has advantage 0 (nothing is learned, the loss is NaN);
- `rl.clip_low` at most 1: the ratio is clipped below at 1 - clip_low, and a ratio is never
  negative (1 = no lower clip);
- `rl.clip_high` and `rl.tis_cap` at most 1e6: they clamp float32 ratios (1e308 overflows
  the clamp); anything larger is no bound;
- `rl.kl_coef` and the LoRA scale `lora.alpha / lora.rank` at most 1e6: float32 keeps about
  7 significant digits, so a term weighted 1e7 times more than the rest swamps it in rounding.

`check_limits(recipe)` is pure Python (no torch): recipe.loader runs it at load, before
train.py imports torch. Each failure is one ConfigError naming the key and the limit.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from typing import Any

from core.errors import ConfigError

INT_LIMIT = 2**31 - 1
MAX_LR = 1.0
MIN_TEMPERATURE = 1e-6
MAX_COEF = 1e6


def numeric_values(obj: Any, prefix: str = "") -> Iterator[tuple[str, type, Any]]:
    """(dotted key, int or float, value) for every numeric field of a recipe dataclass,
    sections and arrays of tables ([[adapters]] -> adapters[i].lr) expanded."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        value, tp = getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            yield from numeric_values(value, key)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                yield from numeric_values(item, f"{key}[{i}]")
        elif tp in (int, float):
            yield key, tp, value


def check_limits(recipe: Any) -> None:
    """Raise ConfigError for the first value outside the limits above (module docstring)."""
    f = recipe.source
    for key, tp, value in numeric_values(recipe):
        if tp is int and abs(value) > INT_LIMIT:
            raise ConfigError(
                f"{value} is out of range: at most {INT_LIMIT} (2^31 - 1; counts, sizes and "
                "timeouts are 32-bit in torch and the data path)",
                file=f,
                key=key,
            )
        if key.endswith("lr") and value > MAX_LR:
            raise ConfigError(
                f"{value} is above {MAX_LR}: AdamW moves each weight by about lr per step, so "
                "one step would replace the weights with noise",
                file=f,
                key=key,
            )
    tr = recipe.training
    if tr.local_batch_size * tr.seq_len > INT_LIMIT:
        raise ConfigError(
            f"local_batch_size x seq_len = {tr.local_batch_size * tr.seq_len} tokens in one "
            f"microbatch; at most {INT_LIMIT} (one tensor, indexed with int32 by kernels)",
            file=f,
            key="training.local_batch_size",
        )
    if tr.lr * tr.weight_decay >= 1:
        raise ConfigError(
            f"lr x weight_decay = {tr.lr * tr.weight_decay:.3g}: AdamW multiplies each weight "
            "by 1 - lr x weight_decay every step, which must stay above 0",
            file=f,
            key="training.weight_decay",
        )
    rl = recipe.rl
    if rl.temperature > MAX_COEF:
        raise ConfigError(
            f"{rl.temperature} is above {MAX_COEF:g}: sampling is already uniform to float32 "
            "precision, and above float32's range (3.4e38) the divisor becomes inf and the "
            "probabilities NaN",
            file=f,
            key="rl.temperature",
        )
    if rl.temperature < MIN_TEMPERATURE:
        raise ConfigError(
            f"{rl.temperature} is below {MIN_TEMPERATURE}: the generator divides float32 "
            "logits by it (they overflow); use a small value such as 1e-3 for near-greedy",
            file=f,
            key="rl.temperature",
        )
    if rl.top_p < MIN_TEMPERATURE:
        raise ConfigError(
            f"{rl.top_p} is below {MIN_TEMPERATURE}: the generator compares it with float32 "
            "probabilities (below 1.4e-45 it rounds to 0 and drops every token); any value "
            "this small keeps only the most likely token",
            file=f,
            key="rl.top_p",
        )
    if rl.enabled and rl.group_size < 2:
        raise ConfigError(
            "a group of 1 sample has advantage 0 (its reward minus its own mean): nothing "
            "is learned; use at least 2",
            file=f,
            key="rl.group_size",
        )
    if rl.clip_low > 1:
        raise ConfigError(
            f"{rl.clip_low} is above 1: the ratio is clipped below at 1 - clip_low and is "
            "never negative (1 = no lower clip)",
            file=f,
            key="rl.clip_low",
        )
    if rl.kl_coef > MAX_COEF:
        raise ConfigError(
            f"{rl.kl_coef} is above {MAX_COEF:g}: float32 keeps about 7 digits, so the policy "
            "loss would vanish in rounding next to the KL term",
            file=f,
            key="rl.kl_coef",
        )
    for name in ("clip_high", "tis_cap"):
        if getattr(rl, name) > MAX_COEF:
            raise ConfigError(
                f"{getattr(rl, name)} is above {MAX_COEF:g}: it bounds float32 ratios (which "
                "overflow past 3.4e38), and any value this large is no bound at all",
                file=f,
                key=f"rl.{name}",
            )
    if recipe.lora.alpha / recipe.lora.rank > MAX_COEF:
        raise ConfigError(
            f"the LoRA scale alpha / rank = {recipe.lora.alpha / recipe.lora.rank:.3g} is above "
            f"{MAX_COEF:g}: float32 keeps about 7 digits, so the adapter would swamp the base "
            "model's outputs in rounding",
            file=f,
            key="lora.alpha",
        )


# The per-key limits above as docs/recipes.md shows them (tools.gen_docs): dotted key (an
# array of tables as `adapters[].lr`) -> (settings that check_limits refuses naming that key,
# what is refused). tests/unit/test_gen_docs.py applies each setting and checks the refusal.
DOCUMENTED_LIMITS: dict[str, tuple[dict[str, Any], str]] = {
    "training.lr": ({"training.lr": 1.5}, f"> {MAX_LR:g}"),
    "training.weight_decay": (
        {"training.lr": 1e-2, "training.weight_decay": 100.0},
        "lr x weight_decay ≥ 1",
    ),
    "rl.sft_warmup_lr": ({"rl.sft_warmup_lr": 1.5}, f"> {MAX_LR:g}"),
    "adapters[].lr": ({"adapters[].lr": 1.5}, f"> {MAX_LR:g}"),
    "rl.temperature": ({"rl.temperature": 1e-7}, f"< {MIN_TEMPERATURE:g} or > {MAX_COEF:g}"),
    "rl.top_p": ({"rl.top_p": 1e-7}, f"< {MIN_TEMPERATURE:g}"),
    "rl.group_size": ({"rl.enabled": True, "rl.group_size": 1}, "< 2 with [rl] enabled"),
    "rl.clip_low": ({"rl.clip_low": 1.5}, "> 1"),
    "rl.clip_high": ({"rl.clip_high": 2e6}, f"> {MAX_COEF:g}"),
    "rl.tis_cap": ({"rl.tis_cap": 2e6}, f"> {MAX_COEF:g}"),
    "rl.kl_coef": ({"rl.kl_coef": 2e6}, f"> {MAX_COEF:g}"),
    "lora.alpha": ({"lora.alpha": 2e7, "lora.rank": 8}, f"alpha / rank > {MAX_COEF:g}"),
}
