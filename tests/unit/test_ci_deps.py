"""CI=true turns a missing test dependency into a failed run, never a skip (tests/helpers/deps.py)."""

from __future__ import annotations

from tests.helpers import deps


def test_missing_dependency_refuses_ci_only(monkeypatch):
    monkeypatch.setattr(deps, "CI_REQUIRED", ("json", "no_such_module_39"))
    monkeypatch.setattr(deps.missing, "__defaults__", (deps.CI_REQUIRED,))
    monkeypatch.setenv("CI", "true")
    why = deps.ci_refusal()
    assert why is not None and why.startswith("CI=true and 1 test dependency do not import")
    assert "no_such_module_39: ModuleNotFoundError" in why and "json" not in why.split("(")[1]
    monkeypatch.setenv("CI", "")
    assert deps.ci_refusal() is None


def test_a_broken_install_counts_as_missing(monkeypatch, tmp_path):
    """An SDK whose import raises something other than ImportError is still missing."""
    (tmp_path / "broken_sdk_39.py").write_text("raise RuntimeError('half installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert deps.missing(("broken_sdk_39",)) == ["broken_sdk_39: RuntimeError: half installed"]


def test_every_importorskip_module_is_required_in_ci():
    import re

    from tests.helpers.runs import ROOT

    used = set()
    for p in (ROOT / "tests").rglob("*.py"):
        used |= set(re.findall(r"importorskip\(\"([\w.]+)\"", p.read_text()))
    assert used <= set(deps.CI_REQUIRED), sorted(used - set(deps.CI_REQUIRED))
