"""Per-example SFT weights through torchtitan's model and Trainer (docs/sft.md).

- A weight-0 example packed with weighted ones contributes exactly zero gradient.
- train.py on weighted data: the loss is sum w*CE / sum w over the whole step on every rank,
  so 2 processes equal 1 process accumulating 2 microbatches with every weight doubled (a
  per-rank or per-microbatch normalizer, or a trained-token count, would not).
"""

from __future__ import annotations

import json

import pytest
import torch

from data.loader import PackedStream
from data.packing import LOSS_WEIGHTS
from posttrain.tasks import letter_sort
from runtime.loss import WeightedChunkedLoss, WeightedCrossEntropyLoss
from tests.helpers.runs import read_losses, run_train
from tests.helpers.tiny_data import CharTokenizer, ListSource
from tests.unit.test_sft_weights import renderer, spans


def test_weight_zero_example_gets_exactly_zero_gradient():
    """A weight-0 example packed with weighted ones: changing its completion leaves every
    parameter gradient bit-identical (torchtitan's model, dense document masks)."""
    from tests.helpers.doc_mask import build_model

    def batch(completion: str, weight: float = 0.0):
        lines = [
            json.dumps({"prompt": "add 1 2", "completion": "3", "weight": 2.0}),
            json.dumps({"prompt": "sort b a", "completion": completion, "weight": weight}),
            json.dumps({"prompt": "say hi", "completion": "hi", "weight": 0.5}),
        ]
        s = PackedStream(source=ListSource(lines), tokenizer=CharTokenizer(2048), seq_len=128,
                         dp_rank=0, dp_world_size=1, packing="bfd", window=8, infinite=False,
                         renderer=renderer())  # fmt: skip
        (x, y), *rest = list(s)
        assert not rest and len(spans(x["positions"])) == 4  # 3 examples + padding, one row
        return x, y

    model = build_model("dense").train()
    model._skip_lm_head = True  # as torchtitan's Trainer sets it for the chunked loss

    def grads(x, y):
        model.zero_grad(set_to_none=True)
        fn = WeightedChunkedLoss(
            WeightedChunkedLoss.Config(num_chunks=4, loss_fn=WeightedCrossEntropyLoss.Config())
        )
        fn.set_lm_head(model.lm_head)
        inp, pos = x["input"][None], x["positions"][None]
        h = model(inp, pos, model.get_attention_masks(positions=pos))
        w = x[LOSS_WEIGHTS][None]
        with fn.token_weights(w):
            loss, _ = fn(h, y[None], w.sum())
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    xa, ya = batch("a b")
    xb, yb = batch("x y")  # same length: every other example keeps its row positions
    assert not torch.equal(xa["input"], xb["input"])
    assert torch.equal(xa[LOSS_WEIGHTS], xb[LOSS_WEIGHTS])
    ga, gb = grads(xa, ya), grads(xb, yb)
    assert ga.keys() == gb.keys() and len(ga) > 5
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
    # Control: the same change at weight 1 does change the gradients.
    gc, gd = grads(*batch("a b", 1.0)), grads(*batch("x y", 1.0))
    assert any(not torch.equal(gc[k], gd[k]) for k in gc)


@pytest.mark.multiproc
@pytest.mark.slow  # measured: over 60 s on 2 loaded cores (#31)
def test_weighted_sft_normalizes_by_the_global_weight_sum(tmp_path, seed_checkpoint):
    train, _ = letter_sort(80, 1, seed=2)
    # Dyadic weights (exact in float32), none equal to 1, and some 0 (masked examples).
    weights = (0.75, 1.5, 3.0, 0.0, 0.25)

    def write(name: str, scale: float) -> str:
        rows = [{**r, "weight": weights[i % len(weights)] * scale} for i, r in enumerate(train)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    common = [
        "finetune.mode=full", f"checkpoint.load_from={seed_checkpoint}", "data.eval_source=",
        "training.steps=2", "training.warmup_steps=0", "training.seq_len=64",
        "training.lr=0.001", "metrics.log_every=1", "metrics.tensorboard=false",
        "data.window=16",
    ]  # fmt: skip
    runs = {}
    # Weights as given on 2 ranks x 2 rows; every weight doubled on 1 rank x 2 microbatches
    # of 2 rows (gradient accumulation; the same global rows). Equal losses need the
    # normalizer to be the step's sum of weights over all ranks and microbatches: per-rank or
    # per-microbatch sums, or a trained-token count (doubled weights would double the loss),
    # would not give them.
    for name, scale, nproc in (("dp2", 1.0, 2), ("dp1_accum2_x2", 2.0, 1)):
        out = tmp_path / name
        run_train(out, [*common, f"data.source={write(name + '.jsonl', scale)}",
                        "training.local_batch_size=2", "training.global_batch_size=4"],
                  nproc=nproc, recipe="recipes/sft_debug.toml", timeout=900)  # fmt: skip
        runs[name] = read_losses(out)
    assert sorted(runs["dp1_accum2_x2"]) == sorted(runs["dp2"]) == [1, 2]
    for step, loss in runs["dp1_accum2_x2"].items():
        assert abs(runs["dp2"][step] - loss) <= 2e-4, (step, runs["dp2"][step], loss)
