"""Every published row stays within 25% of its prediction, and the committed table is current."""

from __future__ import annotations

import pytest

from parallel.calibration import rows
from tests.helpers.runs import ROOT

DRIFT = 0.25


@pytest.mark.parametrize("row", rows(), ids=lambda r: r.name)
def test_row_within_25_percent(row):
    pred = row.predict().tokens_per_sec_per_gpu
    err = pred / row.tokens_per_sec_per_gpu - 1
    assert abs(err) <= DRIFT, (
        f"{row.name}: predicted {pred:.0f}, published {row.tokens_per_sec_per_gpu}"
    )


def test_calibration_table_is_current():
    from tools.predict import calibration_markdown

    committed = (ROOT / "benchmarks" / "calibration.md").read_text()
    assert committed == calibration_markdown(), (
        "benchmarks/calibration.md is stale: python -m tools.predict --calibration "
        "--out benchmarks/calibration.md"
    )
