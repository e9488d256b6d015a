"""Small deterministic chat tasks for CPU post-training (recipes/sft_debug.toml, tests).

letter_sort: "sort: d a c" -> "a c d" (3-5 distinct letters of a..h, space separated). Every
letter sequence goes to exactly one split by a CRC32 of its text (10% held out), so no
held-out question is ever trained on. Files are generated, not downloaded:

    python -m posttrain.tasks --out data/tasks/letter_sort    # train.jsonl, heldout.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import zlib
from pathlib import Path

LETTERS = "abcdefgh"
HELDOUT_PER_MILLE = 100


def _all_questions() -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for n in (3, 4, 5):
        out.extend(itertools.permutations(LETTERS, n))
    return out


def is_heldout(question: str) -> bool:
    return zlib.crc32(question.encode()) % 1000 < HELDOUT_PER_MILLE


def letter_sort(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, heldout) records {"prompt", "completion"}; a pure function of its arguments."""
    qs = _all_questions()
    random.Random(seed).shuffle(qs)
    train: list[dict] = []
    held: list[dict] = []
    for q in qs:
        text = "sort: " + " ".join(q)
        rec = {"prompt": text, "completion": " ".join(sorted(q))}
        (held if is_heldout(text) else train).append(rec)
    if len(train) < n_train or len(held) < n_heldout:
        raise ValueError(f"only {len(train)} train / {len(held)} held-out questions exist")
    return train[:n_train], held[:n_heldout]


def write_task(out: str | Path, n_train: int = 6000, n_heldout: int = 300, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held = letter_sort(n_train, n_heldout, seed)
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", held)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="data/tasks/letter_sort")
    p.add_argument("--train", type=int, default=6000)
    p.add_argument("--heldout", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    path = write_task(a.out, a.train, a.heldout, a.seed)
    print(f"wrote {path}/train.jsonl ({a.train}) and {path}/heldout.jsonl ({a.heldout})")


if __name__ == "__main__":
    main()
