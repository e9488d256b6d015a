"""A model resource: `python -m tools.torchrun --standalone --nproc-per-node 2 -m tools.serve
--recipe recipes/debug.toml ...` (2 gloo processes, the base FSDP2-sharded, rank 0 serving)
driven by the unmodified tinker SDK, against the same service on one process.

The 1-process reference runs first and is stopped before the resource starts (at most two
heavy processes at a time on this machine). The tests run in file order on one resource:
the SFT and RL loops equal the reference within 1e-5 (fp32), each rank holds half the base,
billing counts both devices; then rank 1 is killed (the next operation fails naming it, the
service exits non-zero), and a restarted resource (`--generators 0`) loads the last saved
state and refuses sampling naming the option.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.helpers.service_server import (  # noqa: E402
    BASE_MODEL,
    KEY,
    TINY,
    importance_sampling_datums,
    start_server,
)

pytestmark = pytest.mark.multiproc

SEQS = [
    ([7, 300, 41, 1200, 55, 9, 801, 23, 64, 1999, 5, 77], 4),
    ([9, 8, 7, 6, 5, 4, 3], 3),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 2),
]  # three datums: the two ranks take 2 and 1
PROMPT = [5, 17, 33, 2]
SFT_STEPS, RL_ITERS, SAMPLES = 6, 3, 5  # 5 samples: uneven over 2 ranks too
STATE: dict = {}  # what one test leaves for a later one (file order)


def _datum(tokens: list[int], prompt: int) -> types.Datum:
    n = len(tokens) - 1
    w = [0.0] * (prompt - 1) + [1.0] * (n - prompt + 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": w},
    )


def _client(url: str):
    return tinker.ServiceClient(base_url=url, api_key=KEY)


def sft_loop(url: str) -> dict:
    sc = _client(url)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    data = [_datum(t, p) for t, p in SEQS]
    losses = []
    for _ in range(SFT_STEPS):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    path = tc.save_state("sft-last").result().path
    out = tc.forward(data, "cross_entropy").result()
    lps = [np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs]
    # one more step after the save: what a restart from the save must reproduce
    fb = tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    after = [fb.result().metrics["loss:sum"], tc.forward(data, "cross_entropy").result()]
    sc.close("success").result()
    return {
        "losses": losses,
        "logprobs": lps,
        "path": path,
        "at_save": out.metrics["loss:sum"],
        "after": after[0],
        "after_next": after[1].metrics["loss:sum"],
    }


def rl_loop(url: str) -> dict:
    sc = _client(url)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
    samples, sample_lps, losses = [], [], []
    for it in range(RL_ITERS):
        smp = tc.save_weights_and_get_sampling_client().result()
        res = smp.sample(
            types.ModelInput.from_ints(PROMPT),
            SAMPLES,
            types.SamplingParams(max_tokens=6, temperature=1.0, seed=it),
        ).result()
        rewards = np.array([np.mean(np.array(s.tokens) < 1024) for s in res.sequences])
        adv = rewards - rewards.mean()
        data = importance_sampling_datums(PROMPT, res.sequences, adv)
        fb = tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
        samples.append([list(s.tokens) for s in res.sequences])
        sample_lps.append([list(s.logprobs) for s in res.sequences])
    sc.close("success").result()
    return {"samples": samples, "logprobs": sample_lps, "losses": losses}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The SFT and RL loops on the 1-process service (stopped before the resource starts)."""
    srv = start_server(tmp_path_factory.mktemp("svc-one"))
    try:
        return {"sft": sft_loop(srv.url), "rl": rl_loop(srv.url)}
    finally:
        assert srv.stop() == 0, srv.log_text()[-3000:]


@pytest.fixture(scope="module")
def resource(reference, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("svc-two"), procs=2)
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_sft_loop_equals_one_process(reference, resource):
    ref, got = reference["sft"], sft_loop(resource.url)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=1e-5)
    assert got["losses"][-1] < 0.6 * got["losses"][0], got["losses"]  # it trains
    for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    STATE["sft"] = got


