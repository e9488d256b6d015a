"""Run inside a private mount namespace (`unshare -rm`) with a small tmpfs mounted at
argv[1]: train.py checkpoints there; once the first checkpoint is committed the disk is
filled to 512 KiB free, so a later save hits a real ENOSPC. Prints one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers.runs import child_env  # noqa: E402


def main() -> None:
    disk, out = Path(sys.argv[1]), Path(sys.argv[2])
    ckpt = disk / "ckpt"
    args = [a for o in sys.argv[3:] for a in ("--set", o)]
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
    filled = 0
    if proc.poll() is None:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            os.posix_fallocate(fd, 0, max(free - 512 * 1024, 0))
            filled = os.fstat(fd).st_size
        finally:
            os.close(fd)
    stdout, stderr = proc.communicate(timeout=300)
    listing = sorted(os.listdir(ckpt)) if ckpt.is_dir() else []
    from runtime.checkpoint import verify_checkpoint

    verified = {n: verify_checkpoint(str(ckpt / n)) for n in listing if n.startswith("step-")}
    os.unlink(disk / "filler") if (disk / "filler").exists() else None
    print(json.dumps({"rc": proc.returncode, "stderr": stderr[-6000:], "filled": filled,
                      "listing": listing, "verified": verified}))  # fmt: skip


if __name__ == "__main__":
    main()
