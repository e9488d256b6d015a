"""Tier 1: the recipe contract — inheritance, overrides, and every validation error."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError
from core.typed_toml import describe
from recipe.loader import check_recipe, load_recipe
from recipe.schema import Recipe
from tests.helpers.runs import ROOT


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def error(fn, *a, **k) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        fn(*a, **k)
    return e.value


def test_defaults_and_docs():
    r = load_recipe(ROOT / "recipes" / "debug.toml")
    assert r.model.flavor == "debugmodel"
    assert check_recipe(r, 2).dp_shard == 2
    # every field is documented
    for key, _tp, _default, doc in describe(Recipe):
        assert doc, f"{key} has no doc"


def test_base_inheritance_deep_merge(tmp_path):
    write(tmp_path, "a.toml", '[training]\nsteps = 7\nlr = 1e-3\n[job]\nname = "a"\n')
    sub = tmp_path / "sub"
    sub.mkdir()
    b = write(sub, "b.toml", 'base = "../a.toml"\n[training]\nlr = 2e-3\n')
    r = load_recipe(b)
    assert r.training.steps == 7 and r.training.lr == 2e-3 and r.job.name == "a"


def test_base_cycle_and_missing(tmp_path):
    write(tmp_path, "x.toml", 'base = "y.toml"\n')
    y = write(tmp_path, "y.toml", 'base = "x.toml"\n')
    e = error(load_recipe, y)
    assert "cycle" in str(e) and e.key == "base"
    m = write(tmp_path, "m.toml", 'base = "nope.toml"\n')
    e = error(load_recipe, m)
    assert "nope.toml" in str(e) and str(m) in str(e)


def test_overrides_are_typed():
    r = load_recipe(None, ["training.steps=3", "training.lr=0.01", "training.compile=true",
                           "job.description=x y"])  # fmt: skip
    assert r.training.steps == 3 and r.training.lr == 0.01 and r.training.compile is True
    assert r.job.description == "x y"
    e = error(load_recipe, None, ["parallel.tp=two"])
    assert e.key == "parallel.tp" and "integer" in str(e)
    e = error(load_recipe, None, ["training.stpes=3"])
    assert "did you mean 'steps'" in str(e)
    e = error(load_recipe, None, ["training.steps"])
    assert "section.key=value" in str(e)


def test_unknown_keys_and_sections(tmp_path):
    p = write(tmp_path, "r.toml", "[trainig]\nsteps = 3\n")
    e = error(load_recipe, p)
    assert e.file == str(p) and e.key == "trainig" and "did you mean 'training'" in str(e)
    p = write(tmp_path, "r2.toml", "[training]\nseq_lne = 3\n")
    e = error(load_recipe, p)
    assert e.key == "training.seq_lne" and "seq_len" in str(e)


@pytest.mark.parametrize(
    "text,key,words",
    [
        ('[training]\nsteps = "ten"\n', "training.steps", "integer"),
        ("[training]\nsteps = -1\n", "training.steps", "positive"),
        ("[training]\nlr = true\n", "training.lr", "number"),
        ('[training]\ndtype = "fp16"\n', "training.dtype", "one of"),
        ('[model]\nflavor = "7B"\n', "model.flavor", "unknown llama3 flavor"),
        ("[parallel]\ntp = 0\n", "parallel.tp", "positive"),
        ("[checkpoint]\nkeep_latest = 1\n", "checkpoint.keep_latest", "at least 2"),
        ("[training]\nsteps = 5\nwarmup_steps = 9\n", "training.warmup_steps", "exceeds"),
        ("[training]\nsteps = 99999999999999999999\n", "training.steps", "out of range"),
    ],
)
def test_type_and_value_errors(tmp_path, text, key, words):
    p = write(tmp_path, "r.toml", text)
    e = error(load_recipe, p)
    assert e.file == str(p)
    if key:
        assert e.key == key, str(e)
    assert words in str(e), str(e)


def test_toml_syntax_error_has_position(tmp_path):
    p = write(tmp_path, "r.toml", "[training]\nsteps = = 3\n")
    e = error(load_recipe, p)
    assert "line 2" in str(e)


def test_non_utf8(tmp_path):
    p = tmp_path / "r.toml"
    p.write_bytes(b'[job]\nname = "\xff\xfe"\n')
    e = error(load_recipe, p)
    assert "UTF-8" in str(e) and "line 2" in str(e)


@pytest.mark.parametrize(
    "overrides,world,key,words",
    [
        (["parallel.tp=3", "parallel.dp_shard=1"], 3, "parallel.tp", "heads"),
        (["parallel.tp=2", "parallel.dp_shard=2"], 2, "parallel.dp_shard", "world size is 2"),
        (["parallel.tp=3"], 4, "parallel.dp_shard", "does not divide"),
        (["parallel.pp=5", "training.local_batch_size=5"], 5, "parallel.pp", "split evenly"),
        (["training.global_batch_size=6"], 4, "training.global_batch_size", "multiple"),
        (
            ["parallel.pp=2", "parallel.pp_microbatches=3", "training.local_batch_size=4"],
            2,
            "parallel.pp_microbatches",
            "divide",
        ),  # fmt: skip
        (["parallel.world_size=8"], 2, "parallel.world_size", "declares 8"),
        (["training.seq_len=130", "parallel.tp=4"], 4, "training.seq_len", "divisible"),
    ],
)
def test_cross_section_errors(overrides, world, key, words):
    r = load_recipe(None, overrides)
    e = error(check_recipe, r, world)
    assert e.key == key, str(e)
    assert words in str(e), str(e)
    assert "debug.toml" in str(e)


def test_model_slice_layers():
    from recipe.loader import effective_shape

    r = load_recipe(None, ["model.flavor=70B", "model.layers=4", "parallel.tp=8"])
    assert effective_shape(r).n_layers == 4 and effective_shape(r).dim == 8192
    check_recipe(r, 8)
    e = error(check_recipe, load_recipe(None, ["model.layers=7"]), 1)
    assert e.key == "model.layers" and "6 layers" in str(e)
