"""Which optional test dependencies import, and the CI rule: a missing one fails, never skips.

Tests reach tinker, peft and transformers through `pytest.importorskip` (a developer's machine
may lack them). Under `CI=true` (`.ci/run`, GitHub Actions) a broken or missing install would
turn ~60 service tests and the PEFT/HF checks into skips and CI green, so tests/conftest.py's
`pytest_configure` refuses to start instead, naming the module and its import error.
"""

from __future__ import annotations

import importlib
import os

# What the suite imports through importorskip (grep importorskip tests/): all in pyproject.
CI_REQUIRED = ("tinker", "tinker_cookbook", "peft", "transformers", "pyarrow")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(modules: tuple[str, ...] = CI_REQUIRED) -> list[str]:
    """`module: why` for each of `modules` that does not import (any exception counts: a
    half-installed SDK raises more than ImportError)."""
    out = []
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:
            out.append(f"{m}: {type(e).__name__}: {e}")
    return out


def ci_refusal() -> str | None:
    """The one-line reason a CI run must not start (None: not CI, or everything imports)."""
    if not in_ci():
        return None
    gone = missing()
    if not gone:
        return None
    return (
        f"CI=true and {len(gone)} test dependenc{'y' if len(gone) == 1 else 'ies'} do not "
        f"import ({'; '.join(gone)}): the tests needing them would be skipped; install them "
        "(bash scripts/setup.sh) or unset CI"
    )
