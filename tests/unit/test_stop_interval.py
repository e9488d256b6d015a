"""The stop-request check runs about every TITANSCALE_STOP_CHECK_S seconds of training, not
every step (launch/stop_request.py states the cost), and still sees a request."""

from __future__ import annotations

import pytest

import launch.stop_request as sr
from launch.stop_request import StopRequest, next_interval


def test_next_interval():
    assert next_interval(0.0, 10) == 1  # unknown step time: check again next step
    assert next_interval(0.5, 10) == 20
    assert next_interval(25.0, 10) == 1  # long steps: every step (0.02% at 5 ms a check)
    assert next_interval(1e-6, 10) == sr.MAX_EVERY


def test_checks_spaced_by_time(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(sr.time, "monotonic", lambda: clock[0])
    stop = tmp_path / "stop"
    req = StopRequest(str(stop), check_s=10.0)
    checked_at = []
    for step in range(0, 61):  # call at each step boundary; steps take 0.5 s
        before = req.checks
        assert not req.requested()
        if req.checks > before:
            checked_at.append(step)
        clock[0] += 0.5
    # before step 1, after step 1 (learns 0.5 s/step), then every 20 steps = 10 s
    assert checked_at == [0, 1, 21, 41]
    stop.touch()
    first_hit = None
    for step in range(61, 82):
        if req.requested():
            first_hit = step
            break
        clock[0] += 0.5
    assert first_hit == 61  # the next scheduled check (41 + 20) sees the file, on every rank


def test_env_sets_the_spacing(monkeypatch, tmp_path):
    monkeypatch.setenv(sr.ENV_CHECK_S, "2.5")
    assert StopRequest(str(tmp_path / "x")).check_s == pytest.approx(2.5)
