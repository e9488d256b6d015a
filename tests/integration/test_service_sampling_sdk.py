"""The unmodified `tinker` SDK against `tools.serve` (debug base, CPU): what the cookbook's
clients need from sampling and training beyond the basics of test_service_sdk.py.

`get_tokenizer()` with no network; Tinker's stop semantics (stop=None ends at EOS, stop=[]
never stops early, string stops decoded server-side, the stopping token returned);
max_tokens=None; top_k; top-k prompt logprobs; the dro, gspo and stable_reinforce losses
against numpy, stable_reinforce on the server's records of what was sampled.
"""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.helpers.service_server import BASE_MODEL, KEY, fetch_tokenizer, start_server  # noqa: E402

PROMPT = [5, 17, 33, 2]
CONTEXT = 64  # the helper's training.seq_len


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("svc-sampling"))
    yield srv
    assert srv.stop() == 0, srv.log_text()[-3000:]


@pytest.fixture(scope="module")
def sc(server, tmp_path_factory):
    """The SDK client, run where `tools.tokenizer` put the served tokenizer (the one client
    setting a titanscale base needs for get_tokenizer(): docs/from_tinker.md)."""
    where = fetch_tokenizer(server.url, tmp_path_factory.mktemp("client"))
    c = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(where)
        yield c
    c.close("success").result()


def _datum(tokens: list[int], weights_from: int) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [0.0] * (weights_from - 1) + [1.0] * (n - weights_from + 1),
        },
    )


@pytest.fixture(scope="module")
def taught(sc):
    """An adapter trained to continue PROMPT with a text that holds "\\n\\nUser:", then EOS,
    then more tokens (so stops have something to stop before)."""
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    head = tok.encode(" The answer is 9.\n\nUser: next", add_special_tokens=False)
    tail = tok.encode(" and so on", add_special_tokens=False)
    completion = head + [tok.eos_token_id] + tail
    d = _datum(PROMPT + completion, len(PROMPT))
    for _ in range(30):
        fb = tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        fb.result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    return tc, tok, completion, sampler


def _greedy(sampler, stop, max_tokens):
    p = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0, stop=stop)
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 1, p).result().sequences[0]


def test_get_tokenizer_offline_is_the_servers(sc, server):
    """get_info names the tokenizer by the served name, never a path of the server's machine
    (#41); tools.tokenizer wrote that name's folder where the client runs, and the SDK loads
    it with no network (HF_HUB_OFFLINE in the test environment) and encodes as the server's
    own tokenizer does."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from data.tokenizer import resolve_tokenizer
    from recipe.loader import effective_shape, load_recipe
    from tests.helpers.service_server import ROOT, TINY

    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    tid = tc.get_info().model_data.tokenizer_id
    assert tid == BASE_MODEL and str(server.storage) not in tid and not Path(tid).is_absolute()
    tok = tc.get_tokenizer()
    # The server's folder, found as the server found it (the same recipe and cache).
    vocab = effective_shape(load_recipe(ROOT / "recipes/debug.toml", TINY)).vocab_size
    ref = Tokenizer.from_file(
        str(Path(resolve_tokenizer("embedded", vocab_size=vocab)) / "tokenizer.json")
    )
    text = "def f(x):\n    return x + 1  # ok"
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text).ids
    assert tok.eos_token_id == ref.token_to_id("<|end_of_text|>")


def test_stop_none_stops_at_eos_and_empty_list_never_stops(taught):
    tc, tok, completion, sampler = taught
    eos_at = completion.index(tok.eos_token_id)
    at_eos = _greedy(sampler, None, 20)
    assert at_eos.tokens == completion[: eos_at + 1] and at_eos.stop_reason == "stop"
    free = _greedy(sampler, [], eos_at + 3)
    assert free.tokens == completion[: eos_at + 3] and free.stop_reason == "length"
    by_id = _greedy(sampler, [completion[2]], 20)  # a token id stop: that token ends it
    assert by_id.tokens == completion[:3] and by_id.stop_reason == "stop"
    # max_tokens=None: up to the context (the EOS ignored with stop=[])
    full = _greedy(sampler, [], None)
    assert len(full.tokens) == CONTEXT - len(PROMPT) and full.stop_reason == "length"


def test_string_stop_is_decoded_server_side_and_returned(taught):
    """The role-colon renderer's stop string: the sequence ends with the token that
    completes it, and the stop string is in the returned text (as Tinker returns it; the
    cookbook's RoleColonRenderer.parse_response needs it to report STOP_SEQUENCE)."""
    tc, tok, completion, sampler = taught
    seq = _greedy(sampler, ["\n\nUser:"], 20)
    text = tok.decode(seq.tokens)
    assert seq.stop_reason == "stop" and seq.tokens == completion[: len(seq.tokens)]
    assert len(text.split("\n\nUser:")) == 2  # RoleColonRenderer: STOP_SEQUENCE
    assert "\n\nUser:" not in tok.decode(seq.tokens[:-1])  # the last token completed it


def test_top_k_and_topk_prompt_logprobs(sc):
    sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
    k = 3
    # the next-token distribution after PROMPT is row len(PROMPT) of PROMPT + [any token]
    res = sampler.sample(
        types.ModelInput.from_ints(PROMPT + [0]),
        1,
        types.SamplingParams(max_tokens=1, seed=0),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=k,
    ).result()
    topk, plp = res.topk_prompt_logprobs, res.prompt_logprobs
    assert topk[0] is None and len(topk) == len(PROMPT) + 1
    for i, row in enumerate(topk[1:], start=1):
        lps = [lp for _, lp in row]
        assert len(row) == k and lps == sorted(lps, reverse=True)
        target = (PROMPT + [0])[i]
        if target in [t for t, _ in row]:  # the scored token, when in the top k, agrees
            assert dict(row)[target] == pytest.approx(plp[i], abs=1e-5)
        else:
            assert plp[i] <= lps[-1] + 1e-6
    allowed = {t for t, _ in topk[-1]}
    greedy = _sample_first(sampler, types.SamplingParams(max_tokens=1, temperature=0.0), 1)
    assert greedy == [topk[-1][0][0]]
    firsts = _sample_first(sampler, types.SamplingParams(max_tokens=1, top_k=k, seed=3), 24)
    assert set(firsts) <= allowed
    unrestricted = _sample_first(sampler, types.SamplingParams(max_tokens=1, seed=3), 24)
    assert not set(unrestricted) <= allowed  # control: without top_k they spread wider


def _sample_first(sampler, params, n):
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), n, params).result()
    return [s.tokens[0] for s in res.sequences]


