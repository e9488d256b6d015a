"""The generate pair's worker: rl.generator.Generator on titanscale's model and transformers
`generate` on the exported one, in one process, timed interleaved (greedy and sampled), the
greedy outputs compared token for token."""

from __future__ import annotations

import json
import time
from typing import Any

from benchmarks.peerbench.config import ROOT
from benchmarks.peerbench.hf_workers import _hf_model, device


def _titan_model(dcp: str):
    """The base as torchtitan's model (recipes/debug.toml's model), weights from the DCP
    checkpoint (single process: torch.distributed.checkpoint without a process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp_api

    from recipe.loader import load_recipe
    from runtime.build import recipe_model_spec

    recipe = load_recipe(str(ROOT / "recipes" / "debug.toml"), [])
    model = recipe_model_spec(recipe).model.build()
    model.init_states()
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp_api.load(sd, checkpoint_id=dcp)
    model.load_state_dict(sd)
    return model.eval()  # float32 already (never `.to(dtype)`: it would cast RoPE's complex cache)


def w_gen(a: dict) -> dict:
    """rl.generator.Generator vs transformers generate, both sides in this process, timed
    interleaved; greedy outputs compared token for token."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from data.chat import make_renderer
    from rl.envs import make_env
    from rl.generator import Generator, SamplingParams

    torch.set_num_threads(a["threads"])
    tok = AutoTokenizer.from_pretrained(a["hf"])
    # Half arithmetic prompts (what the base was trained on), half letter-sorting chat prompts
    # of 3-5 letters (other lengths: left padding on both sides).
    n_ar = a["prompts"] // 2
    tasks = make_env("arithmetic", timeout_s=0).tasks("train", n_ar, seed=1)
    prompts = [
        [tok.bos_token_id] + tok(t.prompt, add_special_tokens=False)["input_ids"] for t in tasks
    ]
    renderer = make_renderer(a["hf"])
    lines = (ROOT / "data" / "tasks" / "letter_sort" / "train.jsonl").read_text().splitlines()
    for line in lines[: a["prompts"] - n_ar]:
        prompts.append(
            renderer.prompt_ids([{"role": "user", "content": json.loads(line)["prompt"]}])
        )
    dev = device()
    titan = _titan_model(a["dcp"]).to(dev)
    gen = Generator(titan, dtype=torch.float32, pad_id=tok.pad_token_id)
    hf = _hf_model(a["hf"]).to(dev).eval()
    hf.generation_config.eos_token_id = None  # fixed length on both sides (no stop token)
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), tok.pad_token_id)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    T, G = a["max_new"], a["group"]

    def ours(greedy: bool):
        params = SamplingParams(
            max_tokens=T, temperature=1.0, top_p=1e-9 if greedy else 1.0, n=1 if greedy else G,
            seed=0,
        )  # fmt: skip
        return [s.tokens for s in gen.generate(prompts, params)]

    def peer(greedy: bool):
        cfg = GenerationConfig(
            max_new_tokens=T, min_new_tokens=T, do_sample=not greedy, temperature=1.0, top_k=0,
            top_p=1.0, num_return_sequences=1 if greedy else G, pad_token_id=tok.pad_token_id,
            eos_token_id=None, use_cache=True,
        )  # fmt: skip
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, P:].tolist()

    res: dict[str, Any] = {
        f"{who}_{mode}_{unit}": []
        for who in ("ours", "peer")
        for mode in ("greedy", "sampled")
        for unit in ("s", "cpu_s")
    }
    ours(True), peer(True)  # warm-up (first-call allocations), not timed
    for r in range(a["repeats"] + 1):
        for mode, greedy in (("greedy", True), ("sampled", False)):
            order = [("ours", ours), ("peer", peer)]
            if r % 2:
                order.reverse()
            for who, fn in order:
                t0, c0 = time.perf_counter(), time.process_time()
                out = fn(greedy)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if r > 0:  # repeat 0 is a second warm-up
                    res[f"{who}_{mode}_s"].append(dt)
                    res[f"{who}_{mode}_cpu_s"].append(dc)
                if mode == "greedy":
                    res[f"_{who}_greedy_out"] = out
                lengths = {len(x) for x in out}
                assert lengths == {T}, f"{who} {mode}: completion lengths {lengths}, expected {T}"
    a_out, b_out = res.pop("_ours_greedy_out"), res.pop("_peer_greedy_out")
    same = sum(x == y for x, y in zip(a_out, b_out, strict=True))
    first_diff = [next((j for j, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), None)
                  for x, y in zip(a_out, b_out, strict=True)]  # fmt: skip
    res["greedy_identical"] = {
        "rows": len(a_out),
        "identical": same,
        "first_difference_at": first_diff,
    }
    res["prompt_lengths"] = sorted({len(p) for p in prompts})
    res["greedy_tokens"] = len(prompts) * T
    res["sampled_tokens"] = len(prompts) * G * T
    return res
