"""The post-training dry run (tools.dryrun -> tools.dryrun.posttrain) steps one RL update and
one [[adapters]] round on the step layer, and each measured peak is a hand count of the
tensors that update holds.

Tiny configs whose vocabulary dominates (1 layer, dim 256, a 32,768-token vocabulary,
float32) so that the peak is a few terms one can write down. P (parameters) and the RoPE
cache (a 131,072 x 8 complex64 buffer, 8 MiB per model copy) are torchtitan's own count of
the model, built on the meta device. At the backward of the logprobs (runtime.steps'
chunked log-softmax over one chunk of N <= 1,024 tokens) a rank holds the microbatch's
float32 logits (N x V), their gradient and up to three float32 softmax temporaries of the
chunk (x / T, its exponential, the product with the incoming gradient): 5 x N x V x 4 bytes.
Besides those:

- RL (FSDP over 2 ranks, 8 rollouts of 63 predicted tokens): the rank's shard of the policy
  (P/2) and AdamW's two moments of it (P), the unsharded output projection FSDP gathers for
  the head's backward (V x d), the generator's float32 copy (P), two RoPE caches;
  async RL adds the probe's copy and the staged gathered weights, both P float32, live
  during the update (rl/loop.py: the generator thread's pending update); rl.generator =
  "vllm" holds the same update without the generator's copy (the engine is its own process);
- [[adapters]] (one process, 2 adapters of 2 rows x 64 tokens): the frozen base (P) and
  its RoPE cache; the adapters and their AdamW state are under 2 MiB. "batched" runs both
  adapters' rows in one microbatch, "turns" one adapter's at a time: the difference is the
  second adapter's 5 x N x V x 4 bytes.

What is not counted (the layer's activations, dense attention's scores, AdamW's step
counters) is a few MiB: each measurement must sit within 5% of its count.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from recipe.loader import load_recipe
from runtime.build import recipe_model_spec
from tests.helpers.runs import ROOT, child_env, python

MiB = 2**20
SETS = ["parallel.world_size=2", "model.layers=1", "model.vocab_size=32768",
        "training.local_batch_size=8", "rl.prompts_per_step=1", "rl.group_size=8"]  # fmt: skip


def dry_run(*sets: str) -> dict:
    cmd = [python(), "-m", "tools.dryrun", "--recipe=recipes/rl_debug.toml", "--json"]
    cmd += [f"--set={s}" for s in (*SETS, *sets)]
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    (rank,) = json.loads(p.stdout)["ranks"][:1]
    assert "error" not in rank, rank
    return rank


def torchtitan_count(recipe: str, sets: list[str]) -> tuple[int, int, int, int]:
    """(P, V, d, buffer bytes) of torchtitan's model of the recipe, on the meta device."""
    r = load_recipe(recipe, sets)
    with torch.device("meta"):
        model = recipe_model_spec(r).model.build()
    V, d = model.tok_embeddings.weight.shape
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return sum(p.numel() for p in model.parameters()), V, d, buffers


def logits_work(N: int, V: int) -> int:
    """float32 logits, their gradient, three softmax temporaries of one chunk."""
    return 4 * N * V * 5


def test_rl_update_peak_is_the_hand_count():
    P, V, d, rope = torchtitan_count(str(ROOT / "recipes/rl_debug.toml"), SETS)
    N = 8 * 63  # rows x (seq_len 64 - 1): the shifted rollouts
    states = 4 * (P / 2 + P + V * d)  # the shard, AdamW's moments of it, the gathered head
    generator = 4 * P
    hand = (states + generator + 2 * rope + logits_work(N, V)) / MiB
    r = dry_run()
    measured = r["peak_gib"] * 1024
    assert measured == pytest.approx(hand, rel=0.05), (measured, hand, r["measured"]["peak"])
    post = r["posttrain"]
    assert post["resident_gib"]["generator_copies"] * 1024 == pytest.approx(generator / MiB,
                                                                            abs=1.0)  # fmt: skip
    assert "update" in post["phases_gib"] and "generation" in post["phases_gib"]
    assert "_ChunkedLogprobsBackward" in r["measured"]["peak_where"]
    # the planner's side is tools.predict's post-training figure, with its generator term
    assert r["planned"]["planned"]["generator_copies"] * 1024 == pytest.approx(
        generator / MiB, rel=0.01
    )

    # async: the probe's copy and the staged (gathered, float32) weights are live while the
    # update trains, inside the generation (its KV cache and logits: under 1 MiB here).
    a = dry_run("rl.mode=async")
    extra = (a["peak_gib"] - r["peak_gib"]) * 1024
    assert 2 * generator / MiB <= extra <= 2 * generator / MiB + 4, extra
    assert a["posttrain"]["staged_weights_gib"] * 1024 == pytest.approx(generator / MiB, abs=1.0)

    # rl.generator = "vllm": the engine is its own process; the trainer's device holds the
    # same update without the generator's copy (and the planner's side leaves it out too).
    v = dry_run("rl.generator=vllm")
    less = (r["peak_gib"] - v["peak_gib"]) * 1024
    assert less == pytest.approx(generator / MiB, abs=2.0), less
    assert not v["planned"]["planned"].get("generator_copies")
    assert not v["posttrain"]["resident_gib"]["generator_copies"]


ADAPTER_SETS = ["parallel.world_size=1", "model.layers=1", "model.vocab_size=32768"]


def adapters_dry_run(recipe: str, schedule: str) -> dict:
    cmd = [python(), "-m", "tools.dryrun", f"--recipe={recipe}", "--json",
           f"--set=finetune.adapter_schedule={schedule}"]  # fmt: skip
    cmd += [f"--set={s}" for s in ADAPTER_SETS]
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    (rank,) = json.loads(p.stdout)["ranks"]
    assert "error" not in rank, rank
    return rank


def test_adapters_round_peak_is_the_hand_count(tmp_path):
    from tests.helpers.adapter_recipe import write_adapter_recipe

    recipe = write_adapter_recipe(tmp_path)
    P, V, d, rope = torchtitan_count(recipe, ADAPTER_SETS)
    base = (4 * P + rope) / MiB
    one = logits_work(2 * 64, V) / MiB  # one adapter's 2 rows x 64 tokens
    turns = adapters_dry_run(recipe, "turns")
    batched = adapters_dry_run(recipe, "batched")
    for r, n in ((turns, 1), (batched, 2)):
        measured = r["peak_gib"] * 1024
        assert measured == pytest.approx(base + n * one, rel=0.05), (n, measured, r["measured"])
        assert r["posttrain"]["resident_gib"]["adapters"] * 1024 < 2
        assert r["measured"]["peak"]["gradients_gib"] * 1024 < 2  # the base stays frozen
    assert (batched["peak_gib"] - turns["peak_gib"]) * 1024 == pytest.approx(one, rel=0.1)
