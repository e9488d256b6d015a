"""The service's sampling request semantics (Tinker's stop / max_tokens / top_k rules), the
stability records stable_reinforce trains on, and the served base's name, context and memory
checks (no model, no HTTP)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.errors import ConfigError
from service import wire
from service.errors import ServiceError
from service.proto import Span
from service.sampling import StabilityRecords, recorded_logprobs, sample_request


def body(**sp) -> wire.SampleBody:
    extra = {k: sp.pop(k) for k in list(sp) if k in ("topk_prompt_logprobs", "prompt_logprobs")}
    raw = {"prompt": {"chunks": [{"tokens": [1, 2, 3, 4]}]}, "sampling_params": sp, **extra}
    return wire.parse(wire.SampleBody, json.dumps(raw).encode())


def req(**sp):
    return sample_request(body(**sp), vocab=100, max_context=32, max_samples=8)


def test_json_body_stays_lenient():  # unknown fields (newer SDKs) are ignored
    raw = {"prompt": {"chunks": [{"tokens": [1]}]}, "sampling_params": {}, "future_field": 1}
    assert wire.parse(wire.SampleBody, json.dumps(raw).encode()).num_samples == 1


def test_stop_and_max_tokens_follow_tinker():
    none = req().params
    assert none.stop_tokens is None and none.stop_strings == () and none.stop_eos
    assert none.max_tokens == 32 - 4  # max_tokens=None: up to the context
    empty = req(stop=[]).params
    assert empty.stop_tokens == () and not empty.stop_eos  # stop=[]: not even EOS
    strs = req(stop="\n\nUser:").params
    assert strs.stop_strings == ("\n\nUser:",) and strs.stop_eos
    ids = req(stop=[7, 9], max_tokens=5, top_k=3).params
    assert ids.stop_tokens == (7, 9) and ids.max_tokens == 5 and ids.top_k == 3


@pytest.mark.parametrize(
    "sp,field",
    [
        ({"max_tokens": 29}, "sampling_params.max_tokens"),  # 4 + 29 > 32
        ({"top_k": 0}, "sampling_params.top_k"),
        ({"stop": [1, "x"]}, "sampling_params.stop"),
        ({"stop": [""]}, "sampling_params.stop"),
        ({"stop": [100]}, "sampling_params.stop"),  # outside the vocabulary
        ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
    ],
)
def test_bad_sampling_requests_name_their_field(sp, field):
    with pytest.raises(ServiceError) as e:
        req(**sp)
    assert e.value.status == 400 and e.value.message.startswith(field)


def test_stable_reinforce_reads_the_recorded_sampler_logprobs():
    recs = StabilityRecords()
    prompt = np.int64([5, 6, 7])
    recs.add("s-a", "q0", prompt, np.int64([8, 9]), np.float32([-0.5, -1.5]))
    spans = [Span("prompt", "q0", 1, 2), Span("sampled", "q0", 0, 2)]
    q, sampled = recorded_logprobs(recs, "s-a", spans, np.int64([6, 7, 8, 9]), where="data[0]")
    np.testing.assert_array_equal(q, np.float32([0, 0, -0.5, -1.5]))
    np.testing.assert_array_equal(sampled, np.float32([0, 0, 1, 1]))
    bad = [
        (spans, np.int64([6, 7, 8, 1]), "differ"),  # the target is not what was sampled
        (spans, np.int64([6, 7, 8]), "cover"),  # the spans do not tile the targets
        ([Span("sampled", "q0", 1, 2)], np.int64([9, 9]), "runs past"),
        (None, np.int64([6]), "provenance"),
        ([Span("prompt", "q0", 0, 1)], np.int64([5]), "no sampled tokens"),
    ]
    for sp, targets, why in bad:
        with pytest.raises(ServiceError, match=why):
            recorded_logprobs(recs, "s-a", sp, targets, where="data[0]")
    with pytest.raises(ServiceError, match="no stability record"):  # another session's
        recorded_logprobs(recs, "s-b", spans, np.int64([6, 7, 8, 9]), where="data[0]")
    recs.drop_session("s-a")
    assert len(recs) == 0


def test_records_expire_and_are_bounded():
    recs = StabilityRecords(ttl_s=-1.0, max_per_session=2)
    for i in range(3):
        recs.add("s", f"q{i}", np.int64([1]), np.int64([2]), np.float32([-1]))
    assert len(recs) == 2  # the oldest went first
    with pytest.raises(ServiceError, match="no stability record"):  # expired
        recs.get("s", "q2", "f")


def test_served_base_name_context_and_memory(tmp_path):
    from tokenizers import Tokenizer

    from recipe.loader import load_recipe
    from service.served_base import hf_name, resolve_served_base, served_bytes

    snap = tmp_path / "hub" / "models--Qwen--Qwen3-8B-Base" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert hf_name(str(snap), {}) == "Qwen/Qwen3-8B-Base"
    assert hf_name(str(tmp_path), {"_name_or_path": "meta-llama/Llama-3.1-8B"}) == (
        "meta-llama/Llama-3.1-8B"
    )
    assert hf_name(str(tmp_path), {"_name_or_path": str(tmp_path)}) is None

    r = load_recipe("recipes/debug.toml", ["model.layers=2", "training.seq_len=64"])
    big = 1 << 40
    base = resolve_served_base(r, device_bytes=big)
    assert base.name == "titanscale/debug" and base.context == 64 and base.hf_folder is None
    # no Hugging Face name: clients are told the served name, never this machine's path
    # (they fetch the files with tools.tokenizer)
    assert base.tokenizer_id == "titanscale/debug" and base.tokenizer_dir not in base.tokenizer_id
    tok = Tokenizer.from_file(f"{base.tokenizer_dir}/tokenizer.json")
    assert base.eos_ids == (tok.token_to_id("<|end_of_text|>"),)  # the embedded tokenizer's
    assert resolve_served_base(r, context=4096, device_bytes=big).context == 4096
    with pytest.raises(ConfigError, match="RoPE") as e:  # llama3 debugmodel: 131072 positions
        resolve_served_base(r, context=131073, device_bytes=big)
    assert e.value.key == "--context"
    from recipe.loader import effective_shape

    need = served_bytes(effective_shape(r), "float32", 4096, 64)
    with pytest.raises(ConfigError, match="GiB") as e:
        resolve_served_base(r, context=4096, device_bytes=need - 1)
    assert e.value.key == "--context"
    assert resolve_served_base(r, context=4096, device_bytes=need).context == 4096
    named = resolve_served_base(r, name="acme/tiny", tokenizer_id="acme/tok", device_bytes=big)
    assert (named.name, named.tokenizer_id) == ("acme/tiny", "acme/tok")


def test_kv_cache_bytes_is_what_the_generator_allocates():
    from rl.generator import Generator, kv_cache_bytes
    from tests.helpers.tiny_llama import tiny_qwen3

    gen = Generator(tiny_qwen3())
    *_, cache = gen._prefill_inputs([[1, 2, 3], [4, 5]], 10)
    allocated = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
    a = next(iter(gen.model.layers.values())).attention
    assert allocated == kv_cache_bytes(len(cache.k), a.n_kv_heads, a.head_dim, 2, 10, 4)


@pytest.mark.parametrize(
    "extra,key,case",
    [
        (["--context", "200000"], "--context", "context beyond the RoPE table"),
        (["--context", "1"], "--context", "context under 2 tokens"),
        (["--base-name", " "], "--base-name", "blank base name"),
        ([], "checkpoint.load_hf", "Hugging Face folder of another shape"),
    ],
)
def test_tools_serve_refuses_bad_base_options_in_one_line(extra, key, case, tmp_path, capsys):
    from core.errors import exit_on_config_error
    from tools import serve
    from tools.reliability_report import record_case

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 9}))
    (hf / "model.safetensors").write_bytes(b"")
    argv = ["--set", f"job.output_dir={tmp_path}", "--port", "65000", *extra]
    if key == "checkpoint.load_hf":
        argv += ["--set", f"checkpoint.load_hf={hf}"]
    with pytest.raises(SystemExit) as e:
        exit_on_config_error(serve.main)(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert e.value.code == 2 and len(err) == 1 and f" {key}: " in err[0], err
    record_case("tools.serve", case)
