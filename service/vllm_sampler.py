"""The service's sampling seam onto a vLLM engine: many tenants' adapters in one engine batch.

`EngineSampler` holds one `rl.vllm_engine.VllmEngine` (started with LoRA slots) and the sampler
weights loaded into it as LoRA adapters: `add_adapter(handle, folder)` takes a PEFT folder (what
`save_weights_for_sampler` writes), copies it (heads padded as the engine's base) under a fresh
adapter id and loads it into the engine at once (`add_lora`: a folder vLLM refuses is a 422
now, not a failure at the first sample). The engine keeps `max_loras` adapters in its batch
slots and as many in its cache, evicting the least recently used and reloading it from its
folder when asked again, so any number of sampling clients may exist; a batch holding more
adapters than slots runs them in turns (vLLM's scheduler). `drop_adapter` removes one.

`sample(...)` blocks its caller; a dispatcher thread gathers every request that arrives
within `window_s` of the first and sends them to the engine in one `generate` call, where
vLLM batches requests of different adapters together (multi-LoRA). Each caller gets its own
samples back. Every engine call is logged (`service.engine_batch requests=N adapters=K
handles=...`) and kept in `batches`: what the service test reads to see two tenants in one
batch.

Admission: a request whose positions (prompt + max_tokens, times n) exceed the engine's KV
cache (reported by the engine at start-up, in tokens) is refused with 413 before it is queued
(`service.backend.check_generator_capacity`), and a request names an adapter that is loaded
or gets 404; no request falls back to the base model silently.

Wired into the HTTP server by `tools.serve --sampler vllm` (service/titan_backend.py
`TitanLoraBackend.engine`: every sampling client samples here; docs/vllm.md "The service").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rl.generator import SamplingParams
from rl.vllm_engine import EngineError, HFView, VllmEngine
from service.backend import check_generator_capacity
from service.errors import ServiceError, bad_request

log = logging.getLogger("service")


@dataclass
class _Pending:
    request: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: list[dict[str, Any]] | None = None
    error: BaseException | None = None


class EngineSampler:
    def __init__(
        self, engine: VllmEngine, view: HFView, *, window_s: float = 0.005, first_id: int = 1
    ) -> None:
        """`first_id`: the first LoRA id it gives (vLLM caches adapters by id: an engine
        shared with another user of ids, as in the tests' session engine, needs its own)."""
        self.engine, self.view, self.window_s = engine, view, window_s
        self.kv_tokens = int(engine.info.get("kv_cache_tokens", 0))
        self._adapters: dict[str, tuple[str, int, str]] = {}
        self._next_id = first_id
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._cv = threading.Condition()
        self._closed = False
        self.batch_sizes: list[int] = []  # requests per engine call, in order
        self.batches: list[tuple[str, ...]] = []  # each engine call's adapter per request
        self.max_lora_rank = int(engine.cfg.max_lora_rank)
        self._inflight: dict[str, int] = {}  # handle -> requests queued or running
        self._doomed: dict[str, tuple[str, int, str]] = {}  # dropped, still in flight
        self._thread = threading.Thread(target=self._dispatch, name="vllm-sampler", daemon=True)
        self._thread.start()

    # -- adapters ----------------------------------------------------------------------
    def add_adapter(self, handle: str, folder: str) -> None:
        """Load a PEFT folder (adapter_model.safetensors + adapter_config.json) as `handle`;
        heads padded as the engine's base (rl.vllm_engine.pad_heads) into the engine's own
        folder, so later changes to `folder` do not reach the engine. A rank above the
        engine's is a 400; a folder the engine refuses, 422."""
        from safetensors.torch import load_file, save_file

        from posttrain.lora import PEFT_CONFIG, PEFT_WEIGHTS

        with open(os.path.join(folder, PEFT_CONFIG)) as f:
            rank = int(json.load(f).get("r", 0))
        if rank > self.max_lora_rank:
            raise bad_request(
                "lora_config.rank",
                f"rank {rank} exceeds the sampling engine's {self.max_lora_rank} "
                "(tools.serve --sampler vllm)",
            )
        with self._lock:
            lora_id = self._next_id
            self._next_id += 1
        dst = os.path.join(self.engine.workdir, f"sampler-{lora_id}")
        os.makedirs(dst)
        try:
            shutil.copyfile(os.path.join(folder, PEFT_CONFIG), os.path.join(dst, PEFT_CONFIG))
            save_file(self.view.pad(load_file(os.path.join(folder, PEFT_WEIGHTS))),
                      os.path.join(dst, PEFT_WEIGHTS))  # fmt: skip
            self.engine.call("add_lora", name=handle, id=lora_id, path=dst)
        except EngineError as e:
            shutil.rmtree(dst, ignore_errors=True)
            if self.engine.proc.poll() is not None:  # the engine itself is gone
                raise ServiceError(503, "the sampling engine failed; retry later") from e
            # vLLM's message names the engine's folder: the tenant gets the fact only
            raise ServiceError(422, "the sampler weights do not load into the engine") from e
        except BaseException:
            shutil.rmtree(dst, ignore_errors=True)
            raise
        with self._lock:
            self._adapters[handle] = (handle, lora_id, dst)

    def drop_adapter(self, handle: str) -> None:
        """New requests for `handle` get 404 at once; the engine forgets it (and its folder
        goes) once no queued or running request of it is left, so freeing a sampling client
        never fails an engine batch other tenants share."""
        with self._lock:
            entry = self._adapters.pop(handle, None)
            if entry is not None and self._inflight.get(handle, 0) > 0:
                self._doomed[handle] = entry
                entry = None
        if entry is not None:
            self._forget(entry)

    def _forget(self, entry: tuple[str, int, str]) -> None:
        try:
            self.engine.call("remove_lora", id=entry[1])
        finally:
            shutil.rmtree(entry[2], ignore_errors=True)

    # -- sampling ------------------------------------------------------------------------
    def sample(
        self,
        handle: str | None,
        prompt: list[int],
        params: SamplingParams,
        *,
        ignore_eos: bool = False,
        prompt_logprobs: int | None = None,
    ) -> list[dict[str, Any]]:
        """params.n samples of `prompt` from adapter `handle` (None: the base model):
        [{"tokens", "logprobs", "finish"}]. `ignore_eos`: stop at params.stop_tokens only
        (not at the EOS of the engine's model config). `prompt_logprobs` = k: the prompt
        scored under the same adapter in the same engine call, each sample then also has
        "prompt" and "prompt_top" (rl/vllm_server.py)."""
        check_generator_capacity((len(prompt) + params.max_tokens) * params.n, self.kv_tokens)
        lora = None
        if handle is not None:
            with self._lock:
                lora = self._adapters.get(handle)
                if lora is not None:
                    self._inflight[handle] = self._inflight.get(handle, 0) + 1
            if lora is None:
                raise ServiceError(404, "sampler weights are not loaded")
        try:
            return self._submit(lora, prompt, params, ignore_eos, prompt_logprobs)
        finally:
            if handle is not None:
                with self._lock:
                    self._inflight[handle] -= 1
                    left = self._inflight[handle]
                    if not left:
                        del self._inflight[handle]
                    doomed = self._doomed.pop(handle, None) if not left else None
                if doomed is not None:  # its engine failure is not this request's
                    with contextlib.suppress(EngineError):
                        self._forget(doomed)

    def _submit(
        self,
        lora: tuple[str, int, str] | None,
        prompt: list[int],
        params: SamplingParams,
        ignore_eos: bool,
        prompt_logprobs: int | None = None,
    ) -> list[dict[str, Any]]:
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
                "ignore_eos": ignore_eos,
                "lora": lora,
                "prompt_logprobs": prompt_logprobs,
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
            names = tuple(p.request["lora"][0] if p.request["lora"] else "base" for p in batch)
            self.batches.append(names)
            log.info(
                "service.engine_batch requests=%d adapters=%d handles=%s",
                len(batch),
                len(set(names)),
                ",".join(names),
            )
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


# The engine tools.serve --sampler vllm starts: adapters in one batch (LoRA slots) and the
# largest adapter rank it takes (vLLM's LoRA buffers are sized by it).
ENGINE_LORAS = 4
ENGINE_LORA_RANK = 64


def start_engine(
    backend: Any, recipe: Any, *, loras: int = ENGINE_LORAS, window_s: float = 0.02
) -> EngineSampler:
    """One vLLM engine over `backend`'s base (its own weights as loaded or initialised,
    exported as the Hugging Face view the RL loop's engine uses: rl.vllm_engine.HFView, heads
    padded on CPU), bound to the backend as `backend.engine`; the service's KV-cache
    admission then prices the engine's cache (`generator_tokens`). The Hugging Face folder
    lives in shared memory until the engine has loaded it. `window_s`: how long the first
    request of an engine call waits for others to join it."""
    import tempfile

    from core.errors import ConfigError
    from posttrain.lora import base_state
    from rl.vllm_engine import EngineConfig, _shm_dir, served_head_dim
    from runtime.platform import Platform

    view = HFView(backend.model_config, backend.state_dict_adapter, family=recipe.model.family)
    try:
        view.head_dim = served_head_dim(view.heads()[2], cpu=Platform.detect().is_cpu)
    except ValueError as e:
        raise ConfigError(str(e), file=recipe.source, key="--sampler") from None
    state = {
        k.replace("_checkpoint_wrapped_module.", ""): v
        for k, v in base_state(backend.model, copy=False).items()
    }
    folder = tempfile.mkdtemp(prefix="titanscale-vllm-base-", dir=_shm_dir() or None)
    try:
        view.write_folder(folder, state)
        engine = VllmEngine(
            EngineConfig(
                folder,
                dtype="float32" if recipe.training.dtype == "float32" else "bfloat16",
                max_model_len=int(backend.info.max_context),
                max_loras=loras,
                max_lora_rank=ENGINE_LORA_RANK,
                seed=int(recipe.training.seed),
            ),
            file=recipe.source,
            key="--sampler",
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    sampler = EngineSampler(engine, view, window_s=window_s)
    backend.engine = sampler
    backend.generator_tokens = sampler.kv_tokens
    return sampler
