"""`[torchtitan]`: dotted keys applied last to torchtitan's own config objects.

The escape hatch for torchtitan options without a titanscale key. Each key is resolved on
the Trainer.Config that runtime.build produced (so titanscale's subclasses, e.g. the
checkpoint manager's config, are what is checked), typed by the dataclass annotations with
the recipe loader's own checks, and set; each touched config's `__post_init__` runs again,
and the root's last, so torchtitan's own validation sees the final values. Every error is a
ConfigError naming `torchtitan.<key>` (exit 2, before any process group).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from core.errors import ConfigError, did_you_mean
from core.typed_toml import coerce, show


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'training': {'gc_freq': 5}} and {'training.gc_freq': 5} -> {'training.gc_freq': 5}."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _hints(obj: Any) -> dict[str, Any]:
    cls = type(obj)
    names = [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]
    hints = typing.get_type_hints(cls)
    return {n: hints.get(n, Any) for n in names}


def apply_overrides(config: Any, table: dict[str, Any], *, file: str) -> list[str]:
    """Apply `[torchtitan]` to `config` (a Trainer.Config); returns 'key = value' lines."""
    applied: list[str] = []
    touched: list[Any] = []
    for dotted, value in flatten(table).items():
        key = f"torchtitan.{dotted}"
        obj = config
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            fields = _hints(obj)
            where = type(obj).__qualname__
            if part not in fields:
                raise ConfigError(
                    f"{where} has no field {part!r}{did_you_mean(part, fields)}; "
                    f"fields: {', '.join(sorted(fields))}",
                    file=file,
                    key=key,
                )
            if i < len(parts) - 1:
                obj = getattr(obj, part)
                if not dataclasses.is_dataclass(obj):
                    raise ConfigError(
                        f"{where}.{part} is not a config section (a {type(obj).__name__})",
                        file=file,
                        key=key,
                    )
                continue
            try:
                checked = coerce(value, fields[part], file=file, key=key)
            except TypeError:  # a type the recipe layer cannot express (callables, specs)
                raise ConfigError(
                    f"{where}.{part} ({show(fields[part])}) cannot be set from a recipe",
                    file=file,
                    key=key,
                ) from None
            old = getattr(obj, part)
            setattr(obj, part, checked)
            applied.append(f"{dotted} = {checked!r} (was {old!r})")
            if obj is not config and all(obj is not t for t in touched):
                touched.append(obj)
    for obj in [*touched, config] if applied else []:
        post = getattr(type(obj), "__post_init__", None)
        if post is None:
            continue
        try:
            post(obj)
        except (ValueError, AssertionError, TypeError) as e:
            raise ConfigError(
                f"torchtitan refuses the overridden {type(obj).__qualname__}: {e}",
                file=file,
                key="torchtitan",
            ) from None
    return applied
