"""runtime.hf.write_hf_weights, the one writer of full and merged Hugging Face exports: the
files it lays out against what safetensors reads back and the index names.

With the state-dict adapter's fqn_to_index_mapping the tensors land in the files it names
(model-0000i-of-0000n.safetensors), a tensor it does not name (a merged export's untied
lm_head of a tied model) in the last one; without a mapping, one file. The reference is
safetensors' own reader and the mapping itself, not the writer's code.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from runtime.hf import INDEX_FILE, write_hf_weights


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g),
        "lm_head.weight": torch.randn(8, 4, generator=g),
    }


def _read(folder) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(weight_map of the index, every tensor of every *.safetensors file)."""
    wmap = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in load_file(f).items():
            assert k not in tensors and wmap[k] == f.name, (k, f.name)
            tensors[k] = v
    return wmap, tensors


def test_sharded_per_the_mapping_and_an_unmapped_tensor_in_the_last_file(tmp_path):
    state = _state()
    # As a tied model's index: no lm_head.weight.
    mapping = {"model.embed_tokens.weight": 1, "model.layers.0.mlp.up_proj.weight": 2,
               "model.norm.weight": 2}  # fmt: skip
    write_hf_weights(str(tmp_path), state, mapping, single_process=True)
    wmap, got = _read(tmp_path)
    name = "model-{:05d}-of-00002.safetensors".format
    assert wmap == {**{k: name(i) for k, i in mapping.items()}, "lm_head.weight": name(2)}
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    assert not (tmp_path / "sharded").exists()  # the writer's per-rank files are gone


def test_without_a_mapping_one_consolidated_file(tmp_path):
    state = _state()
    write_hf_weights(str(tmp_path), state, None, single_process=True)
    wmap, got = _read(tmp_path)
    assert set(wmap.values()) == {"model-00001-of-00001.safetensors"}
    assert all(torch.equal(got[k], v) for k, v in state.items()) and got.keys() == state.keys()
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {INDEX_FILE, "model-00001-of-00001.safetensors"}
