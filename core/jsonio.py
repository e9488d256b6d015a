"""JSON read from files the project does not control (checkpoint metadata, manifests, run
records): `loads` bounds the nesting depth, so a damaged or hostile file is a ValueError
naming the depth, never a RecursionError from deep inside the parser (issue #41);
`loads_line` does the same for line-oriented readers (datasets, logs, refused bodies) at
no cost to the lines that parse.

The depth is counted before parsing by one pass over the brackets outside strings
(`nesting_depth`, C-speed through `re`), then `json.loads` parses a document known to be
shallow enough.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 200  # far beyond any file the project writes (meta.json: 3 levels)

# A JSON string (escapes included) or one bracket: strings are skipped whole, so a bracket
# inside one is not counted.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def nesting_depth(data: bytes) -> int:
    depth = deepest = 0
    for m in _TOKENS.finditer(data):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest


def loads(data: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads`, refusing (ValueError) a document nested deeper than `max_depth`."""
    raw = data.encode() if isinstance(data, str) else data
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep (at most {max_depth} are read)")
    return json.loads(raw)


def loads_line(data: str | bytes) -> Any:
    """`json.loads` for one record of a line-oriented file or a body already refused (a
    dataset's JSONL line, a log line): a line nested past the interpreter's recursion limit
    is a ValueError, a bad line like any other malformed one, never a RecursionError. No
    pre-scan: nothing is spent on the lines that parse (readers of whole datasets)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