def test_rl_loop_equals_one_process(reference, resource):
    ref, got = reference["rl"], rl_loop(resource.url)
    assert got["samples"] == ref["samples"]  # every token of every sample
    for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=1e-5)


def _rank_lines(srv) -> list[tuple[str, str, str, str]]:
    """(rank, pid, base parameters held, base parameters) from each rank's start-up line."""
    return re.findall(
        r"resource: rank (\d) of 2 \(pid (\d+) on [^)]*\) holds ([\d,]+) of ([\d,]+) base",
        srv.log_text(),
    )


def test_each_rank_holds_half_the_base(resource):
    from recipe.loader import effective_shape, load_recipe

    total = effective_shape(load_recipe("recipes/debug.toml", TINY)).total_params
    lines = _rank_lines(resource)
    held = {int(r): int(n.replace(",", "")) for r, _, n, _ in lines}
    assert sorted(held) == [0, 1], lines
    assert {int(t.replace(",", "")) for *_, t in lines} == {total}
    assert sum(held.values()) == total
    for n in held.values():
        assert 0.45 * total <= n <= 0.55 * total, held
    STATE["pids"] = {int(r): int(p) for r, p, _, _ in lines}


def test_billing_counts_every_device(resource):
    recs = [json.loads(x) for x in (resource.storage / "usage.jsonl").read_text().splitlines()]
    ops = [r for r in recs if r["kind"] in ("forward_backward", "sample", "optim_step")]
    assert ops and all(r["devices"] == 2 for r in recs)
    for r in ops:
        assert r["device_s"] == pytest.approx(2 * r["wall_s"], rel=1e-9)


def test_killed_rank_fails_next_op_and_service_exits(resource):
    sc = _client(resource.url)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    data = [_datum(t, p) for t, p in SEQS]
    tc.forward(data, "cross_entropy").result()
    os.kill(STATE["pids"][1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"lost rank 1 \(pid \d+\) of 2") as e:
        tc.forward(data, "cross_entropy").result()
    assert str(resource.storage) not in str(e.value)
    rc = resource.proc.wait(timeout=90)
    assert rc != 0
    assert time.monotonic() - t0 < 60
    log = resource.log_text()
    assert "error: the resource lost rank 1" in log and "Traceback" not in log


def test_restarted_resource_loads_the_last_saved_state(reference, resource, tmp_path_factory):
    """A restart on the same storage, training only: the saved state loads on both ranks and
    the next step is the one the uninterrupted reference took; sampling is refused."""
    srv = start_server(
        tmp_path_factory.mktemp("svc-restart"),
        "--generators",
        "0",
        storage=resource.storage,
        procs=2,
    )
    try:
        sc = _client(srv.url)
        tc = sc.create_training_client_from_state_with_optimizer(STATE["sft"]["path"]).result()
        data = [_datum(t, p) for t, p in SEQS]
        ref = reference["sft"]
        at_save = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert at_save == pytest.approx(ref["at_save"], rel=1e-5, abs=1e-5)
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        assert fb.result().metrics["loss:sum"] == pytest.approx(ref["after"], rel=1e-5, abs=1e-5)
        nxt = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert nxt == pytest.approx(ref["after_next"], rel=1e-5, abs=1e-5)
        with pytest.raises(Exception, match="--generators 0"):
            tc.save_weights_and_get_sampling_client().result()
        with pytest.raises(Exception, match="--generators 0"):
            sc.create_sampling_client(base_model=BASE_MODEL).result()
        assert "no generator (--generators 0" in srv.log_text()
        sc.close("success").result()
        # SIGTERM to rank 0 (the serving process): it drains, the other rank follows it out
        rank0 = next(int(pid) for r, pid, _, _ in _rank_lines(srv) if r == "0")
        os.kill(rank0, signal.SIGTERM)
        assert srv.proc.wait(timeout=90) == 0, srv.log_text()[-3000:]
    finally:
        if srv.proc.poll() is None:
            srv.stop()
