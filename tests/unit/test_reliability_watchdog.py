"""The step watchdog's decisions, in-process (no process group; a dict stands in for the store).

The end-to-end case (a real hung rank under torchrun) is in test_reliability_faults.py.
"""

from __future__ import annotations

import json
import time

from runtime.watchdog import (
    EXIT_HUNG,
    STEP_SLACK,
    StepWatchdog,
    looks_like_timeout,
    main_thread_location,
)


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


GROUPS = {"dp_shard": [0, 1], "tp": [0, 2]}


def test_a_rank_stuck_outside_collectives_exits_and_names_itself():
    store, exits = DictStore(), []
    wd = StepWatchdog(
        rank=1, world_size=2, timeout_s=0.3, first_timeout_s=0.3, groups={"dp_shard": [0, 1]},
        store=store, grace_s=0.2, exit_fn=exits.append,
    ).start()  # fmt: skip
    wd.begin(7)
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)  # the "hang": this (main) thread is in test code, not in a collective
    wd.stop()
    assert exits == [EXIT_HUNG]
    report = json.loads(store.get("titanscale/watchdog/0/1"))
    assert report["step"] == 7 and report["waiting"] is False
    assert "test_reliability_watchdog.py" in report["where"]
    msg = wd.last_message or ""
    assert msg.startswith("titanscale: rank 0, 1 stopped answering in step 7"), msg
    assert "rank 0 sent no report" in msg and "dp_shard [0, 1]" in msg


def test_no_false_alarm_while_steps_finish_in_time():
    exits: list[int] = []
    # Steps 20x shorter than the timeout: a loaded machine cannot stretch them past it.
    wd = StepWatchdog(
        rank=0, world_size=1, timeout_s=1.0, first_timeout_s=1.0, exit_fn=exits.append
    ).start()
    for step in range(1, 6):
        wd.begin(step)
        time.sleep(0.05)
        wd.end()
    time.sleep(1.2)  # idle between steps (checkpoint saves, eval) is not watched
    wd.stop()
    assert exits == []


def test_first_step_gets_the_init_timeout_and_long_steps_stretch_the_deadline():
    wd = StepWatchdog(rank=0, world_size=1, timeout_s=0.2, first_timeout_s=300)
    assert wd.deadline_s() == 300
    wd.begin(1)
    wd.end()
    assert wd.deadline_s() == 0.2
    wd.begin(2)
    time.sleep(0.3)  # a healthy step longer than the timeout
    wd.end()
    assert wd.deadline_s() >= STEP_SLACK * 0.3


def test_diagnosis_from_the_waiting_rank():
    """Rank 0 waited in a collective; rank 2 reported a hang in data loading; rank 1 waits too."""
    store = DictStore()
    for r, waiting, where in (
        (1, True, "torch/distributed/x.py:1 wait"),
        (2, False, "data/loader.py:9 read"),
    ):
        store.set(
            f"titanscale/watchdog/0/{r}",
            json.dumps({"rank": r, "step": 3, "waiting": waiting, "where": where}),
        )
    wd = StepWatchdog(
        rank=0,
        world_size=3,
        timeout_s=5,
        first_timeout_s=5,
        groups=GROUPS,
        store=store,
        grace_s=0.1,
    )
    wd._completed = 2
    msg = wd.collective_failed(3, RuntimeError("Timed out waiting 5000ms for recv operation"))
    assert msg.startswith(
        "titanscale: rank 2 stopped answering in step 3 (rank 2 at data/loader.py:9 read)"
    )
    assert "rank 0, 1 waited for it in a collective" in msg
    assert "groups with rank 2: tp [0, 2]" in msg and "dp_shard" not in msg
    assert msg.endswith("timeout 5 s (job.collective_timeout_s)")


def test_timeouts_are_recognised():
    assert looks_like_timeout(RuntimeError("[gloo] Timed out waiting 5000ms for recv operation"))
    assert looks_like_timeout(RuntimeError("Watchdog caught collective operation timeout"))
    assert not looks_like_timeout(RuntimeError("Connection closed by peer"))


def test_main_thread_location_is_this_test():
    where, waiting = main_thread_location()
    assert "test_reliability_watchdog.py" in where and not waiting
