"""One process skips torchtitan's closing 2 s sleep; several ranks keep it (runtime/trainer.py
`without_exit_sleep`)."""

from __future__ import annotations

import inspect
import time

import torchtitan.trainer as tt

from runtime.trainer import EXIT_SLEEP_S, without_exit_sleep


def test_torchtitan_still_ends_train_with_the_sleep():
    # The patch targets this statement through the module's `time`: an upgrade that moves
    # or renames it would leave the patch doing nothing (or something else).
    src = inspect.getsource(tt.Trainer.train)
    assert f"time.sleep({EXIT_SLEEP_S})" in src
    assert tt.time is time


def _timed_sleeps(world_size: int) -> tuple[float, float]:
    with without_exit_sleep(world_size):
        t0 = time.perf_counter()
        tt.time.sleep(EXIT_SLEEP_S)
        exit_sleep = time.perf_counter() - t0
        t0 = time.perf_counter()
        tt.time.sleep(0.01)  # any other sleep through the module still sleeps
        other = time.perf_counter() - t0
    assert tt.time is time  # restored
    return exit_sleep, other


def test_one_process_skips_it_and_keeps_other_sleeps():
    exit_sleep, other = _timed_sleeps(1)
    assert exit_sleep < 0.5 and other >= 0.01
    assert tt.time.perf_counter is time.perf_counter


def test_several_ranks_keep_it(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    with without_exit_sleep(2):
        assert tt.time is time
        tt.time.sleep(EXIT_SLEEP_S)
    assert slept == [EXIT_SLEEP_S]
