"""A save that cannot be written ends in one line naming checkpoint.folder, the disk, its
free space and the size a checkpoint needs; the partial save is removed and the previous
checkpoint stays loadable. Injected here at the OS-write seams (tiny model, no process
group); a real full tmpfs is in tests/integration/test_reliability_ckpt_full_tmpfs.py.

Seams: DCP's per-item write (`_write_item`, where the OSError of a full disk surfaces), the
zip writer's short write without an errno (torch's "unexpected pos", seen on a real full
tmpfs), the manifest write of the commit, and quota (EDQUOT) / I/O (EIO) errors. Anything
that is not a write failure keeps its own traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple

import pytest

import runtime.checkpoint as ck
from runtime.checkpoint import PARTIAL, CheckpointError, committed_steps, verify_checkpoint
from tests.helpers.checkpoints import load_fresh, make_manager
from tools.reliability_report import record_case

Usage = namedtuple("Usage", "total used free")


def two_saves(tmp_path, monkeypatch, fail, *, step: int = 2):
    """Save step 1, install `fail`, try step 2; returns the error raised."""
    mgr, model, ts = make_manager(tmp_path, keep=2)
    ts.kv = {"step": 1, "note": ""}
    assert mgr.save(curr_step=1)
    fail(monkeypatch)
    ts.kv = {"step": step, "note": ""}
    try:
        with pytest.raises(CheckpointError) as ei:
            mgr.save(curr_step=step)
    finally:
        monkeypatch.undo()
        mgr.close()
    return ei.value


def assert_clean(tmp_path, err: CheckpointError) -> str:
    msg = str(err)
    assert err.key == "checkpoint.folder" and "\n" not in msg, msg
    assert str(tmp_path) in msg and "step-1 is intact" in msg
    assert not (tmp_path / f"step-2{PARTIAL}").exists(), "the partial save is removed"
    assert (
        committed_steps(str(tmp_path)) == [1] and verify_checkpoint(str(tmp_path / "step-1")) == []
    )
    ok, _, ts = load_fresh(tmp_path)
    assert ok and ts.kv["step"] == 1
    return msg


def enospc_in_write_item(monkeypatch, code: int = errno.ENOSPC) -> None:
    from torch.distributed.checkpoint import filesystem

    real = filesystem._write_item
    calls = {"n": 0}

    def write_item(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:  # the first item is written, then the disk is full
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", write_item)


def test_enospc_in_the_dcp_writer(tmp_path, monkeypatch):
    msg = assert_clean(tmp_path, two_saves(tmp_path, monkeypatch, enospc_in_write_item))
    assert msg.startswith("checkpoint.folder: disk full while saving checkpoint step-2")
    assert "errno ENOSPC" in msg and " free, one checkpoint needs about " in msg
    # The size named is the previous checkpoint's, the best estimate of the next one.
    size = sum(f.stat().st_size for f in (tmp_path / "step-1").iterdir())
    assert f"needs about {size / 1024:.0f} KiB" in msg, (size, msg)
    record_case("checkpoint save", "ENOSPC in the DCP writer")


@pytest.mark.parametrize(
    ("code", "says"),
    [(errno.EDQUOT, "disk full"), (errno.EIO, "writing failed")],
    ids=["EDQUOT", "EIO"],
)
def test_quota_is_a_full_disk_and_io_errors_a_failed_write(tmp_path, monkeypatch, code, says):
    def fail(mp):
        enospc_in_write_item(mp, code)

    msg = assert_clean(tmp_path, two_saves(tmp_path, monkeypatch, fail))
    assert says in msg and os.strerror(code) in msg, msg
    record_case("checkpoint save", f"{errno.errorcode[code]} in the DCP writer")


def test_short_write_without_errno_on_a_full_disk(tmp_path, monkeypatch):
    """torch's zip writer reports a short write as "unexpected pos" (no errno): with the
    disk (simulated) nearly full it is called a full disk, naming the free space."""

    def fail(mp):
        from torch.distributed.checkpoint import filesystem

        def write_item(*a, **k):
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            )

        mp.setattr(filesystem, "_write_item", write_item)
        mp.setattr(ck.shutil, "disk_usage", lambda p: Usage(2**30, 2**30 - 4096, 4096))

    msg = assert_clean(tmp_path, two_saves(tmp_path, monkeypatch, fail))
    assert "disk full" in msg and "unexpected pos" in msg and "has 4 KiB free" in msg, msg
    record_case("checkpoint save", "short write (unexpected pos), disk full")


def test_short_write_with_room_left_is_a_write_failure(tmp_path, monkeypatch):
    def fail(mp):
        from torch.distributed.checkpoint import filesystem

        def write_item(*a, **k):
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

        mp.setattr(filesystem, "_write_item", write_item)

    msg = assert_clean(tmp_path, two_saves(tmp_path, monkeypatch, fail))
    assert (
        msg.startswith("checkpoint.folder: writing failed while saving")
        and "file write failed" in msg
    )
    record_case("checkpoint save", "short write with room left")


def test_enospc_writing_the_manifest(tmp_path, monkeypatch):
    """The data fits, the commit's manifest does not."""

    def fail(mp):
        def write_manifest(path, crcs, **fields):
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, "m"))

        mp.setattr(ck, "write_manifest", write_manifest)

    msg = assert_clean(tmp_path, two_saves(tmp_path, monkeypatch, fail))
    assert "disk full" in msg and "ENOSPC" in msg
    record_case("checkpoint save", "ENOSPC writing the manifest")


