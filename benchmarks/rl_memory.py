"""Peak host memory of RL on CPU against prompts per update: recipes/rl_debug.toml at 16 and
64 prompts (x 8 samples), completions of 4 (the recipe's) and 40 new tokens.

Each figure is one `train.py` process's max RSS (resource.getrusage(RUSAGE_CHILDREN) of a
fresh measuring process), 2 updates after a 2-step supervised warmup, 8 held-out prompts.
`--root` runs another checkout (e.g. a `git worktree` of the commit before the step layer)
with this interpreter.

    python benchmarks/rl_memory.py [--root DIR] [--label NAME] [--out benchmarks/rl_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETS = ["training.steps=2", "rl.sft_warmup_steps=2", "rl.eval_prompts=8", "checkpoint.interval=0"]
MEASURE = """
import resource, subprocess, sys
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)
"""


def peak_mib(root: Path, out: Path, prompts: int, new_tokens: int) -> float:
    cmd = [sys.executable, "train.py", "--recipe", "recipes/rl_debug.toml",
           "--set", f"job.output_dir={out}", "--set", f"rl.prompts_per_step={prompts}",
           "--set", f"rl.max_new_tokens={new_tokens}"]  # fmt: skip
    for s in SETS:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", MEASURE, *cmd], cwd=root, env=env,
                       capture_output=True, text=True)  # fmt: skip
    rc, kib = p.stdout.split()
    if rc != "0":
        raise SystemExit(f"{cmd} failed: {p.stderr[-2000:]}")
    return int(kib) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--out", default="benchmarks/rl_memory.json")
    args = ap.parse_args()
    import tempfile

    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for new in (4, 40):
            peaks = {
                n: peak_mib(Path(args.root), Path(tmp) / f"{n}-{new}", n, new) for n in (16, 64)
            }
            rows.append({"label": args.label, "max_new_tokens": new, "peak_mib_16": peaks[16],
                         "peak_mib_64": peaks[64], "ratio": peaks[64] / peaks[16]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    meta = {
        "command": " ".join(sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average at end "
        f"{os.getloadavg()[0]:.1f}",
        "torch": torch.__version__,
    }
    out = Path(args.out)
    old = json.loads(out.read_text())["rows"] if out.exists() else []
    keep = [r for r in old if r["label"] != args.label]
    out.write_text(json.dumps({"meta": meta, "rows": keep + rows}, indent=1))


if __name__ == "__main__":
    main()
