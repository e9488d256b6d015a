"""runtime.stragglers: the detector against hand-computed own step times, and the
`slow` fault's parsing."""

import pytest

from runtime.faults import parse
from runtime.stragglers import StragglerDetector, own_step_times


def test_own_step_times_by_hand():
    # Step 2.0 s; rank 3 arrives 1.5 s after the first: the others waited for it.
    arrivals = {0: 100.0, 1: 100.1, 2: 100.0, 3: 101.5}
    own = own_step_times(arrivals, 2.0)
    assert own == pytest.approx({0: 0.5, 1: 0.6, 2: 0.5, 3: 2.0})


def test_named_after_consecutive_steps_and_streak_resets():
    d = StragglerDetector(ratio=1.5, steps=3)
    slow = {0: 10.0, 1: 10.0, 2: 11.0}  # rank 2: own 1.2 s against 0.2 s for the others
    even = {0: 10.0, 1: 10.01, 2: 10.0}
    out = [d.observe(slow, 1.2) for _ in range(2)]
    assert [o["straggler_rank"] for o in out] == [-1, -1]
    assert out[0]["slowest_rank"] == 2 and out[0]["slowest_rank_ratio"] == pytest.approx(6.0)
    assert out[0]["slowest_rank_lateness_s"] == pytest.approx(1.0)
    assert d.observe(slow, 1.2)["straggler_rank"] == 2  # third in a row
    assert d.observe(even, 1.0)["straggler_rank"] == -1  # 1.0 / 0.99: under the ratio
    assert d.observe(slow, 1.2)["straggler_rank"] == -1  # streak starts again


def test_two_ranks_and_off():
    # Two ranks: the slow one against the other (not against their mean).
    d = StragglerDetector(ratio=1.5, steps=1)
    two = d.observe({0: 5.0, 1: 5.4}, 0.6)
    assert two["straggler_rank"] == 1 and two["slowest_rank_ratio"] == pytest.approx(3.0)
    assert two["slowest_rank_lateness_s"] == pytest.approx(0.4)  # after the other rank
    off = StragglerDetector(ratio=0, steps=1)
    assert off.observe({0: 5.0, 1: 5.4}, 0.6)["straggler_rank"] == -1
    assert d.observe({0: 5.0}, 0.6) == {}


def test_slow_fault_fires_every_step_from_its_step():
    (f,) = parse("slow:rank=1:step=2:at=batch:seconds=0.25")
    assert f.seconds == 0.25
    assert [s for s in range(1, 6) if f.matches("batch", s, 1, 0)] == [2, 3, 4, 5]
    assert not f.matches("batch", 3, 0, 0) and not f.matches("step", 3, 1, 0)
    (k,) = parse("kill:rank=1:step=2")
    assert [s for s in range(1, 6) if k.matches("step", s, 1, 0)] == [2]
    for bad in ("slow:step=1:seconds=nan", "slow:step=1:seconds=-1"):
        with pytest.raises(ValueError, match="seconds"):
            parse(bad)
