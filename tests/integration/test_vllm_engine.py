"""The vLLM engine (rl/vllm_engine.py, rl/vllm_server.py) against our own torchtitan model.

One engine for the session (tests/conftest.py `vllm_engine`, float32, heads padded 16 -> 64
for vLLM's CPU kernels). References are independent of vLLM: the KV-cache generator and the
training forward on the torchtitan model (greedy tokens, logprobs), a formula for the bytes of
a PEFT adapter, and the engine's own one-adapter answers for the multi-LoRA batch (also
through the service's EngineSampler with more adapters than the engine's LoRA slots). Every
test of the session engine lives in this file: under `--dist loadfile` one worker starts it.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.lora import base_state
from rl.generator import Generator, SamplingParams
from rl.mismatch import mismatch_stats
from rl.policy import token_logprobs
from rl.vllm_engine import VllmGenerator
from tests.helpers.vllm_models import ALPHA, RANK, bound, random_adapter

pytestmark = [pytest.mark.vllm]

PROMPTS = [[1, 5, 7, 9], [1, 100, 200, 300, 400], [1, 42]]
GREEDY = SamplingParams(max_tokens=6, top_p=1e-9)


def _native_greedy(model: torch.nn.Module) -> list[list[int]]:
    return [s.tokens for s in Generator.from_model(model).generate(PROMPTS, GREEDY)]


def test_engine_samples_and_scores_as_the_trainer_model(vllm_engine):
    engine, model, view = vllm_engine
    gen = VllmGenerator(engine, view)
    assert [s.tokens for s in gen.generate(PROMPTS, GREEDY)] == _native_greedy(model)
    samples = gen.generate(PROMPTS, SamplingParams(max_tokens=6, n=4, seed=1))
    assert len(samples) == 4 * len(PROMPTS) and {s.version for s in samples} == {0}
    assert [s.prompt_index for s in samples] == [i for i in range(len(PROMPTS)) for _ in range(4)]
    # The trainer's logprobs of vLLM's tokens (its own full forward, float32).
    ours = []
    for s in samples:
        p = PROMPTS[s.prompt_index]
        lp = token_logprobs(model, torch.tensor([p + s.tokens]))[0, len(p) - 1 :]
        ours.append(lp.tolist())
    mm = mismatch_stats([s.logprobs for s in samples], ours)
    assert math.isfinite(mm["train_infer_kl"]) and mm["train_infer_kl"] >= 0
    assert mm["train_infer_max_abs_diff"] < 1e-3, mm


def test_lora_update_sends_only_the_adapter(vllm_engine):
    """A LoRA policy's update is its adapter alone (PEFT folder): the bytes written equal the
    adapter tensors' (by formula, + headers), a small fraction of a full push; the engine then
    samples what the torchtitan model with that adapter gives."""
    engine, model, view = vllm_engine
    gen = VllmGenerator(engine, view, lora_rank=RANK, lora_alpha=ALPHA)
    adapter = random_adapter(model, seed=3)
    gen.update_weights(adapter, version=1)
    sent = gen.bytes_sent
    c = model.layers["0"].attention
    n, kv, to, r = c.n_heads, c.n_kv_heads or c.n_heads, view.head_dim, RANK
    dim, hidden = (
        model.tok_embeddings.weight.shape[1],
        model.layers["0"].feed_forward.w1.out_features,
    )
    per_layer = (
        3 * r * dim
        + (n + 2 * kv) * to * r  # q, k, v: A each (shared values) and B rows
        + r * n * to
        + dim * r  # o_proj: A over the padded heads, B
        + 2 * (r * dim + hidden * r)
        + (r * hidden + dim * r)  # gate, up, down
    )
    tensor_bytes = 4 * per_layer * len(model.layers)
    assert tensor_bytes <= sent <= tensor_bytes + 64 * 1024, (sent, tensor_bytes)
    assert [s.tokens for s in gen.generate(PROMPTS, GREEDY)] == _native_greedy(
        bound(model, adapter)
    )
    assert {s.version for s in gen.generate(PROMPTS[:1], GREEDY)} == {1}
    # A full-weight push of the same base (the session engine keeps its weights) for scale.
    full = VllmGenerator(engine, view)
    full.update_weights(base_state(model), version=1)
    base_bytes = 4 * sum(v.numel() for v in base_state(model).values())
    assert full.bytes_sent >= base_bytes and sent * 10 < full.bytes_sent


def test_collective_push_loads_into_the_running_engine(vllm_engine):
    """rl.weight_sync = "nccl"'s path with gloo standing in for NCCL (CPU): the trainer's
    WeightSync broadcasts a perturbed base in 64 KiB buckets, the engine's worker receives it
    (rl/vllm_server.py, the same rl/weight_sync.py inside vLLM's venv and torch) straight into
    vLLM's in-place reload; the engine then samples what our generator gives on that model.
    The original base goes back by file after (the session engine is shared)."""
    import copy
    import gc

    from rl.vllm_engine import WeightSync

    engine, model, view = vllm_engine
    base = base_state(model)
    gen = torch.Generator().manual_seed(7)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    ref = copy.deepcopy(model)
    ref.load_state_dict(moved, strict=False)
    sync = WeightSync.open(engine, backend="gloo", workers=1, dtype=torch.float32, timeout_s=120)
    sync.bucket_bytes = 64 * 1024
    pushed = VllmGenerator(engine, view, sync=sync)
    try:
        assert _native_greedy(ref) != _native_greedy(model)  # the push is visible
        pushed.update_weights(moved, version=1)
        assert [s.tokens for s in pushed.generate(PROMPTS, GREEDY)] == _native_greedy(ref)
        assert pushed.bytes_sent == 4 * sum(v.numel() for v in view.tensors(moved).values())
    finally:
        pushed.sync = sync = None  # type: ignore[assignment]
        gc.collect()  # gloo's objects before the interpreter's exit (tools.cli.exit_process)
        VllmGenerator(engine, view).update_weights(base, version=0)
    assert [s.tokens for s in VllmGenerator(engine, view).generate(PROMPTS, GREEDY)] == (
        _native_greedy(model)
    )


def test_two_adapters_in_one_engine_batch_each_get_their_own_tokens(vllm_engine, tmp_path):
    """Multi-LoRA: requests for two adapters in one engine call (vLLM batches them together)
    each get exactly the greedy tokens that adapter gives alone."""
    engine, model, view = vllm_engine
    loras = []
    for i, seed in enumerate((11, 12)):
        folder = str(tmp_path / f"tenant{i}")
        view.write_adapter(folder, random_adapter(model, seed), rank=RANK, alpha=ALPHA)
        loras.append((f"tenant{i}", 1000 + i, folder))

    def req(prompt, lora):
        return {"prompt": prompt, "max_tokens": 6, "top_p": 1e-9, "lora": lora}

    mixed = [req(p, lora) for p in PROMPTS for lora in loras]
    together = engine.call("generate", requests=mixed)
    for k, lora in enumerate(loras):
        alone = engine.call("generate", requests=[req(p, lora) for p in PROMPTS])
        assert [g[0]["tokens"] for g in together[k :: len(loras)]] == [
            g[0]["tokens"] for g in alone
        ]
    a, b = together[0::2], together[1::2]
    assert any(x[0]["tokens"] != y[0]["tokens"] for x, y in zip(a, b, strict=True))
    for _, i, _ in loras:
        engine.call("remove_lora", id=i)


def test_multi_turn_episodes_reuse_the_conversation_prefix(vllm_engine):
    """ChainSum over 3 turns through rl.multiturn.run_episodes: vLLM's episodes equal the
    built-in generator's (greedy, same conversations), from the second turn on the engine's
    prefix cache holds each conversation's earlier blocks (32 positions each), and the
    episodes' training rows put vLLM's logprobs on the model's tokens only."""
    from rl.envs import ChainSum
    from rl.multiturn import run_episodes

    engine, model, view = vllm_engine
    env = ChainSum(turns=3)
    tasks = env.tasks("train", 3, seed=0)
    g = torch.Generator().manual_seed(5)
    # a distinct 40-token preamble per episode: no episode reuses another's blocks
    pre = {t.prompt: torch.randint(300, 2000, (40,), generator=g).tolist() for t in tasks}

    def encode(text: str) -> list[int]:
        return [1, *pre[text], *(ord(c) for c in text)]

    def decode(ids: list[int]) -> str:
        return "".join(chr(i) if 32 <= i < 127 else "?" for i in ids)

    kw = dict(encode=encode, encode_reply=lambda s: [ord(c) for c in s], decode=decode,
              params=SamplingParams(max_tokens=3, top_p=1e-9))  # fmt: skip
    vllm_gen = VllmGenerator(engine, view)
    cached: list[int] = []

    class PerTurn:  # the engine's prefix-cache hits of each turn
        def generate(self, prompts, params):
            before = vllm_gen.cached_prompt_tokens
            out = vllm_gen.generate(prompts, params)
            cached.append(vllm_gen.cached_prompt_tokens - before)
            return out

    ours = run_episodes(Generator.from_model(model), env, tasks, **kw)
    theirs = run_episodes(PerTurn(), env, tasks, **kw)
    assert [e.tokens for e in theirs] == [e.tokens for e in ours]
    assert [len(e.turns) for e in theirs] == [3, 3, 3]
    assert [e.reward for e in theirs] == [e.reward for e in ours]
    assert sum(m for e in theirs for m in e.model_mask) == 3 * 3 * 3
    assert cached[0] == 0 and all(c >= 32 * len(tasks) for c in cached[1:]), cached
    # Sampled episodes as the RL loop trains them (rl.loop.RLRun.episode_rollout + collate):
    # the loss mask is the model's turns, where vLLM's sampling logprobs sit at the positions
    # predicting them (the training forward over the whole conversation agrees within
    # float32 noise); the replies' positions hold none. (Greedy's logprobs are of the
    # truncated distribution, all 0: docs/vllm.md.)
    from rl.loop import RLRun
    from rl.trainer import collate

    sampled = run_episodes(
        vllm_gen, env, tasks, **{**kw, "params": SamplingParams(max_tokens=3, seed=3)}
    )  # type: ignore[arg-type]
    c = collate([RLRun.episode_rollout(e) for e in sampled], 0, torch.device("cpu"))
    assert int(c.mask.sum()) == sum(len(e.logprobs) for e in sampled) == 27
    for b, e in enumerate(sampled):
        pi = token_logprobs(model, torch.tensor([e.tokens]))[0]
        want = [i - 1 for i, m in enumerate(e.model_mask) if m]
        assert c.mask[b].nonzero().flatten().tolist() == want
        assert torch.allclose(c.sampling_logprobs[b, want], pi[want], atol=1e-3)
        assert not c.sampling_logprobs[b][c.mask[b] == 0].any()


def test_tis_correction_changes_the_update_on_the_real_gap(vllm_engine):
    """vLLM's sampling logprobs (mu) against the trainer's (pi_old) on the same weights: the
    gap is real (behaviour KL > 0), and GRPO's gradient with truncated importance weights
    (tis_cap) differs from the uncorrected one; with mu := pi_old (no gap) the two are equal,
    so the difference is the correction acting on the engine's numerics."""
    import copy

    from rl.losses import LossBatch, LossConfig, get_loss

    engine, model, view = vllm_engine
    samples = VllmGenerator(engine, view).generate(
        PROMPTS, SamplingParams(max_tokens=6, n=4, seed=7)
    )
    policy = copy.deepcopy(model).requires_grad_(False)
    policy.lm_head.weight.requires_grad_(True)
    T = max(len(s.tokens) for s in samples)
    mu = torch.zeros(len(samples), T)
    mask = torch.zeros(len(samples), T)
    rows = []
    for b, s in enumerate(samples):
        p = PROMPTS[s.prompt_index]
        rows.append(token_logprobs(policy, torch.tensor([p + s.tokens]))[0, len(p) - 1 :])
        mu[b, : len(s.tokens)] = torch.tensor(s.logprobs)
        mask[b, : len(s.tokens)] = 1
    adv = torch.tensor([1.0, -1.0] * (len(samples) // 2))

    def grad(tis_cap: float, behaviour: torch.Tensor) -> torch.Tensor:
        policy.lm_head.weight.grad = None
        logprobs = torch.zeros(len(samples), T)
        for b, r in enumerate(rows):
            logprobs = logprobs.index_put((torch.full((len(r),), b), torch.arange(len(r))), r)
        old = logprobs.detach()
        batch = LossBatch(mask, adv, sampling_logprobs=behaviour, old_logprobs=old)
        get_loss("grpo", LossConfig(tis_cap=tis_cap))(logprobs, batch).backward(retain_graph=True)
        return policy.lm_head.weight.grad.clone()

    old = torch.zeros(len(samples), T)
    for b, r in enumerate(rows):
        old[b, : len(r)] = r.detach()
    gap = mismatch_stats(mu, old, mask)
    assert gap["train_infer_kl"] > 0 and gap["train_infer_max_abs_diff"] > 0, gap
    plain, corrected = grad(0.0, mu), grad(2.0, mu)
    assert not torch.equal(plain, corrected)
    assert torch.equal(grad(0.0, old), grad(2.0, old))  # no gap: the correction is the identity


def test_more_adapters_than_engine_slots_in_one_call(vllm_engine, tmp_path):
    """EngineSampler on the session engine (2 LoRA slots, 2 cached): 3 adapters sampled in one
    engine call each give their own greedy tokens (vLLM runs them in turns and reloads the
    evicted one from its folder); a dropped adapter is a 404, a request beyond the KV cache
    a 413."""
    import threading

    from posttrain.lora import export_peft
    from rl.generator import SamplingParams
    from service.errors import ServiceError
    from service.vllm_sampler import EngineSampler
    from tests.helpers.vllm_models import ALPHA, RANK, random_adapter

    engine, model, view = vllm_engine
    greedy = SamplingParams(max_tokens=6, top_p=1e-9)
    sampler = EngineSampler(engine, view, window_s=0.5, first_id=10_000)  # ids of its own
    try:
        alone = {}
        for i in range(3):
            folder = tmp_path / f"a{i}"
            export_peft(str(folder), model_config=view.model_config,
                        adapter=random_adapter(model, 40 + i),
                        state_dict_adapter=view.state_dict_adapter, rank=RANK, alpha=ALPHA)  # fmt: skip
            sampler.add_adapter(f"h{i}", str(folder))
            alone[f"h{i}"] = sampler.sample(f"h{i}", [1, 5, 7, 9], greedy)[0]["tokens"]
        assert len({tuple(v) for v in alone.values()}) == 3, alone
        got: dict[str, list[int]] = {}
        start = threading.Barrier(3)

        def client(h: str) -> None:
            start.wait()
            got[h] = sampler.sample(h, [1, 5, 7, 9], greedy)[0]["tokens"]

        threads = [threading.Thread(target=client, args=(h,)) for h in alone]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert sampler.batch_sizes[-1] == 3 and sorted(sampler.batches[-1]) == sorted(alone)
        assert got == alone
        sampler.drop_adapter("h0")
        with pytest.raises(ServiceError) as e:
            sampler.sample("h0", [1, 5, 7, 9], greedy)
        assert e.value.status == 404
        with pytest.raises(ServiceError) as e:
            sampler.sample(None, [1, 5, 7, 9], SamplingParams(max_tokens=10**7))
        assert e.value.status == 413
        for h in ("h1", "h2"):
            sampler.drop_adapter(h)
    finally:
        sampler.close()
