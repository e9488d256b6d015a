"""The model resource's pure pieces (service/distributed.py): how a request's datums are
shared over ranks and how rank 0 turns every rank's result into one answer; and adapter
names that do not depend on activation checkpointing (what a resource's saves are keyed by)."""

from __future__ import annotations

import numpy as np
import pytest

from service.distributed import FailedEverywhere, ResourceBroken, combine, share
from service.errors import ServiceError
from service.types import FwdBwdResult, SampledSeq, SampleResult


@pytest.mark.parametrize("n, world", [(3, 2), (1, 4), (0, 2), (10, 3), (8, 8)])
def test_share_covers_every_datum_once_in_order(n, world):
    spans = [share(n, r, world) for r in range(world)]
    got = [i for lo, hi in spans for i in range(lo, hi)]
    assert got == list(range(n))
    sizes = [hi - lo for lo, hi in spans]
    assert max(sizes) - min(sizes) <= 1


def test_combine_decides_per_operation():
    ok = ("ok", ([{"lp": 1}], {"loss:sum": 3.0}))
    ok2 = ("ok", ([{"lp": 2}], {"loss:sum": 3.0}))
    r = combine("forward_backward", [ok, ok2])
    assert isinstance(r, FwdBwdResult) and r.outputs == [{"lp": 1}, {"lp": 2}]
    with pytest.raises(ResourceBroken, match="disagree on the loss"):
        combine("forward_backward", [ok, ("ok", ([], {"loss:sum": 3.5}))])
    same = ("user", 400, "data: bad")
    with pytest.raises(ServiceError) as e:
        combine("forward_backward", [same, same])
    assert e.value.status == 400 and not isinstance(e.value, ResourceBroken)
    bug = ("error", "ValueError: x", "Traceback ...")
    with pytest.raises(FailedEverywhere, match="ValueError: x"):
        combine("optim_step", [bug, bug])
    with pytest.raises(ResourceBroken, match="rank 1: ValueError: x"):
        combine("optim_step", [("ok", {}), bug])
    with pytest.raises(ResourceBroken, match="disagree on snapshot"):
        combine("snapshot", [("ok", "sampler-0"), ("ok", "sampler-1")])
    seq = SampledSeq(np.array([3, 4], np.int32), np.zeros(2, np.float32), "length")
    first = ("ok", SampleResult([seq]))
    assert combine("sample", [first, ("ok", [[3, 4]])]).sequences == [seq]
    with pytest.raises(ResourceBroken, match="sampled different tokens"):
        combine("sample", [first, ("ok", [[3, 5]])])


def test_adapter_names_do_not_depend_on_activation_checkpointing():
    import torch

    from posttrain.lora import lora_modules
    from recipe.loader import load_recipe
    from service.titan_backend import build_lora_model

    tiny = ["model.layers=2", "training.seq_len=64"]
    names, models = [], []
    for ac in ("none", "full"):
        r = load_recipe("recipes/debug.toml", [*tiny, f"training.activation_checkpoint={ac}"])
        model, _ = build_lora_model(r, torch.device("cpu"))
        names.append([n for n, _ in lora_modules(model)])
        models.append(model)
    assert names[0] == names[1] and "layers.0.attention.wo" in names[0]
    assert any("_checkpoint_wrapped_module" in n for n, _ in models[1].named_modules())
