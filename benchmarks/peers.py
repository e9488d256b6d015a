"""The command that puts titanscale side by side with TRL, transformers and skyrl-tx: a thin
entry over benchmarks/peerbench (see its cli module for what runs and what is written).

    python benchmarks/peers.py [--quick] [--repeats R] [--pairs a,b] [--threads T]
                               [--out benchmarks/peers] [--work outputs/peers]

Also the entry of each side's worker process (`peers.py --worker NAME ARGS_JSON`), in this
venv or in the skyrl-tx one."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.peerbench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
