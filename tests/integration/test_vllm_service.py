"""`tools.serve --sampler vllm`: two tenants' LoRA sampling clients (tinker SDK) sample in one
vLLM engine batch, each getting exactly the greedy tokens its adapter gives alone (the engine
sampling it alone, and our own KV-cache generator on the same sampler weights: a second
server, `--sampler titanscale`, over the same storage), and the same stop-string cuts and
prompt logprobs (top-k too) as that generator; another tenant's weights are a 404, damaged
weights a 422 (never the base).

The server starts its own engine (~15-60 s); the file replaces the seam-level test of
service/vllm_sampler.py, whose assertions it keeps (one batch, own tokens, unknown weights
404, oversize 413: the last two, with more adapters than the engine's 2 LoRA slots in one
engine call, on the session engine in tests/integration/test_vllm_engine.py: one file holds
every test of the session engine, so `--dist loadfile` starts it on one worker, not two).
"""

from __future__ import annotations

import re
import time

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.helpers.service_server import (  # noqa: E402
    BASE_MODEL,
    KEY,
    KEY_B,
    SEQ,
    TWO_TENANTS,
    sft_datum,
    start_server,
)

pytestmark = [pytest.mark.vllm]

# Each tenant's adapter memorises its own 12-token sequence (disjoint tokens): greedy from a
# prefix then continues it with a wide margin, so batching cannot flip a near-tie.
SEQS = {"a": SEQ, "b": [11, 450, 90, 1500, 33, 600, 1800, 72, 250, 1300, 8, 999]}
PROMPTS = {t: [s[:4], s[:6]] for t, s in SEQS.items()}
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
BATCH = re.compile(r"service\.engine_batch requests=(\d+) adapters=(\d+) handles=(\S+)")


def _engine_env() -> None:
    import os

    from rl.vllm_engine import SETUP, engine_python

    if engine_python() is None:
        if os.environ.get("CI"):
            pytest.fail(f"the vLLM engine environment is missing: run `{SETUP}`")
        pytest.skip(f"the vLLM engine environment is not installed: `{SETUP}`")


