"""Environment errors end before the first step: exit 2, one line naming the key.

Through `train.main` in-process (the same code path as `python train.py`, without paying
for a subprocess): unwritable output folders, a full disk (shutil.disk_usage patched: no
root needed), missing or invalid tokenizers, missing data, a world size that doesn't
match the recipe, missing or damaged checkpoints to start from, checkpoints that would be
overwritten, a malformed fault-injection variable. In each case no metrics file appears:
training never started.
"""

from __future__ import annotations

import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

import train
from tools.reliability_report import record

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def env():
    saved = dict(os.environ)
    for k in (*LAUNCH_VARS, "TITANSCALE_FAULT"):
        os.environ.pop(k, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def fails(capsys, out: Path, *overrides: str, key: str, needle: str = "") -> str:
    args = ["--set", f"job.output_dir={out}"]
    for o in overrides:
        args += ["--set", o]
    capsys.readouterr()
    with pytest.raises(SystemExit) as ex:
        train.main(args)
    err = capsys.readouterr().err
    assert ex.value.code == 2, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and f"{key}: " in line, line
    assert needle in line, line
    assert "Traceback" not in err
    if out.is_dir():
        assert not (out / "metrics.jsonl").exists(), "training started"
    record("environment_errors", 1)
    return line


def test_output_folder_under_a_file(env, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    fails(capsys, tmp_path / "afile" / "run", key="job.output_dir", needle="not writable")


def test_output_folder_on_a_read_only_file_system(env, capsys):
    # /proc refuses new folders even to root (no chmod tricks, which root ignores).
    fails(capsys, Path("/proc/titanscale-test"), key="job.output_dir", needle="not writable")


def test_checkpoint_folder_unwritable(env, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    fails(
        capsys,
        tmp_path / "run",
        "checkpoint.interval=2",
        f"checkpoint.folder={tmp_path / 'afile' / 'ckpt'}",
        key="checkpoint.folder",
        needle="not writable",
    )


Usage = namedtuple("Usage", "total used free")


def test_disk_full(env, tmp_path, capsys, monkeypatch):
    import runtime.session

    monkeypatch.setattr(
        runtime.session.shutil, "disk_usage", lambda p: Usage(10**12, 10**12, 5 * 2**20)
    )
    fails(capsys, tmp_path / "run", key="job.output_dir", needle="GiB free")


def test_disk_too_small_for_one_checkpoint(env, tmp_path, capsys, monkeypatch):
    """Enough for metrics, not for a checkpoint of this model: refuse before training."""
    import runtime.session

    free = runtime.session.MIN_FREE_BYTES + 2**20
    monkeypatch.setattr(runtime.session.shutil, "disk_usage", lambda p: Usage(10**12, 0, free))
    line = fails(
        capsys, tmp_path / "run", "checkpoint.interval=2", key="job.output_dir", needle="checkpoint"
    )
    assert "GiB free" in line


def test_missing_tokenizer(env, tmp_path, capsys):
    fails(capsys, tmp_path / "run", f"model.tokenizer={tmp_path / 'nope'}", key="model.tokenizer")


def test_invalid_tokenizer_json(env, tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    fails(
        capsys,
        tmp_path / "run",
        f"model.tokenizer={tok}",
        key="model.tokenizer",
        needle="not a valid tokenizer",
    )


def test_missing_data(env, tmp_path, capsys):
    fails(capsys, tmp_path / "run", f"data.source={tmp_path / 'nope.jsonl'}", key="data.source")


def test_world_size_does_not_match_recipe(env, tmp_path, capsys):
    env["WORLD_SIZE"] = "2"
    line = fails(capsys, tmp_path / "run", "parallel.world_size=4", key="parallel.world_size")
    assert "4" in line and "2" in line


def test_degrees_do_not_fit_world_size(env, tmp_path, capsys):
    env["WORLD_SIZE"] = "2"
    fails(capsys, tmp_path / "run", "parallel.tp=3", key="parallel.dp_shard", needle="tp")


def test_missing_checkpoint_to_start_from(env, tmp_path, capsys):
    fails(
        capsys,
        tmp_path / "run",
        f"checkpoint.load_from={tmp_path / 'nope'}",
        key="checkpoint.load_from",
    )


def test_damaged_checkpoint_to_start_from(env, tmp_path, capsys):
    from tests.helpers.checkpoints import save_steps

    save_steps(tmp_path / "seed", [0])
    step0 = tmp_path / "seed" / "step-0"
    data = step0 / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(100)
    fails(
        capsys,
        tmp_path / "run",
        f"checkpoint.load_from={step0}",
        key="checkpoint.load_from",
        needle="truncated",
    )


def test_existing_checkpoints_not_overwritten(env, tmp_path, capsys):
    (tmp_path / "run" / "checkpoint" / "step-4").mkdir(parents=True)
    fails(capsys, tmp_path / "run", "checkpoint.resume=false", key="checkpoint.resume")


def test_malformed_fault_variable(env, tmp_path, capsys):
    import runtime.faults

    env["TITANSCALE_FAULT"] = "explode:rank=1"
    runtime.faults._FAULTS = None  # parsed once per process
    try:
        fails(capsys, tmp_path / "run", key="TITANSCALE_FAULT", needle="kind must be one of")
    finally:
        runtime.faults._FAULTS = None


def test_fault_spec_parsing():
    from runtime.faults import Fault, parse

    assert parse("") == []
    assert parse("kill:rank=1:step=5") == [Fault(kind="kill", step=5, rank=1)]
    assert parse("hang:step=3:at=save:restart=1, kill:rank=0:step=9") == [
        Fault(kind="hang", step=3, at="save", restart=1),
        Fault(kind="kill", step=9, rank=0),
    ]
    for bad in (
        "kill",
        "kill:rank=1",
        "boom:step=1",
        "kill:step=x",
        "kill:step=1:at=lunch",
        "kill:when=1",
    ):
        with pytest.raises(ValueError):
            parse(bad)
    f = Fault(kind="kill", step=5, rank=1)
    assert f.matches("step", 5, 1, 0) and not f.matches("step", 5, 0, 0)
    assert not f.matches("step", 5, 1, 1), "a restarted job must not fault again"
    assert not f.matches("save", 5, 1, 0)


def test_disk_usage_is_checked_where_checkpoints_go(env, tmp_path, capsys, monkeypatch):
    """checkpoint.folder on another disk: that disk's free space is the one that matters."""
    import runtime.session

    ckpt = tmp_path / "other-disk"
    seen = []

    def usage(p):
        seen.append(Path(p))
        return shutil._ntuple_diskusage(10**12, 0, 10**12) if Path(p) != ckpt else Usage(1, 1, 1)

    monkeypatch.setattr(runtime.session.shutil, "disk_usage", usage)
    fails(
        capsys,
        tmp_path / "run",
        "checkpoint.interval=2",
        f"checkpoint.folder={ckpt}",
        key="checkpoint.folder",
        needle="GiB free",
    )
    assert ckpt in seen