def _rl_datum(tokens, logprobs, adv, **extra):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": list(logprobs),
            "advantages": list(adv),
            **extra,
        },
    )


def test_dro_and_gspo_against_numpy(sc):
    """Tinker's formulas (its docs), summed over tokens, on the trainer's own logprobs."""
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=11).result()
    toks = PROMPT + [7, 300, 41, 1200, 55, 9]
    base = tc.forward([_datum(toks, 1)], "cross_entropy").result()
    lp = np.asarray(base.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)
    rng = np.random.default_rng(0)
    q = (lp + rng.normal(0, 0.2, lp.size)).astype(np.float32).astype(np.float64)
    adv = rng.normal(0, 1, lp.size)
    beta = 0.3
    dro = tc.forward([_rl_datum(toks, q, adv)], "dro", {"beta": beta}).result()
    ref = -(lp * adv - 0.5 * beta * (lp - q) ** 2).sum()
    assert dro.metrics["loss:sum"] == pytest.approx(ref, rel=1e-4, abs=1e-4)

    mask = np.zeros(lp.size)
    mask[len(PROMPT) - 1 :] = 1.0  # the ratio over the completion only
    lo, hi = 0.95, 1.05
    d = _rl_datum(toks, q, adv, sequence_ratio_mask=mask.tolist())
    gspo = tc.forward([d], "gspo", {"clip_low_threshold": lo, "clip_high_threshold": hi})
    s = np.exp((lp - q)[mask == 1].mean())
    ref = -np.minimum(s * adv, np.clip(s, lo, hi) * adv).sum()
    assert gspo.result().metrics["loss:sum"] == pytest.approx(ref, rel=1e-4, abs=1e-4)


def test_stable_reinforce_trains_on_the_recorded_samples(sc):
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=12).result()
    smp = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    res = smp.sample(
        types.ModelInput.from_ints(PROMPT), 4, types.SamplingParams(max_tokens=5, seed=1)
    ).result()
    data, refs = [], []
    for i, s in enumerate(res.sequences):
        toks = PROMPT + list(s.tokens)
        ob = len(PROMPT) - 1
        adv = [0.0] * ob + [float(i) - 1.5] * len(s.tokens)
        # the client's logprobs are wrong on purpose: the service must use its records
        d = _rl_datum(toks, [0.0] * ob + [-9.0] * len(s.tokens), adv).with_provenance(
            model_input=[
                types.PromptProvenanceSpan(sequence_id=s.sequence_id, length=len(PROMPT)),
                types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(s.tokens) - 1),
            ],
            loss_fn_inputs=[
                types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=1, length=ob),
                types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(s.tokens)),
            ],
        )
        data.append(d)
        refs.append((np.asarray(s.logprobs, np.float64), np.asarray(adv[ob:])))
    out = tc.forward(data, "stable_reinforce").result()
    want = 0.0
    for o, (q, a) in zip(out.loss_fn_outputs, refs, strict=True):
        lp = np.asarray(o["logprobs"].data, np.float64)[len(PROMPT) - 1 :]
        r = np.exp(lp - q)
        keep = (r >= 0.5) & (r <= 2.0)
        assert keep.all()  # on-policy: every ratio is ~1
        want += -(keep * r * a * lp).sum()
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    fb = tc.forward_backward(data, "stable_reinforce")  # and it trains
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert np.isfinite(fb.result().metrics["loss:sum"])

    # Refused (400 naming the field): a sequence sampled without records, no provenance.
    other = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=13).result()
    plain = other.save_weights_and_get_sampling_client().result()
    s = plain.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2))
    s = s.result().sequences[0]
    bad = data[0].with_provenance(
        model_input=data[0].model_input_spans,
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=1, length=3),
            types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=5),
        ],
    )
    with pytest.raises(tinker.BadRequestError, match="stability record"):
        other.forward([bad], "stable_reinforce").result()
