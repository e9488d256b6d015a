"""Run inside a private mount namespace (`unshare -rm`) with a small tmpfs mounted at
argv[2]; prints one JSON line.

- `manager DISK FREE`: the tiny checkpoint manager saves step 1 there, the disk is filled
  to FREE bytes, then step 2 is saved.
- `train DISK OUT OVERRIDES...`: train.py checkpoints there; once step-2 is committed the
  disk is filled to 512 KiB free, so a later save hits a real ENOSPC."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers.runs import child_env  # noqa: E402


def fill(disk: Path, leave: int) -> int:
    """Allocate all but `leave` bytes of `disk` (a real file: tmpfs has no holes). The
    training process may write between the statvfs and the allocation (metrics, the next
    save): an ENOSPC there means the disk filled first, so measure again and retry."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for _ in range(50):
            st = os.statvfs(disk)
            size = os.fstat(fd).st_size + st.f_bavail * st.f_frsize - leave
            try:
                os.posix_fallocate(fd, 0, max(size, 1))
                break
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def manager(disk: Path, leave: int) -> None:
    from runtime.checkpoint import CheckpointError, committed_steps
    from tests.helpers.checkpoints import load_fresh, make_manager

    folder = disk / "ckpt"
    mgr, model, ts = make_manager(folder, keep=2)
    ts.kv = {"step": 1, "note": ""}
    mgr.save(curr_step=1)
    filled = fill(disk, leave)
    ts.kv = {"step": 2, "note": ""}
    err = key = ""
    try:
        mgr.save(curr_step=2)
    except CheckpointError as e:
        err, key = str(e), e.key or ""
    mgr.close()
    listing = sorted(os.listdir(folder))
    os.unlink(disk / "filler")
    ok, _, ts = load_fresh(folder)
    print(json.dumps({"error": err, "key": key, "filled": filled, "listing": listing,
                      "committed": committed_steps(str(folder)), "loaded": ts.kv["step"]}))  # fmt: skip


def main() -> None:
    if sys.argv[1] == "manager":
        return manager(Path(sys.argv[2]), int(sys.argv[3]))
    disk, out = Path(sys.argv[2]), Path(sys.argv[3])
    ckpt = disk / "ckpt"
    args = [a for o in sys.argv[4:] for a in ("--set", o)]
    cmd = [sys.executable, str(ROOT / "train.py"), "--set", f"job.output_dir={out}",
           "--set", f"checkpoint.folder={ckpt}", *args]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while not (ckpt / "step-2" / "manifest.json").exists() and proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            break
        time.sleep(0.02)
    filled = fill(disk, 512 * 1024) if proc.poll() is None else 0
    stdout, stderr = proc.communicate(timeout=300)
    listing = sorted(os.listdir(ckpt)) if ckpt.is_dir() else []
    from runtime.checkpoint import verify_checkpoint

    verified = {n: verify_checkpoint(str(ckpt / n)) for n in listing if n.startswith("step-")}
    os.unlink(disk / "filler") if (disk / "filler").exists() else None
    print(json.dumps({"rc": proc.returncode, "stderr": stderr[-6000:], "filled": filled,
                      "listing": listing, "verified": verified}))  # fmt: skip


if __name__ == "__main__":
    main()
