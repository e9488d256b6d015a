"""Checkpoint writes are atomic, damage is detected, and loading runs no code from disk.

Tier 1: `runtime.checkpoint.AtomicCheckpointManager` (torchtitan's DCP CheckpointManager
extended) driven directly with a tiny model, no process group: crash mid-save (a real
SIGKILL in a subprocess, at the fault-injection seam), a full disk during a save,
truncated / corrupted / missing files, corrupted metadata, pickle payloads in the metadata
and in a non-tensor item, pruning order. Plus the metrics trajectory reader.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path

import pytest

from core.atomic import MANIFEST
from runtime.checkpoint import (
    PARTIAL,
    CheckpointError,
    committed_steps,
    verify_checkpoint,
)
from runtime.metrics import read_starts, read_trajectory
from tests.helpers.checkpoints import load_fresh, make_manager, save_steps
from tools.reliability_report import record


def fault(fallback: bool = False) -> None:
    """One checkpoint fault tried (and recovered by a fallback): the reliability figures."""
    record("checkpoint_faults", 1)
    record("checkpoint_fallbacks", int(fallback))


def test_save_commits_atomically_with_manifest(tmp_path):
    save_steps(tmp_path, [1, 2])
    assert committed_steps(str(tmp_path)) == [1, 2]
    assert not any(n.endswith(PARTIAL) for n in os.listdir(tmp_path))
    man = json.loads((tmp_path / "step-2" / MANIFEST).read_text())
    assert set(man["files"]) == {".metadata", "__0_0.distcp"}
    assert all(isinstance(f["crc32"], int) for f in man["files"].values())
    assert verify_checkpoint(str(tmp_path / "step-2")) == []
    ok, model, ts = load_fresh(tmp_path)
    assert ok and ts.kv["step"] == 2 and float(model.weight.detach()[0, 0]) == 2.0


def test_disk_full_during_save_keeps_previous(tmp_path, monkeypatch):
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    mgr, model, ts = make_manager(tmp_path)
    ts.kv = {"step": 1, "note": ""}
    assert mgr.save(curr_step=1)
    ts.kv = {"step": 2, "note": ""}

    def enospc(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", enospc)
    # DCP wraps the OSError in its CheckpointException; the manager makes it one line.
    with pytest.raises(CheckpointError, match=r"disk full while saving checkpoint step-2") as ei:
        mgr.save(curr_step=2)
    assert ei.value.key == "checkpoint.folder" and "step-1 is intact" in str(ei.value)
    assert not (tmp_path / f"step-2{PARTIAL}").exists()
    mgr.close()
    monkeypatch.undo()
    assert committed_steps(str(tmp_path)) == [1]
    ok, _, ts = load_fresh(tmp_path)
    assert ok and ts.kv["step"] == 1
    fault(fallback=True)


def damage(path: Path, how: str) -> None:
    data = path / "__0_0.distcp"
    if how == "truncate":
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) // 2)
    elif how == "flip_bytes":
        raw = bytearray(data.read_bytes())
        mid = len(raw) // 2
        raw[mid : mid + 8] = bytes(b ^ 0xFF for b in raw[mid : mid + 8])
        data.write_bytes(bytes(raw))
    elif how == "delete_file":
        data.unlink()
    elif how == "garbage_metadata":
        (path / ".metadata").write_bytes(os.urandom(300))
    elif how == "empty_metadata":
        (path / ".metadata").write_bytes(b"")
    elif how == "no_metadata":
        (path / ".metadata").unlink()
    elif how == "bad_manifest":
        (path / MANIFEST).write_text("{not json")
    else:
        raise ValueError(how)


DAMAGE = {
    "truncate": "truncated",
    "flip_bytes": "corrupted (CRC32",
    "delete_file": "missing",
    "garbage_metadata": ".metadata is unreadable",
    "empty_metadata": ".metadata is unreadable",
    "no_metadata": ".metadata is missing",
    "bad_manifest": "manifest.json is unreadable",
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back(tmp_path, how, caplog):
    save_steps(tmp_path, [2, 4])
    damage(tmp_path / "step-4", how)
    problems = verify_checkpoint(str(tmp_path / "step-4"))
    assert problems and DAMAGE[how] in " ".join(problems), problems
    with caplog.at_level(logging.ERROR):
        ok, model, ts = load_fresh(tmp_path)
    assert ok and ts.kv["step"] == 2 and float(model.weight.detach()[0, 0]) == 2.0
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "step-4 is damaged" in msg and "falling back to step-2" in msg, msg
    assert DAMAGE[how] in msg
    fault(fallback=True)


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    save_steps(tmp_path, [2, 4])
    damage(tmp_path / "step-2", "truncate")
    damage(tmp_path / "step-4", "garbage_metadata")
    with pytest.raises(CheckpointError, match=r"no loadable checkpoint.*step-2.*step-4"):
        load_fresh(tmp_path)
    fault()


def test_resave_replaces_a_damaged_step_only_when_complete(tmp_path):
    save_steps(tmp_path, [2, 4])
    damage(tmp_path / "step-4", "truncate")
    mgr, model, ts = make_manager(tmp_path)
    assert mgr.load() and ts.kv["step"] == 2
    ts.kv = {"step": 4, "note": "again"}
    assert mgr.save(curr_step=4)
    mgr.close()
    assert verify_checkpoint(str(tmp_path / "step-4")) == []
    # The damaged one was moved aside at the fallback (kept for inspection, never counted).
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4", "step-4.damaged"]
    assert verify_checkpoint(str(tmp_path / "step-4.damaged"))


def test_prune_only_after_commit_and_only_committed(tmp_path, monkeypatch):
    """keep_latest=2: the oldest goes only once the newest is committed; partials never count."""
    mgr, model, ts = make_manager(tmp_path, keep=2)
    for s in (1, 2):
        ts.kv = {"step": s, "note": ""}
        mgr.save(curr_step=s)
    (tmp_path / f"step-9{PARTIAL}").mkdir()  # a stray partial must not push out a real one
    seen_at_commit = []
    real_replace = os.replace

    def spy(src, dst):
        if str(dst).endswith("step-3"):
            seen_at_commit.append(sorted(committed_steps(str(tmp_path))))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    ts.kv = {"step": 3, "note": ""}
    mgr.save(curr_step=3)
    mgr.close()  # joins the purge thread
    assert seen_at_commit == [[1, 2]], "step-1 was still there when step-3 was committed"
    assert committed_steps(str(tmp_path)) == [2, 3]


# ---------------------------------------------------------------------------- safe loading


class OpenFile:
    """Unpickling this calls builtins.open(marker, "w"): a visible side effect."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_in_metadata_is_not_executed(tmp_path, caplog):
    save_steps(tmp_path, [2, 4])
    marker = tmp_path / "pwned-metadata"
    (tmp_path / "step-4" / ".metadata").write_bytes(pickle.dumps(OpenFile(str(marker))))
    problems = verify_checkpoint(str(tmp_path / "step-4"))
    assert any("refusing to load global" in p and "open" in p for p in problems), problems
    with caplog.at_level(logging.ERROR):
        ok, _, ts = load_fresh(tmp_path)
    assert ok and ts.kv["step"] == 2
    assert not marker.exists(), "code from the checkpoint ran"
    fault(fallback=True)


