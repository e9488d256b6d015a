"""The unmodified `tinker` SDK against `python -m tools.serve` on the tiny debug model (CPU).

One server for the module (API keys on, 4 MiB body limit). Covers the SFT loop, the RL loop,
save/load across clients, accounting, and each bad-input case of the service issue.
"""

from __future__ import annotations

import warnings

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.helpers.service_server import BASE_MODEL, KEY, importance_sampling_datums, start_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("svc"), "--max-body-mb", "4")
    yield srv
    assert srv.stop() == 0, srv.log_text()[-3000:]


def client(server, key: str = KEY):
    return tinker.ServiceClient(base_url=server.url, api_key=key)


def sft_datum(tokens: list[int], prompt_len: int) -> types.Datum:
    n = len(tokens) - 1
    w = [0.0] * (prompt_len - 1) + [1.0] * (n - prompt_len + 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": w},
    )


SEQ = [7, 300, 41, 1200, 55, 9, 801, 23, 64, 1999, 5, 77]
PROMPT = 4


def test_sft_loop(server):
    sc = client(server)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    d = sft_datum(SEQ, PROMPT)
    w = np.asarray(d.loss_fn_inputs["weights"].data)
    losses = []
    for _ in range(20):
        fb = tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        out = fb.result()
        lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].data)
        # Tinker's cross_entropy: sum over tokens of -weight * logprob (independent numpy sum)
        assert out.metrics["loss:sum"] == pytest.approx(-(w * lp).sum(), rel=1e-5)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] / 5, losses

    # Targets under weight 0 (the prompt) contribute nothing.
    other = list(d.loss_fn_inputs["target_tokens"].data)
    other[: PROMPT - 1] = [1, 2, 3]
    d2 = types.Datum(
        model_input=d.model_input, loss_fn_inputs={"target_tokens": other, "weights": list(w)}
    )
    a = tc.forward([d], "cross_entropy").result().metrics["loss:sum"]
    b = tc.forward([d2], "cross_entropy").result().metrics["loss:sum"]
    assert a == b

    saved = tc.save_state("sft-final").result()
    assert saved.path.endswith("/weights/sft-final")
    run_id = saved.path.split("/")[2]
    folder = server.tenant_dir() / run_id / "weights" / "sft-final"
    assert (folder / "meta.json").is_file() and (folder / "adapter_model.safetensors").is_file()

    spath = tc.save_weights_for_sampler("sft-sampler").result().path
    sampler = sc.create_sampling_client(model_path=spath).result()
    greedy = types.SamplingParams(max_tokens=len(SEQ) - PROMPT, temperature=0.0, seed=0)
    res = sampler.sample(types.ModelInput.from_ints(SEQ[:PROMPT]), 1, greedy).result()
    assert res.sequences[0].tokens == SEQ[PROMPT:]
    # The sampler's prompt logprobs are the trainer's (same weights, same numerics).
    full = sampler.compute_logprobs(types.ModelInput.from_ints(SEQ)).result()
    train_lp = tc.forward([sft_datum(SEQ, 1)], "cross_entropy").result()
    np.testing.assert_allclose(full[1:], train_lp.loss_fn_outputs[0]["logprobs"].data, atol=1e-4)
    assert full[0] is None
    listed = tinker.RestClient(base_url=server.url, api_key=KEY).list_checkpoints(run_id).result()
    assert {c.checkpoint_id for c in listed.checkpoints} == {
        "weights/sft-final",
        "sampler_weights/sft-sampler",
    }
    sc.close("success").result()


def test_rl_loop_reward_rises(server):
    """sample -> reward (share of tokens in the lower half of the vocabulary) -> group-centred
    advantages -> importance_sampling -> optim_step."""
    sc = client(server)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    prompt = [5, 17, 33, 2]
    means = []
    for it in range(12):
        smp = tc.save_weights_and_get_sampling_client().result()
        res = smp.sample(
            types.ModelInput.from_ints(prompt),
            16,
            types.SamplingParams(max_tokens=6, temperature=1.0, seed=it),
        ).result()
        rewards = np.array([np.mean(np.array(s.tokens) < 1024) for s in res.sequences])
        means.append(rewards.mean())
        adv = rewards - rewards.mean()
        data = importance_sampling_datums(prompt, res.sequences, adv)
        fb = tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        out = fb.result()
        # On-policy, the trainer's logprobs of the sampled tokens equal the sampler's.
        np.testing.assert_allclose(
            out.loss_fn_outputs[0]["logprobs"].data[len(prompt) - 1 :],
            res.sequences[0].logprobs,
            atol=1e-4,
        )
    assert np.mean(means[:3]) < 0.65 and np.mean(means[-3:]) > 0.85, means
    sc.close("success").result()