def test_enospc_at_the_os_write_call(tmp_path, monkeypatch):
    """The lowest seam Python offers: every `write` of a file object opened for the new
    checkpoint raises ENOSPC after 4 KiB (a file-object wrapper around `open`, through
    which DCP's writer, torch.save and the manifest all write)."""
    import builtins
    import io

    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fail(mp):
        def fake_open(file, mode="r", *a, **k):
            f = real_open(file, mode, *a, **k)
            if "w" in mode and f"step-2{PARTIAL}" in str(file):
                return Full(f)
            return f

        mp.setattr(builtins, "open", fake_open)
        mp.setattr(io, "open", fake_open)  # pathlib's Path.open (DCP's create_stream)

    msg = assert_clean(tmp_path, two_saves(tmp_path, monkeypatch, fail))
    assert "disk full" in msg and "ENOSPC" in msg
    record_case("checkpoint save", "ENOSPC at the file write")


def test_a_bug_is_not_called_a_full_disk(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.api import CheckpointException

    mgr, model, ts = make_manager(tmp_path)

    def write_item(*a, **k):
        raise KeyError("not an I/O problem")

    monkeypatch.setattr(filesystem, "_write_item", write_item)
    ts.kv = {"step": 1, "note": ""}
    with pytest.raises(CheckpointException):  # DCP's own, with the traceback
        mgr.save(curr_step=1)
    mgr.close()
    shutil.rmtree(tmp_path / f"step-1{PARTIAL}", ignore_errors=True)


def test_enospc_in_the_hugging_face_export(tmp_path, monkeypatch):
    """The export (torchtitan's HF storage writer through our atomic commit): a full disk
    names checkpoint.export_folder; the earlier export stays, no partial folder is left."""
    from tests.helpers.checkpoints import make_export_manager

    export = tmp_path / "hf"
    mgr, _, _ = make_export_manager(tmp_path / "ckpt", export)
    mgr.export_hf(1)
    assert (export / "step-1" / "config.json").exists()

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    monkeypatch.setattr(HuggingFaceStorageWriter, "write_data", full)
    with pytest.raises(CheckpointError) as ei:
        mgr.export_hf(2)
    monkeypatch.undo()
    mgr.close()
    msg = str(ei.value)
    assert ei.value.key == "checkpoint.export_folder" and "\n" not in msg, msg
    assert (
        "disk full while saving the Hugging Face export step-2" in msg and "step-1 is intact" in msg
    )
    assert sorted(os.listdir(export)) == ["step-1"]
    record_case("checkpoint save", "ENOSPC in the Hugging Face export")


def test_an_async_save_that_hit_a_full_disk_is_one_line_at_the_next_wait(tmp_path):
    """An async save fails in its thread; torchtitan re-raises the future's error at the next
    save or at close. The manager turns it into the same one line (the seam driven directly:
    an async manager needs a process group)."""
    from concurrent.futures import Future

    from torch.distributed.checkpoint.api import CheckpointException
    from torchtitan.components.checkpoint import AsyncMode

    mgr, model, ts = make_manager(tmp_path)
    ts.kv = {"step": 1, "note": ""}
    mgr.save(curr_step=1)
    (tmp_path / f"step-2{PARTIAL}").mkdir()  # what the failed async write left
    fut: Future = Future()
    err = OSError(errno.ENOSPC, "No space left on device")
    fut.set_exception(CheckpointException("save", {0: (err, None)}))
    mgr.async_mode = AsyncMode.ASYNC
    mgr.save_future = fut
    mgr._async_target = (str(tmp_path / "step-2"), 2)
    with pytest.raises(CheckpointError) as ei:
        mgr._wait_for_saving(barrier=False)
    mgr.async_mode = AsyncMode.DISABLED
    mgr.close()
    assert_clean(tmp_path, ei.value)
    assert "disk full while saving checkpoint step-2" in str(ei.value)
    record_case("checkpoint save", "ENOSPC in an async save")
