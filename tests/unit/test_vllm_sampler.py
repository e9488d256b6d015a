"""service/vllm_sampler.py without vLLM: a stand-in engine records what `EngineSampler` sends.
Concurrent requests of two adapters go in one engine call (logged and kept in `batches`),
unknown weights 404, a request beyond the engine's KV cache 413, a rank above the engine's
400, a folder the engine refuses 422; the backend's engine path cuts samples at stop strings
with the served tokenizer (a 400 without one), lays the engine's prompt logprobs out as the
wire's fields and zeroes greedy logprobs (the generator's)."""

from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from rl.generator import SamplingParams
from rl.vllm_engine import EngineError
from service.errors import ServiceError
from service.vllm_sampler import EngineSampler


class FakeEngine:
    def __init__(self, workdir: str, kv: int = 1000) -> None:
        self.info = {"kv_cache_tokens": kv}
        self.cfg = SimpleNamespace(max_lora_rank=8)
        self.workdir = workdir
        self.proc = SimpleNamespace(poll=lambda: None)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.refuse_add = False
        self.gate: threading.Event | None = None  # set: generate waits for it
        self.generating = threading.Event()

    def call(self, op: str, **kw: Any) -> Any:
        self.calls.append((op, kw))
        if op == "generate" and self.gate is not None:
            self.generating.set()
            self.gate.wait(10)
        if op == "add_lora" and self.refuse_add:
            raise EngineError(f"vLLM engine: add_lora: bad folder {kw['path']}")
        if op == "generate":
            return [[{"tokens": [len(r["prompt"]), 7], "logprobs": [-0.5, -0.25],
                      "finish": "length", **self._scored(r)}] for r in kw["requests"]]  # fmt: skip
        return True

    @staticmethod
    def _scored(r: dict[str, Any]) -> dict[str, Any]:
        """A scored request: position t's own logprob -t/10, its top k ids 100+t+j with
        logprob -j/100 (rl/vllm_server.py's layout)."""
        k = r.get("prompt_logprobs")
        if k is None:
            return {}
        P = len(r["prompt"])
        return {"prompt": [-t / 10 for t in range(1, P)],
                "prompt_top": [[[100 + t + j for j in range(k)], [-j / 100 for j in range(k)]]
                               for t in range(1, P)]}  # fmt: skip


class Pad:
    def pad(self, t: dict) -> dict:
        return t


def _peft(folder, rank: int = 8) -> str:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16}))
    save_file({"x.lora_A.weight": torch.zeros(rank, 4)}, str(folder / "adapter_model.safetensors"))
    return str(folder)


@pytest.fixture
def sampler(tmp_path):
    eng = FakeEngine(str(tmp_path / "engine"))
    (tmp_path / "engine").mkdir()
    s = EngineSampler(eng, Pad(), window_s=0.5)  # type: ignore[arg-type]
    yield s, eng
    s.close()


def test_two_adapters_in_one_engine_call(sampler, tmp_path, caplog):
    s, eng = sampler
    s.add_adapter("h-a", _peft(tmp_path / "a"))
    s.add_adapter("h-b", _peft(tmp_path / "b"))
    assert [c[0] for c in eng.calls] == ["add_lora", "add_lora"]
    got: dict[str, list] = {}
    start = threading.Barrier(3)

    def client(h: str | None, n: int) -> None:
        start.wait()
        got[str(h)] = s.sample(h, [1] * n, SamplingParams(max_tokens=2), ignore_eos=True)

    with caplog.at_level(logging.INFO, logger="service"):
        ths = [threading.Thread(target=client, args=a) for a in (("h-a", 3), ("h-b", 5), (None, 2))]
        for t in ths:
            t.start()
        for t in ths:
            t.join(10)
    assert s.batch_sizes == [3] and sorted(s.batches[0]) == ["base", "h-a", "h-b"]
    assert "service.engine_batch requests=3 adapters=3" in caplog.text
    assert got["h-a"][0]["tokens"] == [3, 7] and got["h-b"][0]["tokens"] == [5, 7]
    reqs = eng.calls[-1][1]["requests"]
    assert all(r["ignore_eos"] for r in reqs)
    assert {r["lora"][0] if r["lora"] else None for r in reqs} == {"h-a", "h-b", None}
    # unknown weights, too long for the KV cache (x n), a rank the engine does not take
    with pytest.raises(ServiceError) as e:
        s.sample("h-c", [1], SamplingParams(max_tokens=2))
    assert e.value.status == 404
    with pytest.raises(ServiceError) as e:
        s.sample("h-a", [1] * 10, SamplingParams(max_tokens=90, n=11))
    assert e.value.status == 413
    with pytest.raises(ServiceError) as e:
        s.add_adapter("h-d", _peft(tmp_path / "d", rank=16))
    assert e.value.status == 400 and e.value.field == "lora_config.rank"
    eng.refuse_add = True
    with pytest.raises(ServiceError) as e:
        s.add_adapter("h-e", _peft(tmp_path / "e"))
    assert e.value.status == 422 and str(tmp_path) not in e.value.message
    s.drop_adapter("h-a")
    assert eng.calls[-1][0] == "remove_lora"
    with pytest.raises(ServiceError) as e:
        s.sample("h-a", [1], SamplingParams(max_tokens=2))
    assert e.value.status == 404


