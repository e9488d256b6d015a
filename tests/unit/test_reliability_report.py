"""tools.reliability_report: the per-entry-point table reads back, and a partial run's rows
replace only the entry points it counted (reference: the rendered table itself)."""

from __future__ import annotations

import json

import pytest

from tools import reliability_report as rr

CASES = {
    "train.py": {"data source": [43, 43], "numeric extreme": [425, 425]},
    "token store": {"manifest missing": [2, 2]},
}


def test_table_round_trip():
    text = "\n".join(rr.render_cases(CASES))
    assert rr.parse_cases(text) == CASES


def test_unclean_rows_are_not_read_back_as_clean():
    rows = rr.render_cases({"x": {"k": [3, 2]}})
    with pytest.raises(ValueError, match="cannot read the row"):
        rr.parse_cases("\n".join(rows))


def test_update_replaces_only_counted_entry_points(tmp_path, monkeypatch):
    doc = tmp_path / "r.md"
    meta = {"date": "d", "machine": "m", "python": "p", "torch": "t", "wall_s": "1", "rc": "0"}
    figures = {"recipes_fuzzed_loader": 600, "cases": CASES}
    doc.write_text("# R\n\n" + rr.render(figures, meta) + "\n\ntail\n")
    monkeypatch.setattr(rr, "DOC", doc)
    rr.update_doc({"cases": {"token store": {"shard missing": [4, 4]}}}, meta)
    text = doc.read_text()
    got = rr.parse_cases(text)
    assert got == {"train.py": CASES["train.py"], "token store": {"shard missing": [4, 4]}}
    assert "| bad recipes generated and rejected by the loader (hypothesis) | 600 |" in text
    assert text.endswith("\n\ntail\n") and "Rows of `token store`" in text


def test_figures_are_kept_in_the_process_and_merged_once_per_flush(tmp_path, monkeypatch):
    """record / record_case keep figures in memory; flush (tests/conftest.py's
    pytest_sessionfinish) merges them into the file, adding to what other processes wrote,
    so no test has to run after another for its figures to count."""
    from tools import reliability_report as rr

    monkeypatch.setattr(rr, "_PENDING", {})
    monkeypatch.delenv(rr.ENV, raising=False)
    rr.record("checkpoint_faults", 5)
    rr.record_case("train.py", "--set")
    assert rr._PENDING == {}  # without the variable nothing is kept
    path = tmp_path / "figures.json"
    monkeypatch.setenv(rr.ENV, str(path))
    path.write_text(json.dumps({"checkpoint_faults": 2, "recipe_fuzz_kinds": {"a": 1}}))
    rr.record("checkpoint_faults", 1)
    rr.record("checkpoint_faults", 1)
    rr.record("max_loss_diff_after_restart", 0.5)
    rr.record("max_loss_diff_after_restart", 0.25)
    rr.record("recipe_fuzz_kinds", {"a": 2, "b": 1})
    rr.record_case("train.py", "--set", n=2)
    assert not json.loads(path.read_text()).get("cases")  # nothing written before flush
    rr.flush()
    rr.record_case("train.py", "--set")  # another test, after the first flush
    rr.flush()
    got = json.loads(path.read_text())
    assert got["checkpoint_faults"] == 4 and got["max_loss_diff_after_restart"] == 0.5
    assert got["recipe_fuzz_kinds"] == {"a": 3, "b": 1}
    assert got["cases"] == {"train.py": {"--set": [3, 3]}}
    assert rr._PENDING == {}
