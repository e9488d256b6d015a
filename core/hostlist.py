"""Slurm's hostlist syntax ("gpu[001-003,7],cpu1"): used by cluster profiles (switch lists)
and by the launcher (SLURM_JOB_NODELIST, `scontrol show topology`). Pure; no Slurm calls.
"""

from __future__ import annotations

import re

from core.hardware import MAX_NODES
from core.typed_toml import show

_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """'leaf10' after 'leaf9': digit runs compare as numbers, the rest as text."""
    parts = _DIGITS.split(text)
    return tuple((1, int(p)) if p.isdigit() else (0, p) for p in parts if p != "")


def expand_hostlist(expr: str, limit: int = MAX_NODES) -> list[str]:
    """Expand a Slurm hostlist ("gpu[001-003,7],cpu1") in order; ValueError on bad syntax or
    on more than `limit` names ("n[0-99999999999]" would otherwise fill memory)."""
    expr = expr.strip()
    if not expr:
        return []
    parts: list[str] = []
    depth = 0
    cur = ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {show(expr)}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {show(expr)}")
    parts.append(cur)
    out: list[str] = []
    try:
        for part in parts:
            part = part.strip()
            if part:
                out.extend(_expand_one(part, expr, limit - len(out)))
    except _TooMany:
        raise ValueError(f"hostlist {show(expr)} names more than {limit:,} hosts") from None
    return out


class _TooMany(Exception):
    pass


def _expand_one(part: str, whole: str, limit: int) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", part)
    if limit < 1:
        raise _TooMany
    if not m:
        return [part]
    head, tail = part[: m.start()], part[m.end() :]
    values: list[str] = []
    for rng in m.group(1).split(","):
        rng = rng.strip()
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            # Digits only, and short: a 5000-digit bound is a typo (and past int()'s limit).
            if not (lo.isdigit() and hi.isdigit()) or max(len(lo), len(hi)) > 18:
                raise ValueError(f"bad range {show(rng)} in hostlist {show(whole)}")
            if int(hi) < int(lo):
                raise ValueError(f"bad range {show(rng)} in hostlist {show(whole)}")
            if int(hi) - int(lo) + 1 + len(values) > limit:
                raise _TooMany
            width = len(lo) if lo.startswith("0") else 0
            values.extend(f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        elif rng.isdigit():
            values.append(rng)
        else:
            raise ValueError(f"bad entry {show(rng)} in hostlist {show(whole)}")
        if len(values) > limit:
            raise _TooMany
    out: list[str] = []
    for v in values:
        out.extend(_expand_one(head + v + tail, whole, limit - len(out)))
    return out