def test_a_sampler_freed_mid_request_leaves_the_engine_after_it(sampler, tmp_path):
    """Freeing a sampling client while its request is in the engine: new requests 404 at
    once, the engine forgets the adapter only after that request returned (a batch other
    tenants share never meets a removed adapter)."""
    s, eng = sampler
    s.add_adapter("h-a", _peft(tmp_path / "a"))
    eng.gate = threading.Event()
    out: list = []
    th = threading.Thread(target=lambda: out.append(s.sample("h-a", [1], SamplingParams())))
    th.start()
    assert eng.generating.wait(10)
    s.drop_adapter("h-a")
    assert "remove_lora" not in [c[0] for c in eng.calls]
    with pytest.raises(ServiceError) as e:
        s.sample("h-a", [1], SamplingParams())
    assert e.value.status == 404
    eng.gate.set()
    th.join(10)
    assert out and [c[0] for c in eng.calls][-1] == "remove_lora"
    assert not (tmp_path / "engine" / "sampler-1").exists()


def test_backend_engine_path_stop_strings_prompt_logprobs_and_greedy(sampler):
    from service.titan_backend import TitanLoraBackend
    from service.types import SamplingParams as SP

    s, eng = sampler
    b = TitanLoraBackend.__new__(TitanLoraBackend)
    b.engine, b.eos_ids, b._tokenizer = s, (2,), None
    with pytest.raises(ServiceError) as e:
        b.sample(None, [1, 2], 1, SP(max_tokens=2, stop_strings=("x",)), prompt_logprobs=False)
    assert e.value.status == 400 and e.value.field == "sampling_params.stop"
    # the stand-in engine samples [len(prompt), 7]: with prompt [1, 2] that decodes "b", "h"
    b._tokenizer = SimpleNamespace(decode=lambda ids, **_: "".join(chr(96 + i) for i in ids))
    cut = b.sample(None, [1, 2], 1, SP(max_tokens=2, stop_strings=("b",)), prompt_logprobs=False)
    (seq,) = cut.sequences
    assert (
        seq.tokens.tolist() == [2] and seq.logprobs.tolist() == [-0.5] and seq.stop_reason == "stop"
    )
    whole = b.sample(None, [1, 2], 1, SP(max_tokens=2, stop_strings=("hb", "q")),
                     prompt_logprobs=False).sequences[0]  # fmt: skip
    assert whole.tokens.tolist() == [2, 7] and whole.stop_reason == "length"
    # prompt logprobs: the engine is asked for k and its answer laid out as the wire's
    res = b.sample(None, [1, 2, 3], 1, SP(max_tokens=2), prompt_logprobs=True,
                   topk_prompt_logprobs=2)  # fmt: skip
    assert eng.calls[-1][1]["requests"][0]["prompt_logprobs"] == 2
    np.testing.assert_allclose(res.prompt_logprobs, [np.nan, -0.1, -0.2], equal_nan=True)
    ids, lps = res.topk_prompt
    assert ids.tolist() == [[0, 0], [101, 102], [102, 103]]
    np.testing.assert_allclose(lps, [[-99999.0, -99999.0], [0, -0.01], [0, -0.01]])
    last = b.sample(None, [1, 2, 3], 1, SP(max_tokens=2), prompt_logprobs=True,
                    prompt_logprobs_last_n=1)  # fmt: skip
    np.testing.assert_allclose(last.prompt_logprobs, [np.nan, np.nan, -0.2], equal_nan=True)
    assert last.topk_prompt is None
    plain = b.sample(None, [1, 2], 1, SP(max_tokens=2), prompt_logprobs=False)
    assert eng.calls[-1][1]["requests"][0]["prompt_logprobs"] is None
    assert plain.prompt_logprobs is None
    greedy = b.sample(None, [1, 2], 1, SP(max_tokens=2, temperature=0.0), prompt_logprobs=False)
    warm = b.sample(None, [1, 2], 1, SP(max_tokens=2, temperature=1.0), prompt_logprobs=False)
    assert np.array_equal(greedy.sequences[0].logprobs, [0.0, 0.0])  # the generator's point mass
    assert np.allclose(warm.sequences[0].logprobs, [-0.5, -0.25])
    assert b.detached_sampling