def test_pickle_payload_in_a_state_item_is_not_executed(tmp_path, caplog):
    """A non-tensor item (like the data position) holding a pickle with a side effect."""
    save_steps(tmp_path, [2])
    marker = tmp_path / "pwned-item"
    mgr, model, ts = make_manager(tmp_path)
    ts.kv = {"step": 4, "note": OpenFile(str(marker))}  # pickled by DCP's torch.save
    mgr.save(curr_step=4)
    mgr.close()
    assert not marker.exists()
    # The attack is real: DCP's stock loader runs it.
    import torch.distributed.checkpoint as dcp

    probe = {"train_state": {"step": 0, "note": None}}
    dcp.load(probe, checkpoint_id=str(tmp_path / "step-4"))
    assert marker.exists(), "stock DCP load should have executed the payload"
    marker.unlink()
    # Ours refuses it and falls back to step-2.
    with caplog.at_level(logging.ERROR):
        ok, _, ts = load_fresh(tmp_path)
    assert not marker.exists(), "code from the checkpoint ran"
    assert ok and ts.kv["step"] == 2
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "not plain data" in msg and "step-4 is damaged" in msg, msg
    fault(fallback=True)


def test_data_position_is_json_and_pickles_are_refused():
    from data.loader import TitanscaleDataLoader

    loader = object.__new__(TitanscaleDataLoader)  # only the (de)serialisation is under test
    with pytest.raises(ValueError, match="refusing to unpickle"):
        loader.load_state_dict({"titanscale_stream": pickle.dumps({"x": 1})})


def test_recipes_are_data_only(tmp_path):
    """A recipe is TOML: nothing in it is evaluated (no Python, no !!python tags)."""
    from core.errors import ConfigError
    from recipe.loader import load_recipe

    marker = tmp_path / "pwned-recipe"
    p = tmp_path / "r.toml"
    p.write_text(f"[job]\ndescription = \"__import__('os').system('touch {marker}')\"\n")
    r = load_recipe(p)
    assert r.job.description.startswith("__import__") and not marker.exists()
    p.write_text(f"[job]\ndescription = !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_recipe(p)
    assert not marker.exists()


# ---------------------------------------------------------------------------- trajectory


def test_read_trajectory_keeps_latest_start_per_step(tmp_path):
    p = tmp_path / "metrics.jsonl"
    lines = [
        {"event": "start", "resumed_from_step": 0, "restart_count": 0},
        *({"step": s, "loss": 10.0 - s} for s in (1, 2, 3, 4, 5)),
        {"event": "start", "resumed_from_step": 4, "restart_count": 1},
        {"step": 5, "loss": 0.5},
        {"step": 6, "loss": 0.4},
    ]
    text = "\n".join(json.dumps(x) for x in lines)
    # a torn line (killed mid-write) followed by the next start's records
    text = text.replace('{"step": 5, "loss": 5.0}', '{"step": 5, "lo')
    p.write_text(text + "\n")
    traj = read_trajectory(p)
    assert [r["step"] for r in traj] == [1, 2, 3, 4, 5, 6]
    assert traj[4]["loss"] == 0.5, "step 5 comes from the restart"
    assert [s["restart_count"] for s in read_starts(p)] == [0, 1]


def test_read_trajectory_drops_steps_after_an_older_resume(tmp_path):
    """A restart that resumed from an older checkpoint invalidates everything after it."""
    p = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "loss": 1.0} for s in range(1, 9)]
    recs += [{"event": "start", "resumed_from_step": 2}, {"step": 3, "loss": 2.0}]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    traj = read_trajectory(p)
    assert [r["step"] for r in traj] == [1, 2, 3] and traj[-1]["loss"] == 2.0