def _train(sc, seq: list[int], seed: int):
    """A rank-8 LoRA (vLLM's LoRA kernels take ranks 8, 16, ...) trained 16 steps on `seq`:
    it memorises it (the summed loss falls from ~90 to ~0.2)."""
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=seed).result()
    for _ in range(16):
        loss = tc.forward_backward([sft_datum(seq)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert loss.metrics["loss:sum"] < 2.0, loss.metrics
    return tc


def _tokens(futures) -> list[list[int]]:
    return [list(f.result().sequences[0].tokens) for f in futures]


def _batches(server) -> list[tuple[int, int, tuple[str, ...]]]:
    return [(int(n), int(k), tuple(h.split(",")))
            for n, k, h in BATCH.findall(server.log_text())]  # fmt: skip


def _stop_inside(tokens: list[int]) -> str:
    """A two-character stop string from the middle of `tokens`' text (the served tokenizer,
    loaded here as the server loads it)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from data.tokenizer import resolve_tokenizer
    from recipe.loader import effective_shape, load_recipe
    from tests.helpers.service_server import ROOT, TINY

    vocab = effective_shape(load_recipe(ROOT / "recipes/debug.toml", TINY)).vocab_size
    tok = Tokenizer.from_file(
        str(Path(resolve_tokenizer("embedded", vocab_size=vocab)) / "tokenizer.json")
    )
    text = tok.decode(tokens[:4], skip_special_tokens=False)
    head = tok.decode(tokens[:2], skip_special_tokens=False)
    # past the first two tokens' text, so the cut comes after a token or more
    return text[len(head) : len(head) + 2] if len(text) >= len(head) + 2 else text[-2:]


def _prompt_scores(sampler, ids: list[int], k: int = 3):
    """(prompt logprobs via compute_logprobs, the sample's prompt logprobs and top-k)."""
    plain = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    res = sampler.sample(types.ModelInput.from_ints(ids), 1, GREEDY,
                         include_prompt_logprobs=True, topk_prompt_logprobs=k).result()  # fmt: skip
    return plain, res.prompt_logprobs, res.topk_prompt_logprobs


def _same_scores(ours, theirs) -> None:
    """Our generator's prompt scores against the engine's: the same positions scored, logprobs
    within float32 noise of two code bases (1e-3, as tests/integration/test_vllm_engine.py),
    the same top-k tokens where their logprobs are apart by more than that."""
    for a, b in zip(ours[:2], theirs[:2], strict=True):
        assert a[0] is None and b[0] is None and len(a) == len(b)
        assert max(abs(x - y) for x, y in zip(a[1:], b[1:], strict=True)) < 1e-3, (a, b)
    assert ours[2][0] is None and theirs[2][0] is None
    for ra, rb in zip(ours[2][1:], theirs[2][1:], strict=True):
        assert len(ra) == len(rb) == 3
        assert max(abs(x[1] - y[1]) for x, y in zip(ra, rb, strict=True)) < 1e-3, (ra, rb)
        lps = [lp for _, lp in ra]
        if min(x - y for x, y in zip(lps, lps[1:], strict=False)) > 2e-3:  # no near-tie
            assert [t for t, _ in ra] == [t for t, _ in rb], (ra, rb)


def test_two_tenants_share_an_engine_batch_and_get_their_own_tokens(tmp_path):
    _engine_env()
    t0 = time.monotonic()
    server = start_server(
        tmp_path / "vllm",
        "--sampler", "vllm", "--sampler-window-ms", "1500",
        keys=TWO_TENANTS, start_timeout=600,
    )  # fmt: skip
    try:
        assert "sampler: one vLLM engine over the served base" in server.log_text()
        clients = {t: tinker.ServiceClient(base_url=server.url, api_key=k)
                   for t, k in (("a", KEY), ("b", KEY_B))}  # fmt: skip
        paths, samplers, trained = {}, {}, {}
        for t, sc in clients.items():
            tc = trained[t] = _train(sc, SEQS[t], seed=ord(t))
            paths[t] = tc.save_weights_for_sampler(f"samp-{t}").result().path
            samplers[t] = sc.create_sampling_client(model_path=paths[t]).result()
        base = clients["a"].create_sampling_client(base_model=BASE_MODEL).result()

        # Alone: one tenant's request per engine call (the log records each call).
        alone = {t: [_tokens([samplers[t].sample(types.ModelInput.from_ints(p), 1, GREEDY)])[0]
                     for p in PROMPTS[t]] for t in samplers}  # fmt: skip
        base_tokens = [
            _tokens([base.sample(types.ModelInput.from_ints(p), 1, GREEDY)])[0]
            for p in PROMPTS["a"]
        ]
        calls = _batches(server)
        assert [n for n, _, _ in calls] == [1] * 6, calls
        handle = {"a": calls[0][2][0], "b": calls[2][2][0]}
        assert calls[1][2] == (handle["a"],) and calls[3][2] == (handle["b"],)
        assert calls[4][2] == calls[5][2] == ("base",)
        # each adapter continues its own sequence (the other's tokens are disjoint), the base
        # does not: no adapter is the base or the other tenant's
        for t in samplers:
            assert alone[t] == [SEQS[t][len(p) : len(p) + 6] for p in PROMPTS[t]], (t, alone)
        assert alone["a"] != base_tokens, base_tokens

        # Together: both tenants' requests sent at once meet in one engine call.
        futs = {(t, i): samplers[t].sample(types.ModelInput.from_ints(p), 1, GREEDY)
                for t in samplers for i, p in enumerate(PROMPTS[t])}  # fmt: skip
        got = {k: _tokens([f])[0] for k, f in futs.items()}
        together = _batches(server)[len(calls) :]
        assert [(n, k) for n, k, _ in together] == [(4, 2)], together
        assert sorted(together[0][2]) == sorted([handle["a"]] * 2 + [handle["b"]] * 2)
        for t in samplers:
            assert [got[t, i] for i in range(len(PROMPTS[t]))] == alone[t]

        # A snapshot (save_weights_and_get_sampling_client): exported and loaded the same way.
        snap = trained["a"].save_weights_and_get_sampling_client().result()
        assert _tokens([snap.sample(types.ModelInput.from_ints(p), 1, GREEDY)
                        for p in PROMPTS["a"]]) == alone["a"]  # fmt: skip

        # Another tenant's sampler weights: not found, as if they did not exist.
        with pytest.raises(tinker.NotFoundError):
            clients["b"].create_sampling_client(model_path=paths["a"]).result()
        # Damaged sampler weights: refused (the manifest's check), never sampled as the base.
        tc = _train(clients["a"], SEQ, seed=3)
        bad = tc.save_weights_for_sampler("damaged").result().path
        f = server.tenant_dir() / tc.model_id / "sampler_weights" / "damaged"
        w = f / "adapter_model.safetensors"
        raw = bytearray(w.read_bytes())
        raw[-1] ^= 0x40
        w.write_bytes(bytes(raw))
        with pytest.raises(tinker.APIStatusError) as e:
            clients["a"].create_sampling_client(model_path=bad).result()
        assert e.value.status_code == 422, str(e.value)
        # Stop strings and prompt logprobs, as our generator gives them (compared with the
        # reference server below): a stop string inside the adapter's greedy continuation cuts
        # it where the generator would stop; prompt logprobs under the adapter.
        prompt = types.ModelInput.from_ints(PROMPTS["a"][0])
        stop = _stop_inside(alone["a"][0])
        cut = samplers["a"].sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0,
                                   stop=[stop])).result().sequences[0]  # fmt: skip
        assert cut.stop_reason == "stop" and len(cut.tokens) < 6, (stop, cut)
        assert list(cut.tokens) == alone["a"][0][: len(cut.tokens)]
        scored = _prompt_scores(samplers["a"], PROMPTS["a"][1])
        # Longer than the served context: refused before it is queued.
        with pytest.raises(tinker.APIStatusError) as e:
            samplers["a"].sample(prompt, 1, types.SamplingParams(max_tokens=10**6)).result()
        assert e.value.status_code == 400, str(e.value)
        for sc in clients.values():
            sc.close("success").result()
    finally:
        rc = server.stop()
    assert rc == 0, server.log_text()[-3000:]
    print(f"vllm server phase {time.monotonic() - t0:.0f} s")

    # The reference: our own generator on the same sampler weights (the same storage).
    ref = start_server(tmp_path / "native", storage=server.storage, keys=TWO_TENANTS)
    try:
        for t, key in (("a", KEY), ("b", KEY_B)):
            sc = tinker.ServiceClient(base_url=ref.url, api_key=key)
            smp = sc.create_sampling_client(model_path=paths[t]).result()
            ours = [_tokens([smp.sample(types.ModelInput.from_ints(p), 1, GREEDY)])[0]
                    for p in PROMPTS[t]]  # fmt: skip
            assert ours == alone[t], (t, ours, alone[t])
            if t == "a":
                mine = smp.sample(types.ModelInput.from_ints(PROMPTS["a"][0]), 1,
                                  types.SamplingParams(max_tokens=6, temperature=0.0,
                                                       stop=[stop])).result().sequences[0]  # fmt: skip
                assert list(mine.tokens) == list(cut.tokens) and mine.stop_reason == "stop"
                _same_scores(_prompt_scores(smp, PROMPTS["a"][1]), scored)
            sc.close("success").result()
    finally:
        assert ref.stop() == 0, ref.log_text()[-3000:]
