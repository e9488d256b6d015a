"""tools.packstats end to end, and our concat packer against torchtitan's own dataset."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from data.loader import PackedStream
from tests.helpers.runs import ROOT, python
from tests.helpers.tiny_data import ListSource, make_tokenizer_dir


def corpus(n: int = 60, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "x", "y", "(", ")"]
    return [" ".join(rng.choices(words, k=rng.randint(3, 400))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"), corpus(200, seed=9))


def test_packstats_cli_json(tmp_path, tok_dir):
    texts = corpus()
    data = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": t}) for t in texts] + ['{"text": ""}', "garbage"]
    data.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = str(tmp_path / "cache")
    cmd = [
        python(), "-m", "tools.packstats", "--data", str(data), "--tokenizer", tok_dir,
        "--seq-len", "128", "--packing", "bfd", "--window", "16", "--json",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("documents", "tokens", "sequences", "padding_fraction"):
        assert key in out
    assert out["documents"] == len(texts)
    assert out["bad_records"]["empty"] == 1 and out["bad_records"]["invalid_json"] == 1
    tok = HuggingFaceTokenizer(tokenizer_path=tok_dir)
    want = sum(len(tok.encode(t, add_bos=True, add_eos=True)) - 1 for t in texts)
    assert out["tokens"] == want
    assert out["sequences"] * 128 * (1 - out["padding_fraction"]) == pytest.approx(want)
    assert 0 < out["split_documents_fraction"] < 1 and out["tokens_per_sec"] > 0

    bad = subprocess.run(
        [*cmd[:4], str(tmp_path / "missing.jsonl"), *cmd[5:]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "does not exist" in bad.stderr


def test_concat_matches_torchtitan_dataset(tok_dir, monkeypatch):
    """Our concat packer yields exactly torchtitan's HuggingFaceTextDataset rows (theirs drop
    the final partial row; ours pads it)."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets as td

    texts = corpus()
    tok = HuggingFaceTokenizer(tokenizer_path=tok_dir)
    ds = Dataset.from_dict({"text": texts})
    monkeypatch.setitem(
        td.DATASETS,
        "tt_test",
        DatasetConfig(path="mem", loader=lambda _p: ds, sample_processor=lambda s: s["text"]),
    )
    theirs = list(td.HuggingFaceTextDataset("tt_test", None, tok, seq_len=64))
    ours = list(
        PackedStream(
            source=ListSource(texts),
            tokenizer=tok,
            seq_len=64,
            dp_rank=0,
            dp_world_size=1,
            packing="concat",
            infinite=False,
        )  # fmt: skip
    )
    assert len(theirs) > 20 and len(ours) == len(theirs) + 1
    for (a, la), (b, lb) in zip(theirs, ours, strict=False):
        assert torch.equal(a["input"], b["input"])
        assert torch.equal(la, lb)
        assert torch.equal(a["positions"], b["positions"])
    assert (ours[-1][1] == -100).any()
