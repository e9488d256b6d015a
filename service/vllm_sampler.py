"""The service's sampling seam onto a vLLM engine: many tenants' adapters in one engine batch.

`EngineSampler` holds one `rl.vllm_engine.VllmEngine` (started with LoRA slots) and the sampler
weights loaded into it as LoRA adapters: `add_adapter(handle, folder)` takes a PEFT folder (what
`save_weights_for_sampler` writes) and registers it under a fresh adapter id. `sample(...)`
blocks its caller; a dispatcher thread gathers every request that arrives within `window_s`
of the first and sends them to the engine in one `generate` call, where vLLM batches requests
of different adapters together (multi-LoRA). Each caller gets its own samples back.

Admission: a request whose positions (prompt + max_tokens, times n) exceed the engine's KV
cache (reported by the engine at start-up, in tokens) is refused with 413 before it is queued
(`service.backend.check_generator_capacity`), and a request names an adapter that is loaded
or gets 404; no request falls back to the base model silently.

Not yet wired into the HTTP server (`tools.serve`): the backend's `sample` calls this when the
service is started with an engine (docs/vllm.md).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl.generator import SamplingParams
from rl.vllm_engine import HFView, VllmEngine
from service.backend import check_generator_capacity
from service.errors import ServiceError


@dataclass
class _Pending:
    request: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: list[dict[str, Any]] | None = None
    error: BaseException | None = None


class EngineSampler:
    def __init__(self, engine: VllmEngine, view: HFView, *, window_s: float = 0.005) -> None:
        self.engine, self.view, self.window_s = engine, view, window_s
        self.kv_tokens = int(engine.info.get("kv_cache_tokens", 0))
        self._adapters: dict[str, tuple[str, int, str]] = {}
        self._next_id = 1
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._cv = threading.Condition()
        self._closed = False
        self.batch_sizes: list[int] = []  # requests per engine call, in order
        self._thread = threading.Thread(target=self._dispatch, name="vllm-sampler", daemon=True)
        self._thread.start()

    # -- adapters ----------------------------------------------------------------------
    def add_adapter(self, handle: str, folder: str) -> None:
        """Load a PEFT folder (adapter_model.safetensors + adapter_config.json) as `handle`;
        heads padded as the engine's base (rl.vllm_engine.pad_heads) into the engine's own
        folder, so later changes to `folder` do not reach the engine."""
        from safetensors.torch import load_file, save_file

        from posttrain.lora import PEFT_CONFIG, PEFT_WEIGHTS

        with self._lock:
            lora_id = self._next_id
            self._next_id += 1
        dst = os.path.join(self.engine.workdir, f"sampler-{lora_id}")
        os.makedirs(dst)
        shutil.copyfile(os.path.join(folder, PEFT_CONFIG), os.path.join(dst, PEFT_CONFIG))
        save_file(self.view.pad(load_file(os.path.join(folder, PEFT_WEIGHTS))),
                  os.path.join(dst, PEFT_WEIGHTS))  # fmt: skip
        with self._lock:
            self._adapters[handle] = (handle, lora_id, dst)

    def drop_adapter(self, handle: str) -> None:
        with self._lock:
            entry = self._adapters.pop(handle, None)
        if entry is not None:
            self.engine.call("remove_lora", id=entry[1])
            shutil.rmtree(entry[2], ignore_errors=True)

    # -- sampling ------------------------------------------------------------------------
    def sample(
        self, handle: str | None, prompt: list[int], params: SamplingParams
    ) -> list[dict[str, Any]]:
        """params.n samples of `prompt` from adapter `handle` (None: the base model):
        [{"tokens", "logprobs", "finish"}]."""
        check_generator_capacity((len(prompt) + params.max_tokens) * params.n, self.kv_tokens)
        lora = None
        if handle is not None:
            with self._lock:
                lora = self._adapters.get(handle)
            if lora is None:
                raise ServiceError(404, "sampler weights are not loaded")
        p = _Pending(
            {
                "prompt": list(prompt),
                "n": params.n,
                "max_tokens": params.max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "seed": params.seed,
                "stop_token_ids": list(params.stop_tokens),
                "lora": lora,
            }
        )
        with self._cv:
            if self._closed:
                raise ServiceError(503, "the sampling engine is shut down")
            self._queue.append(p)
            self._cv.notify()
        p.done.wait()
        if p.error is not None:
            raise p.error
        assert p.result is not None
        return p.result

    def _dispatch(self) -> None:
        wait: Callable[[float], bool] = threading.Event().wait
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed and not self._queue:
                    return
            wait(self.window_s)  # let concurrent requests join this engine call
            with self._cv:
                batch, self._queue = self._queue, []
            self.batch_sizes.append(len(batch))
            try:
                outs = self.engine.call("generate", requests=[p.request for p in batch])
                for p, out in zip(batch, outs, strict=True):
                    p.result = out
            except Exception:  # every waiter hears of it: no silent failure. The engine's own
                # message may name server paths: the tenant gets a 503 without it.
                for p in batch:
                    p.error = ServiceError(503, "the sampling engine failed; retry later")
            for p in batch:
                p.done.set()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)