def _train(tc, data, steps):
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_save_state_then_load_in_new_client(server):
    data = [sft_datum(SEQ, 2), sft_datum([9, 8, 7, 6, 5, 4, 3], 3)]
    a = client(server)
    ta = a.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    _train(ta, data, 3)
    path = ta.save_state("mid").result().path
    after_a = _train(ta, data, 3)
    a.close("success").result()

    b = client(server)  # another ServiceClient: another session
    tb = b.create_training_client_from_state_with_optimizer(path).result()
    assert _train(tb, data, 3) == after_a  # identical, step for step

    # The SDK's load_state (deprecated, still served) into a fresh client of the same shape.
    tc = b.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=99).result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc.load_state_with_optimizer(path).result()
    assert _train(tc, data, 3) == after_a
    b.close("success").result()


def test_failing_step_fails_its_future_and_service_keeps_serving(server):
    sc = client(server)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    path = tc.save_state("broken").result().path
    run_id = path.split("/")[2]
    (server.tenant_dir() / run_id / "weights" / "broken" / "adapter_model.safetensors").write_bytes(
        b"not a safetensors file"
    )
    # The manifest's CRC32 catches it: a client error naming the damaged file, no server path.
    with pytest.raises(tinker.APIStatusError, match="damaged.*adapter_model") as e:
        sc.create_training_client_from_state(path).result()
    assert str(server.storage) not in str(e.value)
    # The same session and a new one keep working.
    assert _train(tc, [sft_datum(SEQ, 2)], 1)[0] > 0
    other = client(server)
    t2 = other.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    assert _train(t2, [sft_datum(SEQ, 2)], 1)[0] > 0
    sc.close("success").result()
    other.close("success").result()


def test_device_seconds_per_session(server):
    sc = client(server)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    _train(tc, [sft_datum(SEQ, 2)], 2)
    sid = sc.holder.get_session_id()
    r = httpx.get(f"{server.url}/api/v1/sessions/{sid}/usage", headers={"X-API-Key": KEY})
    u = r.json()
    assert r.status_code == 200 and u["device_seconds"] > 0 and u["devices"] == 1
    assert u["ops"]["forward_backward"] == 2 and u["ops"]["optim_step"] == 2
    assert f"session={sid}" in server.log_text() and "session_device_s=" in server.log_text()
    sc.close("success").result()
    assert httpx.get(f"{server.url}/api/v1/sessions/{sid}/usage").status_code == 401


# --- bad input ----------------------------------------------------------------------------


def test_missing_or_wrong_key_is_401_and_keys_are_never_logged(server):
    for headers in ({}, {"X-API-Key": "tml-wrong"}, {"X-API-Key": ""}):
        r = httpx.post(f"{server.url}/api/v1/create_session", json={}, headers=headers)
        assert r.status_code == 401, r.text
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").create_lora_training_client(
            base_model=BASE_MODEL
        ).result()
    assert KEY not in server.log_text()


def _post(server, path, body=None, content=None, headers=None):
    h = {"X-API-Key": KEY, **(headers or {})}
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=h, timeout=30)


@pytest.fixture(scope="module")
def model_id(server):
    sc = client(server)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    yield tc.model_id
    sc.close("success").result()


def test_checkpoint_names_cannot_escape_storage(server, model_id, tmp_path):
    for name in ["../../escape", "a/b", "..", ".hidden", "x" * 200, "", "a\x00b", "/abs"]:
        r = _post(server, "/api/v1/save_weights", {"model_id": model_id, "path": name, "seq_id": 1})
        assert r.status_code == 400 and r.json()["detail"].startswith("path:"), (name, r.text)
    for path in [
        "tinker://../weights/x",
        "tinker://a/weights/../../x",
        "tinker:///etc/passwd",
        "file:///etc/passwd",
        f"tinker://{model_id}/weights/..%2f",
    ]:
        r = _post(
            server,
            "/api/v1/load_weights",
            {"model_id": model_id, "seq_id": 1, "path": path, "optimizer": False},
        )
        assert r.status_code in (400, 404), (path, r.text)
    r = httpx.get(
        f"{server.url}/api/v1/training_runs/..%2F..%2Fetc/checkpoints", headers={"X-API-Key": KEY}
    )
    assert r.status_code in (400, 404)
    assert not any(p.name == "escape" for p in server.storage.parent.rglob("escape"))


