"""SFT rendering, assistant-only labels, bfd packing of chat rows, bad records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.chat import (
    BadChat,
    ChatRenderer,
    decode_masked,
    embedded_segments,
    make_renderer,
    parse_record,
)
from data.loader import BadRecordError, PackedStream
from data.packing import IGNORE_INDEX
from data.sources import DatasetsSource
from tests.helpers.tiny_data import make_tokenizer_dir

CHATS = [
    {"messages": [{"role": "user", "content": f"add {i} and {i + 1}"},
                  {"role": "assistant", "content": str(2 * i + 1)}]}
    for i in range(30)
] + [
    {"prompt": "sort c a b", "completion": "a b c", "weight": 2.0},
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    texts = [json.dumps(c) for c in CHATS] * 3 + ["User: Assistant: System: \n"] * 5
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"), texts, vocab_size=300)


def test_parse_records_and_bad_reasons():
    ex = parse_record({"prompt": "p", "completion": "c", "weight": 3})
    assert [m["role"] for m in ex.messages] == ["user", "assistant"] and ex.weight == 3.0
    for obj, reason in [
        ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown_role"),
        ({"text": "x"}, "not_chat"),
        ([1, 2], "not_chat"),
        ({"prompt": "p", "completion": "c", "weight": -1}, "weight"),
    ]:
        with pytest.raises(BadChat) as e:
            parse_record(obj)
        assert e.value.reason == reason


def test_embedded_template_masks_exactly_the_assistant_text(tok_dir):
    r = make_renderer(tok_dir, "auto")
    assert r.template == "embedded"
    ex = parse_record(CHATS[-1])
    ids, trained = decode_masked(r.render(ex))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tok_dir}/tokenizer.json")
    # Independent reference: the trained tokens decode to the assistant contents + EOS each,
    # the prompt tokens to the documented template text around them.
    runs, cur, prev = [], [], None
    for i, t in zip(ids, trained, strict=True):
        if prev is not None and t != prev:
            runs.append((prev, cur))
            cur = []
        cur.append(int(i))
        prev = t
    runs.append((prev, cur))
    trained_text = [tok.decode(c, skip_special_tokens=False) for t, c in runs if t]
    prompt_text = [tok.decode(c, skip_special_tokens=False) for t, c in runs if not t]
    assert trained_text == ["hello</s>", "ciao</s>"]
    assert prompt_text == ["<s>System: be brief\nUser: hi\nAssistant: ", "User: bye\nAssistant: "]
    assert "".join(t for t, _ in embedded_segments(ex.messages, bos="<s>", eos="</s>")) == (
        "<s>System: be brief\nUser: hi\nAssistant: hello</s>User: bye\nAssistant: ciao</s>"
    )
    # The generation prompt is the training prompt (what a generator continues).
    first = parse_record({"prompt": "hi", "completion": "x"})
    arr = r.render(first)
    assert r.prompt_ids(first.messages[:1]) == [int(-1 - v) for v in arr if v < 0]


def test_hf_chat_template_incremental(tmp_path, tok_dir):
    import shutil

    d = tmp_path / "hf"
    shutil.copytree(tok_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = make_renderer(d, "auto")
    assert r.template == "hf"
    ids, trained = decode_masked(r.render(parse_record(CHATS[-1])))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(d))
    got = [hf.decode([int(i) for i, t in zip(ids, trained, strict=True) if t])]
    assert got == ["hellociao</s>".replace("ciao", "</s>ciao")]  # hello</s>ciao</s>


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _stream(path, tok_dir, seq_len=64, bad="skip", truncate=False):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return PackedStream(
        source=str(path),
        tokenizer=HuggingFaceTokenizer(tokenizer_path=tok_dir),
        seq_len=seq_len,
        dp_rank=0,
        dp_world_size=1,
        packing="bfd",
        window=16,
        bad_records=bad,
        infinite=False,
        renderer=make_renderer(tok_dir),
        truncate=truncate,
    )


def test_packed_chat_rows_have_labels_only_on_assistant_tokens(tmp_path, tok_dir):
    path = _write(tmp_path / "chat.jsonl", CHATS)
    r = make_renderer(tok_dir)
    s = _stream(path, tok_dir)
    assert isinstance(s.source, DatasetsSource)
    rows = list(iter(s))
    # Reference: each example's (input, label) pairs from its own rendering.
    want_pairs = []
    for c in CHATS:
        ids, trained = decode_masked(r.render(parse_record(c)))
        want_pairs += [
            (int(ids[k]), int(ids[k + 1]) if trained[k + 1] else IGNORE_INDEX)
            for k in range(len(ids) - 1)
        ]
    got_pairs = []
    for x, y in rows:
        inp, lab, pos = x["input"].numpy(), y.numpy(), x["positions"].numpy()
        starts = list(np.flatnonzero(pos == 0)) + [len(pos)]
        for a, b in zip(starts, starts[1:], strict=False):
            if (lab[a:b] == IGNORE_INDEX).all() and (inp[a:b] == s.pad_id).all():
                continue  # padding pseudo-document
            got_pairs += list(zip(inp[a:b].tolist(), lab[a:b].tolist(), strict=True))
    assert sorted(got_pairs) == sorted(want_pairs)
    assert len(rows) < len(CHATS)  # several examples share a row
    assert s.packing_stats()["bad_records_total"] == 0


def test_bad_chat_records_skipped_counted_or_fatal(tmp_path, tok_dir):
    rows = [
        *CHATS[:5],
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"prompt": "long " * 80, "completion": "x"},
        "not json",
    ]
    path = _write(tmp_path / "bad.jsonl", rows)
    s = _stream(path, tok_dir)
    list(iter(s))
    bad = s.packing_stats()["bad_records"]
    assert (bad["no_assistant"], bad["unknown_role"], bad["too_long"], bad["invalid_json"]) == (
        1, 1, 1, 1,
    )  # fmt: skip
    # truncate = true keeps the long one (cut to the row), still training on nothing else.
    s2 = _stream(path, tok_dir, truncate=True)
    list(iter(s2))
    assert s2.packing_stats()["bad_records"]["too_long"] == 1  # its completion was cut off
    with pytest.raises(BadRecordError, match="record 5 .*no_assistant"):
        list(iter(_stream(path, tok_dir, bad="fail")))


def test_renderer_rejects_template_that_rewrites_history():
    calls = {"n": 0}

    def render(msgs, add_generation_prompt):
        calls["n"] += 1
        # Drops earlier assistant turns when a later one exists (like some reasoning templates).
        body = "".join(
            m["content"]
            for i, m in enumerate(msgs)
            if m["role"] != "assistant" or i == len(msgs) - 1
        )
        return body + ("|" if add_generation_prompt else "")

    r = ChatRenderer(lambda t: [ord(c) for c in t], template="hf", hf_render=render)
    with pytest.raises(BadChat) as e:
        r.render(parse_record(CHATS[-1]))
    assert e.value.reason == "template"
