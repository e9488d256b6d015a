"""The two-adapter recipe (a tiny debug model, letter-sorting data) shared by the
[[adapters]] tests in one process and on several."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.tasks import letter_sort

ROOT = Path(__file__).resolve().parents[2]

RECIPE = """
base = "{root}/recipes/sft_debug.toml"
[model]
layers = 2
[training]
seq_len = 64
local_batch_size = 2
warmup_steps = 0
[checkpoint]
load_from = ""
[metrics]
summary_skip_steps = 0
log_every = 1
[[adapters]]
name = "a"
source = "{d}/a.jsonl"
eval_source = "{d}/held.jsonl"
lr = 0.01
steps = 4
seed = 1
[[adapters]]
name = "b"
source = "{d}/b.jsonl"
lr = 0.005
steps = 3
warmup_steps = 1
seed = 2
"""

STEPS = {"a": 4, "b": 3}  # the recipe's adapters and their steps


def write_adapter_recipe(d: Path) -> str:
    """Data (a: 200 and b: 200 training examples, 20 held out) and the recipe, in `d`."""
    train, held = letter_sort(400, 20, seed=0)
    for name, rows in (("a", train[:200]), ("b", train[200:]), ("held", held)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = d / "recipe.toml"
    path.write_text(RECIPE.format(root=ROOT, d=d))
    return str(path)


def adapter_weights(folder: Path) -> dict:
    """An adapter checkpoint's A/B tensors (a DCP step folder under adapters/<name>), read
    with the project's safe reader (no code from the file)."""
    import torch
    from torch.distributed.checkpoint import load as dcp_load

    from runtime.safe_load import SafeFileSystemReader

    meta = SafeFileSystemReader(str(folder)).read_metadata().state_dict_metadata
    skip = ("optimizer", "lr_scheduler", "dataloader", "train_state")
    sd = {k: torch.empty(m.size) for k, m in meta.items() if not k.startswith(skip)}
    dcp_load(sd, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
    return sd