def test_request_size_limit(server):
    big = b"\0" * (5 << 20)  # the server runs with --max-body-mb 4
    r = _post(
        server,
        "/api/v1/forward_backward",
        content=big,
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert r.status_code == 413 and "body" in r.json()["detail"]

    def chunks():  # no Content-Length: the limit holds while streaming
        for _ in range(5):
            yield b"\0" * (1 << 20)

    r = httpx.post(
        f"{server.url}/api/v1/forward_backward",
        content=chunks(),
        headers={"X-API-Key": KEY, "Content-Type": "application/x-protobuf"},
    )
    assert r.status_code == 413


def _fwdbwd_bytes(model_id, datum: types.Datum, loss="cross_entropy", cfg=None) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn=loss, loss_fn_config=cfg
        ),
        model_id=model_id,
        seq_id=1000,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def test_malformed_requests_get_4xx_naming_the_field(server, model_id):
    good = sft_datum(SEQ, 2)
    cases = [
        (
            "/api/v1/optim_step",
            {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": "fast"}},
            "adam_params.learning_rate",
        ),
        (
            "/api/v1/optim_step",
            {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": -1}},
            "adam_params.learning_rate",
        ),
        ("/api/v1/optim_step", {"model_id": model_id, "adam_params": {}}, "seq_id"),
        ("/api/v1/optim_step", {"model_id": "nope", "seq_id": 1, "adam_params": {}}, "model_id"),
        (
            "/api/v1/create_model",
            {
                "session_id": "s-x",
                "model_seq_id": 0,
                "base_model": BASE_MODEL,
                "lora_config": {"rank": 4},
            },
            "session_id",
        ),
        ("/api/v1/create_model", {"session_id": 5}, "session_id"),
        (
            "/api/v1/asample",
            {
                "sampling_session_id": "none",
                "prompt": {"chunks": []},
                "sampling_params": {"temperature": -1},
            },
            "sampling_params.temperature",
        ),
        ("/api/v1/retrieve_future", {"request_id": "does-not-exist"}, "request_id"),
    ]
    for path, body, field in cases:
        r = _post(server, path, body)
        assert 400 <= r.status_code < 500 and r.json()["detail"].startswith(field), (path, r.text)
    r = _post(
        server,
        "/api/v1/optim_step",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text

    proto_cases = [
        (b"\xff\xff\xff", "forward_backward"),  # not protobuf
        (_fwdbwd_bytes(model_id, good, loss="dpo"), "loss_fn"),
        (
            _fwdbwd_bytes(
                model_id,
                types.Datum(
                    model_input=good.model_input,
                    loss_fn_inputs={
                        "target_tokens": good.loss_fn_inputs["target_tokens"],
                        "weights": [1.0, 2.0],
                    },
                ),
            ),
            "data[0].loss_fn_inputs.weights",
        ),
        (
            _fwdbwd_bytes(
                model_id,
                types.Datum(
                    model_input=types.ModelInput.from_ints([1, 99999]),
                    loss_fn_inputs={"target_tokens": [1, 2]},
                ),
            ),
            "data[0].model_input",
        ),
        (
            _fwdbwd_bytes(
                model_id,
                types.Datum(
                    model_input=good.model_input,
                    loss_fn_inputs={"target_tokens": good.loss_fn_inputs["target_tokens"]},
                ),
                loss="ppo",
            ),
            "data[0].loss_fn_inputs.logprobs",
        ),
        (
            _fwdbwd_bytes(
                model_id,
                types.Datum(
                    model_input=types.ModelInput.from_ints(list(range(100))),
                    loss_fn_inputs={"target_tokens": list(range(100))},
                ),
            ),
            "data[0].model_input",
        ),  # longer than the model's 64
        (_fwdbwd_bytes(model_id, good, cfg={"clip_low_threshold": 0.5}), "loss_fn_config"),
    ]
    for raw, field in proto_cases:
        r = _post(
            server,
            "/api/v1/forward_backward",
            content=raw,
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert r.status_code == 400 and r.json()["detail"].startswith(field), (field, r.text)
    r = _post(server, "/api/v1/healthz")  # still up: a method not served is a clear 400
    assert r.status_code == 400 and "not supported by this service" in r.text, r.text
    assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}


def test_ppo_cispo_and_the_custom_loss_path(server):
    """ppo / cispo against a numpy reference (Tinker's formulas, summed); the SDK's
    forward_backward_custom (the loss runs in the client, its gradient trains through
    cross_entropy weights) gives the same training as the built-in loss it re-implements."""
    import torch

    sc = client(server)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=11).result()
    toks = SEQ
    base = tc.forward([sft_datum(toks, 1)], "cross_entropy").result()
    lp_now = np.asarray(base.loss_fn_outputs[0]["logprobs"].data)
    rng = np.random.default_rng(0)
    old = lp_now + rng.normal(0, 0.3, lp_now.size)  # a behaviour policy a little off
    adv = rng.normal(0, 1, lp_now.size)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={
            "target_tokens": toks[1:],
            "logprobs": old.tolist(),
            "advantages": adv.tolist(),
        },
    )
    lo, hi = 0.9, 1.1
    r = np.exp(lp_now - old.astype(np.float32))
    ppo_ref = -np.minimum(r * adv, np.clip(r, lo, hi) * adv).sum()
    cispo_ref = -(np.clip(r, lo, hi) * adv * lp_now).sum()
    cfg = {"clip_low_threshold": lo, "clip_high_threshold": hi}
    for loss, ref in (("ppo", ppo_ref), ("cispo", cispo_ref)):
        got = tc.forward([datum], loss, cfg).result().metrics["loss:sum"]
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-4), loss

    def neg_ll(data, logprobs_list):
        loss = sum(
            -(lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
            for d, lp in zip(data, logprobs_list, strict=True)
        )
        return loss, {}

    data = [sft_datum(SEQ, PROMPT)]
    a = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=12).result()
    b = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=12).result()
    for _ in range(3):
        fa = a.forward_backward_custom(data, neg_ll)
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        fb = b.forward_backward(data, "cross_entropy")
        b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert fa.result().metrics["loss:sum"] == pytest.approx(
            fb.result().metrics["loss:sum"], rel=1e-5
        )
    sc.close("success").result()
