"""The vLLM engine process: one `vllm.LLM` over a Hugging Face folder, driven over a socket.

Runs under .venv-vllm's Python (`bash scripts/setup.sh --vllm`), never imported by the trainer:
vLLM pins its own torch and transformers. It imports only the standard library, torch,
safetensors, vllm and rl/weight_sync.py (torch only; from its folder, not as the trainer's
package); its top level is standard library only, so tests/unit/test_weight_sync.py runs its
handler with a stand-in LLM. rl/vllm_engine.py starts it (`python rl/vllm_server.py ADDRESS`,
the authentication key in TITANSCALE_ENGINE_KEY), connects, and sends one request at a time as
plain picklable dicts (lists of ints and floats, strings): no tensors cross the socket.

Requests ({"op": ...}) and what they do:
- init: build the LLM (folder, dtype, max_model_len, LoRA slots, KV-cache size, seed);
  prefix caching on, token ids in and out (no tokenizer), logprobs of the processed
  (temperature-scaled) distribution, as the trainer recomputes them.
- generate: a list of requests, each with its own prompt ids, sampling settings and LoRA
  adapter (or none): one `LLM.generate` call, so requests for several adapters run in the
  same engine batches (vLLM's multi-LoRA batching). A request with "prompt_logprobs": k (an
  int >= 0) also gets its prompt scored under its adapter (vLLM's prompt_logprobs: raw, i.e.
  temperature-1, logprobs): every sample carries "prompt" (log p(prompt[t] | prompt[:t]) for
  t >= 1) and "prompt_top" (per such position, the k most likely [ids, logprobs] by rank).
- load_weights: a safetensors file of HF-named tensors (full weights or a subset) loaded into
  the running model by the model's own `load_weights`; the prefix cache is reset (its keys
  and values came from the old weights).
- weight_sync_init: join the trainer's weight-sync group (rl/weight_sync.py, imported from
  the folder the trainer names: it needs only torch): each worker is rank 1 + its vLLM rank.
- weight_sync_receive: a manifest (rl.weight_sync.manifest); each worker receives the push
  over the group and loads it like load_weights (in-place reload, prefix cache reset).
- add_lora: load a PEFT adapter folder into the engine's LoRA cache now (its rank and
  modules checked by vLLM), rather than at its first request.
- remove_lora: drop an adapter from the engine's LoRA cache.
- score: teacher-forced logprobs of completions after prompts (prompt_logprobs).
- stats: the engine's KV-cache size in tokens.
Every reply is {"ok": value} or {"error": one line}; an error never ends the process.
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Listener
from typing import Any

# The engine core in this process (no second engine-core process: one process to watch,
# and its collective_rpc callables run here without cloudpickle transport).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load(worker: Any, path: str) -> int:
    """Runs on the engine's worker: HF-named tensors into the live model, through vLLM's
    in-place reload (the CPU backend repacks linear weights after loading, so the model's
    own load_weights cannot be called twice; reload_weights undoes and redoes that)."""
    from safetensors.torch import load_file

    sd = load_file(path)
    worker.model_runner.reload_weights(weights_iterator=iter(sd.items()))
    return len(sd)


def _wire(folder: str) -> Any:
    """rl/weight_sync.py as `weight_sync` (stdlib + torch only): the same protocol code the
    trainer sends with. `folder` is added to sys.path in whichever process runs this (the
    engine's, or a tensor-parallel worker's)."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import weight_sync

    return weight_sync


def _sync_init(worker: Any, cfg: dict[str, Any]) -> int:
    """Runs on each worker: join the trainer's group as rank 1 + the worker's vLLM rank."""
    ws = _wire(cfg["folder"])
    rank = 1 + int(getattr(worker, "rank", 0))
    store = ws.rendezvous(rank, cfg["world_size"], port=cfg["port"], timeout_s=cfg["timeout_s"])
    group = ws.join(store, cfg["backend"], rank, cfg["world_size"], cfg["timeout_s"])
    worker.titanscale_sync = (ws, group, store, ws.device_for(cfg["backend"]))
    return rank


def _sync_receive(worker: Any, man: dict[str, Any]) -> int:
    """Runs on each worker: one push received bucket by bucket straight into vLLM's in-place
    reload (as `_load`), no file and no whole second copy."""
    ws, group, _store, device = worker.titanscale_sync
    return int(ws.receive_into(
        group, man, device,
        lambda pairs: worker.model_runner.reload_weights(weights_iterator=iter(pairs)),
    ))  # fmt: skip


def _prompt_scores(out: Any, request: dict[str, Any]) -> dict[str, Any]:
    """A scored request's prompt: vLLM's prompt_logprobs hold, per position t >= 1, the
    prompt's own token and the k most likely ones (each with its rank; the prompt's token is
    there even when it is not in the top k)."""
    prompt, k = request["prompt"], int(request["prompt_logprobs"])
    own, top = [], []
    for t in range(1, len(prompt)):
        d = out.prompt_logprobs[t]
        own.append(float(d[prompt[t]].logprob))
        best = sorted((v.rank, tid, float(v.logprob)) for tid, v in d.items() if v.rank <= k)
        top.append([[tid for _, tid, _ in best[:k]], [lp for _, _, lp in best[:k]]])
    return {"prompt": own, "prompt_top": top}


