"""A tiny model under `runtime.checkpoint.AtomicCheckpointManager`, no process group: the
checkpoint reliability tests and the crash-mid-save subprocess build it the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from runtime.checkpoint import AtomicCheckpointManager


class Box(Stateful):
    """A non-tensor state (like the trainer's step counter or the data position)."""

    def __init__(self, **kv: Any) -> None:
        self.kv = dict(kv)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.kv)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.kv = dict(sd)


def make_manager(folder: Path, *, keep: int = 0, interval: int = 1):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    train_state = Box(step=0, note="")
    mgr = AtomicCheckpointManager.Config(
        enable=True, folder=str(folder), interval=interval, keep_latest_k=keep
    ).build(
        dataloader=Box(position="[]"),
        model_parts=[model],
        optimizers=Box(lr=0.1),
        lr_schedulers=Box(last=0),
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder="",
    )
    return mgr, model, train_state


def save_steps(folder: Path, steps: list[int], *, keep: int = 0) -> dict[int, torch.Tensor]:
    """Save `steps` with distinct weights; returns the weight saved at each step."""
    mgr, model, ts = make_manager(folder, keep=keep)
    weights = {}
    for s in steps:
        with torch.no_grad():
            model.weight.fill_(float(s))
        ts.kv = {"step": s, "note": f"at {s}"}
        assert mgr.save(curr_step=s)
        weights[s] = model.weight.detach().clone()
    mgr.close()
    return weights


def load_fresh(folder: Path) -> tuple[bool, torch.nn.Linear, Box]:
    mgr, model, ts = make_manager(folder)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    ok = mgr.load()
    mgr.close()
    return ok, model, ts


def make_export_manager(ckpt: Path, export: Path, *, layers: int = 1, init_std: float = 0.0):
    """(manager, model, model spec): the debug Llama (`layers` layers, on CPU) under an
    AtomicCheckpointManager that exports Hugging Face folders (float32) to `export`;
    `init_std` > 0 fills the weights from a seeded normal (else they are left uninitialised)."""
    from recipe.loader import load_recipe
    from runtime.build import recipe_model_spec

    spec = recipe_model_spec(load_recipe(None, [f"model.layers={layers}"]))
    with torch.device("meta"):
        model = spec.model.build()
    model = model.to_empty(device="cpu")
    if init_std:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(std=init_std)
    mgr = AtomicCheckpointManager.Config(
        enable=True, folder=str(ckpt), interval=1, export_hf=True,
        export_folder=str(export), export_dtype="float32",
    ).build(
        dataloader=Box(position="[]"), model_parts=[model], optimizers=Box(lr=0.1),
        lr_schedulers=Box(last=0), states={"train_state": Box(step=0)},
        sd_adapter=spec.state_dict_adapter(spec.model, None), base_folder="",
    )  # fmt: skip
    return mgr, model, spec
