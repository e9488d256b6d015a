"""Hugging Face folders in and out: damage is one line before any process group; an export
never replaces another run's.

In (`checkpoint.load_hf`): a shard the index names but which is absent, a truncated
safetensors file, a garbage header, a tensor whose shape disagrees with config.json, a
missing tensor, a symlink loop and NaN weights all ended in tracebacks inside torchtitan's
load, and int8 weights were cast silently. Each is now one line from
`runtime.session.prepare` (through `runtime.hf.verify_hf_folder`) naming the file and the
expectation. The intact folder, a real export of the debug model (torchtitan's own HF writer,
resharded here into two files with an index), passes; so does a folder transformers writes.

Out (`checkpoint.export_hf`): a second run exporting the same step to the same
`export_folder` used to replace the first run's export silently. Now it is refused, at
prepare and at export time, and the first export is left byte for byte; the same run
exporting again (a resume) still may.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from core.errors import ConfigError
from runtime.hf import EXPORT_INFO, hf_expected, verify_hf_folder
from tools.reliability_report import record_case

LAYERS = ["model.layers=1"]


def _manager(tmp: Path, run: str, export: Path):
    from tests.helpers.checkpoints import make_export_manager

    return make_export_manager(tmp / run, export, init_std=0.02)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the HF folder, the model's expected HF tensors): one export of the debug model
    (1 layer), resharded into two safetensors files and an index."""
    tmp = tmp_path_factory.mktemp("hf")
    mgr, _, spec = _manager(tmp, "ckpt", tmp / "export")
    src = Path(mgr.export_hf(1))
    mgr.close()
    folder = tmp / "two_shards"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, folder / f)
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    wmap = {}
    for shard, part in half.items():
        save_file({n: tensors[n].contiguous() for n in part}, folder / shard)
        wmap.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    return folder, hf_expected(spec)


def _prepare(folder: Path, tmp: Path):
    from runtime import session

    return session.prepare(None, [*LAYERS, f"checkpoint.load_hf={folder}",
                                  f"job.output_dir={tmp / 'run'}"])  # fmt: skip


def _edit(folder: Path, shard: str, fn) -> None:
    t = load_file(folder / shard)
    fn(t)
    save_file(t, folder / shard)


def _drop_first_tensor(folder: Path) -> None:
    """A tensor absent from the files and from the index (a consistent but partial folder)."""
    index = folder / "model.safetensors.index.json"
    wmap = json.loads(index.read_text())["weight_map"]
    gone = sorted(load_file(folder / _first(folder)))[0]
    _edit(folder, _first(folder), lambda t: t.pop(gone))
    index.write_text(json.dumps({"weight_map": {k: v for k, v in wmap.items() if k != gone}}))


def _first(folder: Path | None) -> str:
    return "model-00001-of-00002.safetensors"


DAMAGE = {
    # name: (damage, words the message must hold)
    "index names an absent shard": (
        lambda d: (d / "model-00002-of-00002.safetensors").unlink(),
        ["model-00002-of-00002.safetensors", "absent"],
    ),
    "truncated safetensors": (
        lambda d: (d / _first(d)).write_bytes((d / _first(d)).read_bytes()[:5000]),
        [_first(None), "truncated"],
    ),
    "garbage header": (
        lambda d: (d / _first(d)).write_bytes(
            b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage!" + (d / _first(d)).read_bytes()[17:]
        ),  # fmt: skip
        [_first(None), "garbage header"],
    ),
    "not safetensors at all": (
        lambda d: (d / _first(d)).write_bytes(os.urandom(4096)),
        [_first(None)],
    ),
    "shape disagrees with config.json": (
        lambda d: _edit(
            d,
            _first(d),
            lambda t: t.update({k: v[:, :128].contiguous() for k, v in t.items() if v.dim() == 2}),
        ),  # fmt: skip
        ["config.json and the model give"],
    ),
    "missing tensor": (lambda d: _drop_first_tensor(d), ["is in no *.safetensors file"]),
    "symlink loop": (
        lambda d: (d / "extra.safetensors").symlink_to(d / "extra.safetensors"),
        ["extra.safetensors cannot be opened"],
    ),
    "NaN weights": (
        lambda d: _edit(
            d, _first(d), lambda t: [v.view(-1).__setitem__(3, float("nan")) for v in t.values()]
        ),  # fmt: skip
        ["NaN or infinite values"],
    ),
    "int8 weights": (
        lambda d: _edit(
            d, _first(d), lambda t: t.update({k: v.to(torch.int8) for k, v in t.items()})
        ),  # fmt: skip
        ["is I8", "without their scales"],
    ),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_hf_folder_is_one_line_before_the_process_group(tmp_path, exported, name):
    folder, expected = exported
    d = tmp_path / "hf"
    shutil.copytree(folder, d, symlinks=True)
    damage, words = DAMAGE[name]
    damage(d)
    with pytest.raises(ConfigError) as e:
        verify_hf_folder(str(d), expected, file="r.toml")
    msg = str(e.value)
    assert e.value.key == "checkpoint.load_hf" and str(d) in msg and "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    record_case("HF load", name)


def test_through_prepare(tmp_path, exported):
    """What train.py runs: prepare passes the intact folder and refuses a damaged one."""
    folder, _ = exported
    _prepare(folder, tmp_path)
    d = tmp_path / "nan"
    shutil.copytree(folder, d)
    DAMAGE["NaN weights"][0](d)
    with pytest.raises(ConfigError, match=r"checkpoint\.load_hf: .*NaN or infinite"):
        _prepare(d, tmp_path)
    record_case("HF load", "NaN weights (prepare)")


def test_value_scan_is_shared_between_ranks(tmp_path, exported):
    """Each rank scans a 1/world share: across the ranks every tensor is scanned once."""
    folder, expected = exported
    d = tmp_path / "hf"
    shutil.copytree(folder, d)
    DAMAGE["NaN weights"][0](d)  # every tensor of the first shard holds a NaN
    refused = 0
    for rank in range(3):
        try:
            verify_hf_folder(str(d), expected, file=None, rank=rank, world=3)
        except ConfigError:
            refused += 1
    assert refused >= 2  # the first shard's tensors are spread over the ranks


def test_a_folder_transformers_wrote_passes(tmp_path):
    """No false refusal: transformers' own save of the debug shape (1 layer, tied qwen3
    embeddings: no lm_head tensor) passes against the model's expected tensors."""
    import transformers

    from recipe.loader import load_recipe
    from runtime.build import recipe_model_spec
    from tests.helpers.hf_reference import QWEN3_DEBUG

    cfg = transformers.Qwen3Config(**{**QWEN3_DEBUG, "num_hidden_layers": 1})
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "q")
    spec = recipe_model_spec(load_recipe(None, ["model.family=qwen3", *LAYERS]))
    verify_hf_folder(str(tmp_path / "q"), hf_expected(spec), file=None)