class Engine:
    def __init__(self) -> None:
        self.llm: Any = None
        self.kv_tokens = 0

    def init(self, cfg: dict[str, Any]) -> dict[str, Any]:
        import torch
        from vllm import LLM

        kw: dict[str, Any] = {}
        if torch.cuda.is_available():
            kw["gpu_memory_utilization"] = cfg.get("gpu_memory_utilization", 0.3)
        if cfg.get("tensor_parallel_size", 1) > 1:
            kw["tensor_parallel_size"] = cfg["tensor_parallel_size"]
        if cfg.get("max_loras", 0) > 0:
            kw.update(
                enable_lora=True, max_loras=cfg["max_loras"], max_lora_rank=cfg["max_lora_rank"]
            )
        self.llm = LLM(
            model=cfg["folder"],
            skip_tokenizer_init=True,
            dtype=cfg.get("dtype", "float32"),
            max_model_len=cfg["max_model_len"],
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            seed=cfg.get("seed", 0),
            enforce_eager=True,
            max_num_seqs=cfg.get("max_num_seqs", 256),
            # 32 positions per KV block (the CPU kernels' smallest): the prefix cache reuses
            # whole blocks, so short conversations get hits from their second turn on.
            block_size=cfg.get("block_size", 32),
            **kw,
        )
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.kv_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        return {"kv_cache_tokens": self.kv_tokens}

    def generate(self, requests: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        from vllm import SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest

        prompts, params, loras = [], [], []
        for r in requests:
            prompts.append(TokensPrompt(prompt_token_ids=list(r["prompt"])))
            params.append(
                SamplingParams(
                    n=r.get("n", 1),
                    max_tokens=r["max_tokens"],
                    temperature=r.get("temperature", 1.0),
                    top_p=r.get("top_p", 1.0),
                    top_k=r.get("top_k", -1),
                    seed=r.get("seed"),
                    stop_token_ids=list(r.get("stop_token_ids", [])),
                    # the caller's stop tokens only (the service's stop=[] never stops early)
                    ignore_eos=bool(r.get("ignore_eos", False)),
                    logprobs=0,
                    prompt_logprobs=r.get("prompt_logprobs"),
                    detokenize=False,
                )
            )
            lora = r.get("lora")
            loras.append(LoRARequest(lora[0], int(lora[1]), lora[2]) if lora else None)
        outs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        result = []
        for out, r in zip(outs, requests, strict=True):
            samples = []
            scored = _prompt_scores(out, r) if r.get("prompt_logprobs") is not None else {}
            for c in out.outputs:
                toks = list(c.token_ids)
                lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], toks, strict=True)]
                samples.append({"tokens": toks, "logprobs": lps, "finish": c.finish_reason,
                                "cached": int(out.num_cached_tokens or 0), **scored})  # fmt: skip
            result.append(samples)
        return result

    def score(self, seqs: list[list[int]], starts: list[int]) -> list[list[float]]:
        from vllm import SamplingParams, TokensPrompt

        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(s)) for s in seqs], sp, use_tqdm=False
        )
        res = []
        for out, s, start in zip(outs, seqs, starts, strict=True):
            pl = out.prompt_logprobs
            res.append([float(pl[t][s[t]].logprob) for t in range(start, len(s))])
        return res

    def load_weights(self, path: str) -> int:
        (n,) = self.llm.collective_rpc(_load, args=(path,))
        self.llm.reset_prefix_cache()
        return int(n)

    def weight_sync_init(self, cfg: dict[str, Any]) -> list[int]:
        return [int(r) for r in self.llm.collective_rpc(_sync_init, args=(cfg,))]

    def weight_sync_receive(self, manifest: dict[str, Any]) -> int:
        counts = self.llm.collective_rpc(_sync_receive, args=(manifest,))
        self.llm.reset_prefix_cache()
        return int(counts[0])

    def add_lora(self, name: str, lora_id: int, path: str) -> bool:
        from vllm.lora.request import LoRARequest

        return bool(self.llm.llm_engine.add_lora(LoRARequest(name, int(lora_id), path)))

    def remove_lora(self, lora_id: int) -> bool:
        return bool(self.llm.llm_engine.remove_lora(int(lora_id)))

    def handle(self, msg: dict[str, Any]) -> Any:
        op = msg["op"]
        if op == "init":
            return self.init(msg["config"])
        if op == "generate":
            return self.generate(msg["requests"])
        if op == "score":
            return self.score(msg["seqs"], msg["starts"])
        if op == "load_weights":
            return self.load_weights(msg["path"])
        if op == "weight_sync_init":
            return self.weight_sync_init(msg["config"])
        if op == "weight_sync_receive":
            return self.weight_sync_receive(msg["manifest"])
        if op == "add_lora":
            return self.add_lora(msg["name"], msg["id"], msg["path"])
        if op == "remove_lora":
            return self.remove_lora(msg["id"])
        if op == "stats":
            return {"kv_cache_tokens": self.kv_tokens}
        raise ValueError(f"unknown op {op!r}")


def _exit_with_parent() -> None:
    """The trainer died before connecting or while connected: end with it."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main() -> None:
    _exit_with_parent()
    address = sys.argv[1]
    key = bytes.fromhex(os.environ.pop("TITANSCALE_ENGINE_KEY"))
    engine = Engine()
    with Listener(address, family="AF_UNIX", authkey=key) as listener:
        # One client: the trainer that started it. When it goes away (closed, killed) so does
        # the engine: no orphan holding memory.
        conn = listener.accept()
        with conn:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    os._exit(0)  # the trainer went away
                if msg.get("op") == "shutdown":
                    conn.send({"ok": True})
                    conn.close()
                    # Nothing to flush: skip vLLM's interpreter teardown (~10 s on 2 cores).
                    os._exit(0)
                try:
                    reply = {"ok": engine.handle(msg)}
                except Exception as e:
                    last = traceback.format_exception_only(type(e), e)[-1].strip()
                    reply = {"error": last.replace("\n", " ")[:500]}
                    if engine.llm is None:  # init failed: nothing to serve
                        conn.send(reply)
                        raise SystemExit(3) from None
                conn.send(reply)


if __name__ == "__main__":
    main()
