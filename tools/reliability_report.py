"""Run the reliability tests and write their figures into docs/reliability.md.

    python -m tools.reliability_report            # runs tests/*/test_reliability_*.py
    python -m tools.reliability_report --no-run FIGURES.json   # render existing figures
    python -m tools.reliability_report --update FIGURES.json   # merge a partial run's cases

`--update` keeps the document's table and replaces the rows of the entry points the partial
run counted (a rerun of one area's tests), so one area's figures can be refreshed without
the whole suite; the header says which rows came from which run.

The tests call `record(name, value)` and `record_case(...)` where they measure; both are
no-ops unless TITANSCALE_RELIABILITY_FIGURES names a JSON file, so a plain `pytest` run
writes nothing. Figures are kept in the process and merged into that file once, by `flush`
(tests/conftest.py calls it at the end of the session; atexit otherwise), so no test
depends on another having run first. The figures land between the
`<!-- figures:begin -->` and `<!-- figures:end -->` markers of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV = "TITANSCALE_RELIABILITY_FIGURES"
ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"

# name -> (label, how to read it)
LABELS = {
    "recipes_fuzzed_loader": "bad recipes generated and rejected by the loader (hypothesis)",
    "recipes_through_train_main": "of which also run through `train.main` in-process (exit 2)",
    "recipes_through_train_py_subprocess": "bad recipes run as `python train.py` subprocesses",
    "recipe_fuzz_kinds": "kinds of bad recipes (count each)",
    "environment_errors": "environment errors caught before the first step",
    "checkpoint_faults": "checkpoint faults injected (crash mid-save, ENOSPC, truncation, "
    "corruption, pickle payloads)",
    "checkpoint_fallbacks": "of which recovered by falling back to the previous checkpoint",
    "faults_injected": "rank faults injected in real torchrun jobs (SIGKILL, hang)",
    "runs_recovered": "jobs that restarted and finished (torchrun --max-restarts=1)",
    "steps_recomputed": "steps recomputed after restarts (work lost since the checkpoint)",
    "steps_lost": "steps missing from the final trajectories",
    "max_loss_diff_after_restart": "largest loss difference (absolute), restarted vs uninterrupted",
    "hang_detected_in_s": "hung rank: job ended after (s), timeout 5 s",
}


@contextlib.contextmanager
def _figures() -> Iterator[dict[str, Any] | None]:
    """The figures file's content under an exclusive lock (tests run in several processes),
    written back on exit; None (nothing recorded) unless $TITANSCALE_RELIABILITY_FIGURES is set."""
    path = os.environ.get(ENV)
    if not path:
        yield None
        return
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
        yield data
        Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))


def _merge(data: dict[str, Any], name: str, value: Any) -> None:
    """Fold one figure into `data` (associative, so processes and tests merge in any order):
    `max_*` keep the largest; `*_in_s` the latest; counts add up; tables of counts add up
    per key; anything else is replaced."""
    old = data.get(name)
    if isinstance(value, (int, float)) and name.startswith("max_"):
        value = max(value, old) if isinstance(old, (int, float)) else value
    elif isinstance(value, int) and isinstance(old, int) and not name.endswith("_in_s"):
        value = old + value
    elif isinstance(value, dict) and isinstance(old, dict):
        value = {k: old.get(k, 0) + value.get(k, 0) for k in sorted({*old, *value})}
    data[name] = value


# Figures of this process not yet merged into the file (flush).
_PENDING: dict[str, Any] = {}


def record(name: str, value: Any) -> None:
    """Add a figure (merged into the JSON file named by $TITANSCALE_RELIABILITY_FIGURES at
    `flush`)."""
    if os.environ.get(ENV):
        _merge(_PENDING, name, value)


def record_case(entry: str, kind: str, *, clean: bool = True, n: int = 1) -> None:
    """Count `n` bad-input cases tried against one entry point (`train.py`, `tools.plan`,
    `tools.launch`, `checkpoint load`, ...), by kind ("hang", "traceback", "shell injection",
    ...). `clean` means the case ended as documented: one line and exit 2 (or a documented 0),
    within its time bound, no traceback, nothing lost. The report tabulates them per entry
    point; every test asserts clean before recording, so an unclean case fails the run."""
    if not os.environ.get(ENV):
        return
    cases = _PENDING.setdefault("cases", {})
    tried, ok = cases.setdefault(entry, {}).get(kind, [0, 0])
    cases[entry][kind] = [tried + n, ok + (n if clean else 0)]


def flush() -> None:
    """Merge this process's figures into the file (under its lock) and forget them."""
    if not _PENDING:
        return
    with _figures() as data:
        if data is not None:
            for name, value in _PENDING.items():
                if name != "cases":
                    _merge(data, name, value)
            cases = data.setdefault("cases", {})
            for entry, kinds in _PENDING.get("cases", {}).items():
                for kind, (tried, ok) in kinds.items():
                    t0, o0 = cases.setdefault(entry, {}).get(kind, [0, 0])
                    cases[entry][kind] = [t0 + tried, o0 + ok]
    _PENDING.clear()


atexit.register(flush)


