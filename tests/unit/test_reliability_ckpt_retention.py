"""Retention never drops the last good checkpoint (fault injection, tiny model, no process
group).

Rules under test (docs/reliability.md, section 3): a damaged checkpoint found at load is
moved aside as `step-N.damaged` once an older one has loaded (kept, never counted, never
pruned); nothing is pruned before the new save is committed and read back; a kept
checkpoint that fails the cheap checks at prune time is moved aside and an older verified
one kept instead; a start that fails (every checkpoint damaged, a model that does not fit)
moves and prunes nothing.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from runtime import checkpoint as ck
from runtime.checkpoint import CheckpointError, committed_steps, verify_checkpoint
from tests.helpers.checkpoints import make_manager, save_steps
from tests.unit.test_reliability_checkpoint import damage
from tools.reliability_report import record_case


def all_committed_verify(folder) -> bool:
    return all(not verify_checkpoint(str(folder / f"step-{s}")) for s in committed_steps(folder))


def save(mgr, ts, step: int) -> None:
    ts.kv = {"step": step, "note": ""}
    assert mgr.save(curr_step=step)


def test_fallback_then_save_keeps_the_verified_checkpoint(tmp_path):
    """The reported bug: step-4 damaged, fallback to step-2, the next save (step 3, keep 2)
    pruned step-2 and kept the damaged step-4, leaving one good checkpoint."""
    save_steps(tmp_path, [2, 4], keep=2)
    damage(tmp_path / "step-4", "truncate")
    mgr, model, ts = make_manager(tmp_path, keep=2)
    assert mgr.load() and ts.kv["step"] == 2
    assert (tmp_path / "step-4.damaged").is_dir(), "the damaged one is kept, moved aside"
    save(mgr, ts, 3)
    mgr.close()  # joins the purge thread
    assert committed_steps(str(tmp_path)) == [2, 3]
    assert all_committed_verify(tmp_path)
    assert verify_checkpoint(str(tmp_path / "step-4.damaged")), "its data is untouched"
    # Training goes on past the damaged step: step-4 is written fresh, step-2 pruned only now.
    mgr, model, ts = make_manager(tmp_path, keep=2)
    assert mgr.load() and ts.kv["step"] == 3
    save(mgr, ts, 4)
    save(mgr, ts, 5)
    mgr.close()
    assert committed_steps(str(tmp_path)) == [4, 5] and all_committed_verify(tmp_path)
    assert (tmp_path / "step-4.damaged").is_dir()
    record_case("checkpoint save", "retention after a fallback")


def test_a_kept_checkpoint_damaged_since_is_moved_aside_not_counted(tmp_path, caplog):
    """Damage the checkpoint a prune would keep: an older verified one is kept instead."""
    save_steps(tmp_path, [1, 2], keep=2)
    mgr, model, ts = make_manager(tmp_path, keep=2)
    assert mgr.load() and ts.kv["step"] == 2
    damage(tmp_path / "step-2", "flip_bytes")  # bit rot the size checks cannot see ...
    damage(tmp_path / "step-2", "delete_file")  # ... and a missing file they can
    save(mgr, ts, 3)
    mgr.close()
    assert committed_steps(str(tmp_path)) == [1, 3], "step-1 is the second verified one"
    assert (tmp_path / "step-2.damaged").is_dir() and all_committed_verify(tmp_path)
    assert "moved aside" in caplog.text
    record_case("checkpoint save", "kept checkpoint damaged before a prune")


def test_prune_happens_only_after_the_new_save_is_committed_and_read_back(tmp_path, monkeypatch):
    mgr, model, ts = make_manager(tmp_path, keep=2)
    for s in (1, 2):
        save(mgr, ts, s)
    seen: list[tuple[str, list[int], bool]] = []
    real_put = mgr.purge_queue.put

    def spy(path, *a, **k):
        if path is not None:
            # At the moment a deletion is queued the new checkpoint is committed and verifies.
            seen.append((os.path.basename(path), committed_steps(str(tmp_path)), True))
            assert not verify_checkpoint(str(tmp_path / "step-3"))
        return real_put(path, *a, **k)

    monkeypatch.setattr(mgr.purge_queue, "put", spy)
    save(mgr, ts, 3)
    mgr.close()
    assert [s[:2] for s in seen] == [("step-1", [1, 2, 3])]
    assert committed_steps(str(tmp_path)) == [2, 3]
    record_case("checkpoint save", "prune order")


def test_a_save_that_fails_its_read_back_prunes_nothing(tmp_path, monkeypatch):
    """The committed folder fails verification (a disk that lies): it is moved aside, the
    save stops with one line, and the older checkpoints all stay."""
    mgr, model, ts = make_manager(tmp_path, keep=2)
    for s in (1, 2):
        save(mgr, ts, s)
    real = ck.verify_checkpoint

    def lying(path, **kw):
        if path.endswith("step-3"):
            return ["__0_0.distcp is truncated (10 bytes, need 20)"]
        return real(path, **kw)

    monkeypatch.setattr(ck, "verify_checkpoint", lying)
    ts.kv = {"step": 3, "note": ""}
    with pytest.raises(CheckpointError, match="fails verification") as ei:
        mgr.save(curr_step=3)
    mgr.close()
    assert ei.value.key == "checkpoint.folder" and "\n" not in str(ei.value)
    assert committed_steps(str(tmp_path)) == [1, 2]
    assert (tmp_path / "step-3.damaged").is_dir()
    record_case("checkpoint save", "new save fails its read-back")


def test_a_failed_save_prunes_nothing(tmp_path, monkeypatch):
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    mgr, model, ts = make_manager(tmp_path, keep=2)
    for s in (1, 2):
        save(mgr, ts, s)

    def enospc(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", enospc)
    ts.kv = {"step": 3, "note": ""}
    with pytest.raises(CheckpointError):
        mgr.save(curr_step=3)
    mgr.close()
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2"]
    record_case("checkpoint save", "failed save prunes nothing")


def test_every_checkpoint_damaged_is_one_line_and_moves_nothing(tmp_path):
    save_steps(tmp_path, [2, 4])
    damage(tmp_path / "step-2", "truncate")
    damage(tmp_path / "step-4", "garbage_metadata")
    mgr, model, ts = make_manager(tmp_path, keep=2)
    with pytest.raises(CheckpointError) as ei:
        mgr.load()
    mgr.close()
    msg = str(ei.value)
    assert ei.value.key == "checkpoint.folder" and "\n" not in msg
    assert "no loadable checkpoint" in msg and "step-2:" in msg and "step-4:" in msg
    assert "refusing to start over from step 0" in msg
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4"], "nothing moved or pruned"
    record_case("checkpoint load", "every checkpoint damaged")


def test_a_load_error_with_a_traceback_is_one_line(tmp_path, monkeypatch):
    """A load that fails inside DCP (its CheckpointException carries whole tracebacks) on
    every checkpoint: the error is one line naming each step's failure."""
    save_steps(tmp_path, [2, 4])
    from torch.distributed.checkpoint.api import CheckpointException

    def broken(state_dict, checkpoint_id):
        try:
            raise OSError(5, "Input/output error")
        except OSError as e:
            import traceback

            raise CheckpointException(
                "load", {0: (e, traceback.extract_tb(e.__traceback__))}
            ) from None

    monkeypatch.setattr(ck, "safe_dcp_load", broken)
    mgr, model, ts = make_manager(tmp_path)
    with pytest.raises(CheckpointError) as ei:
        mgr.load()
    mgr.close()
    msg = str(ei.value)
    assert "\n" not in msg and "Traceback" not in msg and "Input/output error" in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4"]
    record_case("checkpoint load", "every load fails inside DCP")


