"""Slurm's hostlist syntax ("gpu[001-003,7],cpu1"): used by cluster profiles (switch lists)
and by the launcher (SLURM_JOB_NODELIST, `scontrol show topology`). Pure; no Slurm calls.
"""

from __future__ import annotations

import re

from core.hardware import MAX_NODES
from core.typed_toml import show

_DIGITS = re.compile(r"(\d+)")
# More hosts than any cluster has (the largest are ~25k nodes): "n[1-10000000]" is refused
# before it is expanded, not planned for minutes.
MAX_HOSTS = MAX_NODES
# Host names end up in the job's node-order file (read by `head` and `grep -x`): plain names.
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}")


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """'leaf10' after 'leaf9': digit runs compare as numbers, the rest as text."""
    parts = _DIGITS.split(text)
    return tuple((1, int(p)) if p.isdigit() else (0, p) for p in parts if p != "")


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist ("gpu[001-003,7],cpu1") in order; ValueError on bad syntax,
    a host name that is not a plain name, or more than MAX_HOSTS hosts."""
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
                raise ValueError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append(cur)
    out: list[str] = []
    for part in parts:
        part = part.strip()
        if part:
            out.extend(_expand_one(part, expr, MAX_HOSTS - len(out)))
    for name in out:
        if not _HOST.fullmatch(name):
            raise ValueError(
                f"bad host name {name!r} in hostlist {expr!r} (letters, digits, '_', '.', '-')"
            )
    return out


def _count(values: str) -> int:
    """Hosts one bracket ("001-003,7") stands for, without expanding it."""
    n = 0
    for rng in values.split(","):
        lo, _, hi = rng.strip().partition("-")
        # 4300+ digit numbers: int() would raise; a long number is too many hosts anyway.
        if len(hi) > 18 or len(lo) > 18:
            return MAX_HOSTS + 1
        n += int(hi) - int(lo) + 1 if hi.isdigit() and lo.isdigit() else 1
    return n


def _expand_one(part: str, whole: str, room: int = MAX_HOSTS) -> list[str]:
    total = 1
    for br in re.findall(r"\[([^\[\]]*)\]", part):
        total *= max(_count(br), 1)
        if total > room:
            raise ValueError(f"hostlist {show(whole)} names more than {MAX_HOSTS:,} hosts")
    m = re.search(r"\[([^\[\]]*)\]", part)
    if not m:
        return [part]
    head, tail = part[: m.start()], part[m.end() :]
    values: list[str] = []
    for rng in m.group(1).split(","):
        rng = rng.strip()
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad range {rng!r} in hostlist {whole!r}")
            width = len(lo) if lo.startswith("0") else 0
            values.extend(f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        elif rng.isdigit():
            values.append(rng)
        else:
            raise ValueError(f"bad entry {rng!r} in hostlist {whole!r}")
    out = []
    for v in values:
        out.extend(_expand_one(head + v + tail, whole))
    return out
