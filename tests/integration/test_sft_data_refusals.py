"""SFT data the loader cannot serve is refused at launch: one line naming the key, exit 2,
no process group (before, a [[data.sources]] mix failed after it on "no usable documents")."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import ROOT, train_main_error
from tests.helpers.tiny_data import ListSource, make_tokenizer_dir

TRAIN = ROOT / "data/tasks/letter_sort/train.jsonl"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    from data.store import prepare

    d = tmp_path_factory.mktemp("store")
    texts = [f"sort: {' '.join('dcba'[: i % 4 + 1])}" for i in range(40)]
    tok = make_tokenizer_dir(d / "tok", texts)
    prepare(ListSource(texts), tokenizer_dir=tok, tokenizer_spec="test", out=d / "s",
            fingerprint="fp", progress=False)  # fmt: skip
    return str(d / "s")


def _recipe(tmp_path, body: str) -> str:
    path = tmp_path / "r.toml"
    path.write_text(f'base = "{ROOT}/recipes/sft_debug.toml"\n[checkpoint]\nload_from = ""\n{body}')
    return str(path)


CASES = {
    "mix": ('[[data.sources]]\nsource = "{train}"\nweight = 2.0\n', "data.sources",
            "mixes are not supported for sft"),
    "store": ('[data]\nsource = "{store}"\n', "data.source", "is a prepared token store"),
    "adapter_store": ('[[adapters]]\nname = "a"\nsource = "{store}"\n', "adapters[0].source",
                      "is a prepared token store"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_sft_data_refused_in_one_line(tmp_path, capsys, store, case):
    body, key, words = CASES[case]
    if case == "mix":  # data.source back to its default so the mix is the only source
        body = '[data]\nsource = "stdlib"\n' + body
    recipe = _recipe(tmp_path, body.format(train=TRAIN, store=store))
    code, err = train_main_error(["--recipe", recipe], capsys)
    assert code == 2 and len(err) == 1, err
    assert f": {key}: " in err[0] and words in err[0], err
    assert not torch.distributed.is_initialized()