def render_cases(cases: dict[str, dict[str, list[int]]]) -> list[str]:
    """One row per entry point: cases tried, how many clean, and the count per kind."""
    rows = ["", "| entry point | cases tried | clean | kinds (tried) |", "|---|---|---|---|"]
    total = [0, 0]
    for entry in sorted(cases):
        kinds = cases[entry]
        tried = sum(k[0] for k in kinds.values())
        ok = sum(k[1] for k in kinds.values())
        total = [total[0] + tried, total[1] + ok]
        detail = ", ".join(f"{k} {v[0]}" for k, v in sorted(kinds.items()))
        rows.append(f"| `{entry}` | {tried} | {ok} | {detail} |")
    rows.append(f"| all | {total[0]} | {total[1]} | |")
    return rows


def parse_cases(text: str) -> dict[str, dict[str, list[int]]]:
    """The per-entry-point table of a rendered figures block, back as `cases` (the inverse of
    render_cases; only fully clean rows can be parsed back exactly, and the table only ever
    holds those: every test asserts clean before it records)."""
    cases: dict[str, dict[str, list[int]]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`") or not cells[1].isdigit():
            continue
        entry = cells[0].strip("`")
        # "kind 3, other kind 5": a kind may itself hold ", " (it never ends in a number).
        kinds = {k: [int(n), int(n)] for k, n in re.findall(r"(.+?) (\d+)(?:, |$)", cells[3])}
        if sum(v[0] for v in kinds.values()) != int(cells[1]) or cells[1] != cells[2]:
            raise ValueError(f"cannot read the row of {entry!r} back: {line.strip()}")
        cases[entry] = kinds
    return cases


def update_cases(
    old: dict[str, dict[str, list[int]]], new: dict[str, dict[str, list[int]]]
) -> dict[str, dict[str, list[int]]]:
    """`old` with the rows of every entry point `new` counted replaced by `new`'s."""
    return {**old, **new}


def render(figures: dict[str, Any], meta: dict[str, str]) -> str:
    rows = ["| figure | value |", "|---|---|"]
    for name, label in LABELS.items():
        if name not in figures:
            continue
        v = figures[name]
        if isinstance(v, dict):
            v = ", ".join(f"{k} {n}" for k, n in v.items())
        elif isinstance(v, float):
            v = f"{v:.3g}"
        rows.append(f"| {label} | {v} |")
    if figures.get("cases"):
        rows += render_cases(figures["cases"])
    head = meta.get("head") or (
        f"Generated by `python -m tools.reliability_report` on {meta['date']} "
        f"({meta['machine']}; Python {meta['python']}, torch {meta['torch']}); "
        f"test run {meta['wall_s']} s, exit code {meta['rc']}."
    )
    return "\n".join([BEGIN, head, "", *rows, END])


def write_doc(block: str) -> None:
    text = DOC.read_text() if DOC.exists() else f"# Reliability\n\n{BEGIN}\n{END}\n"
    if BEGIN in text and END in text:
        pre, rest = text.split(BEGIN, 1)
        _, post = rest.split(END, 1)
        text = pre + block + post
    else:
        text += "\n" + block + "\n"
    DOC.write_text(text)


def update_doc(partial: dict[str, Any], meta: dict[str, str]) -> int:
    """Merge `partial`'s cases into docs/reliability.md's figures block (rows of the entry
    points it counted replaced; the figure table and every other row kept)."""
    text = DOC.read_text()
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    lines = block.strip().splitlines()
    head = lines[0] if lines and not lines[0].startswith("|") else ""
    skip = ("| `", "| figure ", "| entry point ", "| all ")
    figures_rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith(skip)]
    new = partial.get("cases", {})
    cases = update_cases(parse_cases(block), new)
    note = (
        f" Rows of {', '.join(f'`{e}`' for e in sorted(new))} from a run of their tests on "
        f"{meta['date']} ({meta['machine']}; Python {meta['python']}, torch {meta['torch']}; "
        "`python -m tools.reliability_report --update`)."
    )
    rows = ["| figure | value |", "|---|---|", *figures_rows] if figures_rows else []
    body = [head + note, "", *rows, *render_cases(cases)]
    write_doc("\n".join([BEGIN, *body, END]))
    print(f"updated {DOC}: {len(new)} entry points replaced")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--no-run", metavar="FIGURES_JSON", help="render existing figures only")
    p.add_argument("--update", metavar="FIGURES_JSON",
                   help="merge a partial run's cases into the document's table")  # fmt: skip
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    args = p.parse_args(argv)
    import torch

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "wall_s": "n/a",
        "rc": "n/a",
    }
    if args.update:
        return update_doc(json.loads(Path(args.update).read_text()), meta)
    if args.no_run:
        figures = json.loads(Path(args.no_run).read_text())
    else:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "figures.json")
            env = {**os.environ, ENV: path, "OMP_NUM_THREADS": "1"}
            t0 = time.time()
            tests = sorted(str(t) for t in (ROOT / "tests").rglob("test_reliability_*.py"))
            rc = subprocess.call(
                [sys.executable, "-m", "pytest", "-q", *tests, *args.pytest_args],
                cwd=ROOT,
                env=env,
            )
            meta["wall_s"], meta["rc"] = f"{time.time() - t0:.0f}", str(rc)
            figures = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    write_doc(render(figures, meta))
    print(f"wrote {DOC}")
    print(json.dumps(figures, indent=1))
    return 0 if meta["rc"] in ("0", "n/a") else 1


if __name__ == "__main__":
    from tools.cli import run

    run(main)