def test_train_main_refuses_every_checkpoint_damaged_before_the_process_group(tmp_path, capsys):
    """Through train.py: one line, exit 2, from session.prepare (no process group, no
    metrics), the folder untouched."""
    from tests.helpers.runs import train_main_error

    folder = tmp_path / "checkpoint"
    save_steps(folder, [2, 4])
    damage(folder / "step-2", "truncate")
    damage(folder / "step-4", "no_metadata")
    code, err = train_main_error(
        ["--set", f"job.output_dir={tmp_path}", "--set", "checkpoint.interval=5"], capsys
    )
    assert code == 2 and len(err) == 1, err
    assert " checkpoint.folder: no loadable checkpoint" in err[0] and "step-4:" in err[0]
    assert not (tmp_path / "metrics.jsonl").exists()
    assert sorted(os.listdir(folder)) == ["step-2", "step-4"]
    record_case("train.py", "every checkpoint damaged")


def test_incompatible_resume_prunes_and_moves_nothing(tmp_path):
    """More committed folders than keep_latest (a last-step save of older code, or a
    changed keep_latest) and a model that does not fit: nothing may go."""
    save_steps(tmp_path, [1, 2, 3])
    before = sorted(os.listdir(tmp_path))
    mgr, model, ts = make_manager(tmp_path, keep=2)
    mgr.states["model"].model = [torch.nn.Linear(64, 32)]
    with pytest.raises(CheckpointError, match="does not fit the model"):
        mgr.load()
    mgr.close()
    assert sorted(os.listdir(tmp_path)) == before
    record_case("checkpoint load", "incompatible resume prunes nothing")


def test_last_step_save_also_honours_keep_latest(tmp_path):
    mgr, model, ts = make_manager(tmp_path, keep=2)
    for s in (1, 2, 3):
        ts.kv = {"step": s, "note": ""}
        mgr.save(curr_step=s, last_step=(s == 3))
    mgr.close()
    assert committed_steps(str(tmp_path)) == [2, 3]
    shutil.rmtree(tmp_path)
