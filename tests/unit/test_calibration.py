"""The calibration: every row within its drift bound, every row and source cited. The
cross-validation (leave one source / generation out, ~20 s of refits) and the committed
table's currency are tests/integration/test_calibration_cv.py."""

from __future__ import annotations

import re

import pytest

from parallel.calibration import SOURCES, rows
from parallel.stacks import stack_names

DRIFT = 0.25  # no single row past this


@pytest.mark.parametrize("row", rows(), ids=lambda r: f"{r.source}:{r.name}")
def test_row_within_25_percent(row):
    pred = row.predict().tokens_per_sec_per_gpu
    err = pred / row.tokens_per_sec_per_gpu - 1
    assert abs(err) <= DRIFT, (
        f"{row.name}: predicted {pred:.0f}, published {row.tokens_per_sec_per_gpu}"
    )


def test_the_set_is_wide_and_cited():
    rs = rows()
    assert len(rs) >= 30
    gpus = {r.load_cluster().gpu for r in rs}
    assert len(gpus) >= 3, gpus
    sizes = [r.gpus for r in rs]
    assert min(sizes) <= 8 and max(sizes) >= 8192
    for s in SOURCES.values():
        assert s.url.startswith("https://") and re.fullmatch(r"\d{4}-\d{2}", s.date)
        assert s.stack in stack_names()
    for r in rs:
        # Every row is priced on its source's stack: no row picks its own constants.
        assert r.workload.stack == SOURCES[r.source].stack
    assert {r.workload.stack for r in rs} == {"torchtitan", "megatron_te"}