# -- out ---------------------------------------------------------------------------------------
def test_second_run_never_replaces_the_first_runs_export(tmp_path):
    from runtime import session

    export = tmp_path / "shared_hf"
    a, _, _ = _manager(tmp_path, "run_a", export)
    first = Path(a.export_hf(1))
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    b, model, _ = _manager(tmp_path, "run_b", export)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # run B's weights differ
    with pytest.raises(ConfigError) as e:
        b.export_hf(1)
    msg = str(e.value)
    assert e.value.key == "checkpoint.export_folder" and "another run's" in msg, msg
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert sorted(os.listdir(export)) == ["step-1"]
    assert json.loads((first / EXPORT_INFO).read_text())["run"] == str(tmp_path / "run_a")
    a.export_hf(1)  # the same run exporting its step again (a resume) may
    a.close()
    b.close()
    record_case("HF export", "second run, same step (export time)")
    # Before the run starts: a recipe whose last step is already another run's export.
    with pytest.raises(ConfigError, match=r"checkpoint\.export_folder: .*another run's"):
        session.prepare(None, [*LAYERS, "training.steps=1", "training.warmup_steps=0",
                               "checkpoint.export_hf=true",
                               f"checkpoint.export_folder={export}",
                               f"job.output_dir={tmp_path / 'run_c'}"])  # fmt: skip
    (export / "step-1" / EXPORT_INFO).unlink()
    with pytest.raises(ConfigError, match="not a titanscale export of this run"):
        session.prepare(None, [*LAYERS, "training.steps=1", "training.warmup_steps=0",
                               "checkpoint.export_hf=true",
                               f"checkpoint.export_folder={export}",
                               f"job.output_dir={tmp_path / 'run_c'}"])  # fmt: skip
    record_case("HF export", "second run, same step (prepare)", n=2)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    how=st.sampled_from(["flip", "cut", "zero"]),
    at=st.floats(0.0, 0.999),
    n=st.integers(1, 64),
)
def test_fuzzed_damage_refused_or_loadable(tmp_path_factory, exported, how, at, n):
    """Any byte damage to a shard: refused in one line, or the folder is one that loads
    (reference: safetensors' own reader) with the model's shapes and finite values only.
    Bit flips that keep values finite are not detectable: HF folders carry no checksums."""
    from safetensors import safe_open

    folder, expected = exported
    d = tmp_path_factory.mktemp("fz") / "hf"
    shutil.copytree(folder, d)
    p = d / _first(d)
    b = bytearray(p.read_bytes())
    i = int(len(b) * at)
    if how == "cut":
        b = b[:i]
    else:
        for j in range(i, min(i + n, len(b))):
            b[j] = 0 if how == "zero" else b[j] ^ 0xFF
    p.write_bytes(bytes(b))
    try:
        verify_hf_folder(str(d), expected, file=None)
    except ConfigError as e:
        assert str(d) in str(e) and "\n" not in str(e), str(e)
        record_case("HF load", "fuzzed damage (refused)")
        return
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            names = list(sf.keys())  # safe_open is not iterable
            for k in names:
                t = sf.get_tensor(k)
                assert tuple(t.shape) == expected[k] and torch.isfinite(t).all(), k
    record_case("HF load", "fuzzed damage (loadable)")
