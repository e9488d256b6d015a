"""The service's operations: each SDK request becomes a validated `Op` on the scheduler that
calls the backend, or an immediate answer. No training logic lives here: losses, optimizer,
adapters and sampling are the backend's (the same objects train.py uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from service import proto, sampling, wire
from service.backend import Backend
from service.errors import ServiceError, bad_request
from service.futures import Future, FutureStore, Outcome
from service.scheduler import Op, Scheduler
from service.sessions import Model, Registry, Sampler
from service.storage import CheckpointRef, CheckpointStore, check_name, parse_tinker_path
from service.types import LoraSpec

log = logging.getLogger("service")
INTERNAL_OPS = ("free", "load_sampler")  # ops the service queues itself: no client polls them


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 64 << 20
    max_data: int = 1024  # datums per forward_backward request
    max_samples: int = 64  # num_samples per sample request
    retrieve_wait_s: float = 20.0  # long-poll time of retrieve_future


class Service:
    def __init__(
        self,
        backend: Backend,
        storage: CheckpointStore,
        loop: asyncio.AbstractEventLoop,
        *,
        limits: Limits = Limits(),
        session_ttl_s: float = 1800.0,
    ):
        self.backend = backend
        self.storage = storage
        self.limits = limits
        self.info = backend.base_model()
        self.futures = FutureStore(loop)
        self.scheduler = Scheduler(self.futures, devices=backend.devices)
        self.registry = Registry(session_ttl_s)
        self.records = sampling.StabilityRecords()  # what stable_reinforce trains on
        self.draining = False
        self.last_request = time.monotonic()  # set by the app on every request

    # --- immediate answers ------------------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": self.info.name,
                    "max_context_length": self.info.max_context,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    def check_base_model(self, name: str, field: str = "base_model") -> None:
        if name != self.info.name:
            raise bad_request(field, f"unknown base model {name!r}; served: {self.info.name!r}")

    def get_info(self, model_id: str) -> dict[str, Any]:
        m = self.registry.model(model_id)
        return {
            "type": "get_info",
            "model_id": m.model_id,
            "model_name": m.base_model,
            "model_data": {
                "arch": self.info.arch,
                "model_name": m.base_model,
                "tokenizer_id": self.info.tokenizer_id,
            },
            "is_lora": True,
            "lora_rank": m.lora.rank,
        }

    def usage(self, session_id: str) -> dict[str, Any]:
        with self.registry.lock:
            s = self.registry.sessions.get(session_id)
        if s is None:
            raise ServiceError(404, f"session {session_id!r} not found")
        u = self.scheduler.session_usage(session_id)
        return {
            "session_id": session_id,
            "device_seconds": u.device_seconds if u else 0.0,
            "devices": self.backend.devices,
            "ops": dict(u.ops) if u else {},
            "failed_ops": dict(u.failed) if u else {},
            "finished": s.finished,
        }

    # --- sessions -----------------------------------------------------------------------------

    def create_session(self, body: wire.CreateSessionBody) -> str:
        if self.draining:
            raise ServiceError(410, "the service is shutting down; no new sessions")
        s = self.registry.new_session(body.user_metadata)
        log.info("service.session created %s", s.session_id)
        return s.session_id

    def finish_session(self, session_id: str, reason: str) -> None:
        models, samplers = self.registry.finish(session_id, reason)
        self._free(session_id, models, samplers)
        self.records.drop_session(session_id)
        u = self.scheduler.session_usage(session_id)
        log.info(
            "service.session finished %s reason=%s device_s=%.3f",
            session_id,
            reason,
            u.device_seconds if u else 0.0,
        )

    def expire_sessions(self) -> None:
        for sid in self.registry.expired():
            self.finish_session(sid, "expired")

    def _free(self, session_id: str, models: list[Model], samplers: list[Sampler]) -> None:
        if not models and not samplers:
            return

        def run() -> Outcome:
            for m in models:
                if m.ready:
                    self.backend.drop_adapter(m.model_id)
            for s in samplers:
                if s.handle is not None:
                    self.backend.drop_sampler(s.handle)
            return Outcome(json={})

        for m in models:
            self.scheduler.close_lane(m.model_id)
        # Shutting down (410): the process is about to free everything anyway.
        with contextlib.suppress(ServiceError):
            self.scheduler.submit(Op(session_id, "free", run))

    # --- training -----------------------------------------------------------------------------

    def create_model(self, body: wire.CreateModelBody) -> Future:
        self.registry.session(body.session_id)
        self.check_base_model(body.base_model)
        if body.optimizer_config.type != "adamw":
            raise bad_request(
                "optimizer_config.type", f"{body.optimizer_config.type!r}: only adamw"
            )
        spec = wire.lora_spec(body.lora_config, max_rank=self.backend.max_lora_rank)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        with self.registry.lock:
            existing = self.registry.models.get(model_id)
        if existing is not None and existing.create_future is not None and existing.lora == spec:
            return existing.create_future  # an SDK retry of the same create
        m = Model(model_id, body.session_id, body.base_model, spec, body.user_metadata)
        self.registry.add_model(m)
        self.scheduler.open_lane(model_id, first_seq=1)

        def run() -> Outcome:
            self.backend.create_adapter(model_id, spec)
            m.ready = True
            return Outcome(json={"model_id": model_id, "type": "create_model"})

        m.create_future = self.scheduler.submit(
            Op(body.session_id, "create_model", run, on_error=lambda: self._unregister(model_id))
        )
        return m.create_future

    def _unregister(self, model_id: str) -> None:
        self.registry.remove_model(model_id)
        self.scheduler.close_lane(model_id)

    def forward_backward(self, raw: bytes, *, forward_only_path: bool = False) -> Future:
        req = proto.decode_forward_backward_request(raw)
        m = self.registry.model(req.model_id)
        data = wire.fwdbwd_data(
            req.data,
            req.loss_fn,
            vocab=self.info.vocab_size,
            max_len=self.info.max_context,
            max_data=self.limits.max_data,
        )
        wire.check_loss_config(req.loss_fn, req.loss_fn_config)
        if req.loss_fn == "stable_reinforce":  # the sampler's logprobs, from its records
            for i, d in enumerate(data):
                q, sampled = sampling.recorded_logprobs(
                    self.records, m.session_id, req.spans[i], d.inputs["target_tokens"],
                    where=f"data[{i}]",
                )  # fmt: skip
                d.inputs["logprobs"] = q
                d.inputs["advantages"] = d.inputs["advantages"] * sampled
        if req.loss_fn == "gspo":  # the sequence ratio's default tokens: the trained ones
            for d in data:
                if "sequence_ratio_mask" not in d.inputs:
                    d.inputs["sequence_ratio_mask"] = (d.inputs["advantages"] != 0).astype("f4")
        forward_only = req.forward_only or forward_only_path
        cfg = dict(req.loss_fn_config)

        def run() -> Outcome:
            r = self.backend.forward_backward(
                m.model_id, data, req.loss_fn, cfg, forward_only=forward_only
            )
            return Outcome(proto=proto.encode_forward_backward_output(r.outputs, r.metrics))

        kind = "forward" if forward_only else "forward_backward"
        return self.scheduler.submit(Op(m.session_id, kind, run, m.model_id, req.seq_id))

    def optim_step(self, body: wire.OptimStepBody) -> Future:
        m = self.registry.model(body.model_id)
        params = wire.adam_params(body)

        def run() -> Outcome:
            metrics = self.backend.optim_step(m.model_id, params)
            return Outcome(json={"metrics": metrics})

        return self.scheduler.submit(Op(m.session_id, "optim_step", run, m.model_id, body.seq_id))

    def save_weights(self, body: wire.SaveWeightsBody) -> Future:
        m = self.registry.model(body.model_id)
        ref = CheckpointRef(m.model_id, "weights", check_name(body.path or "", "path"))
        meta = {
            "base_model": m.base_model,
            "lora": m.lora.to_json(),
            "kind": "training",
            "user_metadata": body.user_metadata,
        }

        def run() -> Outcome:
            path = self.storage.save(
                ref,
                lambda d: self.backend.save_state(m.model_id, d),
                meta,
                overwrite=body.overwrite,
                ttl_seconds=body.ttl_seconds,
            )
            log.info("service.checkpoint saved %s", path)
            return Outcome(json={"path": path, "type": "save_weights"})

        return self.scheduler.submit(Op(m.session_id, "save_state", run, m.model_id, body.seq_id))

    def save_for_sampler(self, body: wire.SaveForSamplerBody) -> Future:
        m = self.registry.model(body.model_id)
        if body.kind != "snapshot":
            raise bad_request(
                "kind", f"{body.kind!r} sampling clients are not served; use snapshot"
            )
        if body.path is not None:
            ref = CheckpointRef(m.model_id, "sampler_weights", check_name(body.path, "path"))
            meta = {
                "base_model": m.base_model,
                "lora": m.lora.to_json(),
                "kind": "sampler",
                "user_metadata": body.user_metadata,
            }

            def run() -> Outcome:
                path = self.storage.save(
                    ref,
                    lambda d: self.backend.save_sampler_weights(m.model_id, d),
                    meta,
                    overwrite=True,
                    ttl_seconds=body.ttl_seconds,
                )
                return Outcome(json={"path": path, "type": "save_weights_for_sampler"})

        else:
            if body.sampling_session_seq_id is None:
                raise bad_request("path", "either path or sampling_session_seq_id is required")
            sampler_id = f"{m.session_id}:sample:{body.sampling_session_seq_id}"

            def run() -> Outcome:
                handle = self.backend.snapshot(m.model_id)
                self.registry.add_sampler(
                    Sampler(sampler_id, m.session_id, m.base_model, None, handle)
                )
                return Outcome(
                    json={"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
                )

        return self.scheduler.submit(
            Op(m.session_id, "save_for_sampler", run, m.model_id, body.seq_id)
        )

    def _checkpoint(self, path: str, field: str = "path") -> tuple[CheckpointRef, dict, Path]:
        ref = parse_tinker_path(path, field)
        meta = self.storage.meta(ref)
        return ref, meta, self.storage.folder(ref)

    def load_weights(self, body: wire.LoadWeightsBody) -> Future:
        ref, meta, folder = self._checkpoint(body.path)
        if ref.kind != "weights":
            raise bad_request("path", "load_state needs a training checkpoint (.../weights/...)")
        if body.session_id is not None:  # create a model from the checkpoint
            if body.model_seq_id is None:
                raise bad_request("model_seq_id", "required with session_id")
            self.registry.session(body.session_id)
            base = body.base_model or meta["base_model"]
            self.check_base_model(base)
            spec = LoraSpec(**meta["lora"])
            model_id = f"{body.session_id}:train:{body.model_seq_id}"
            with self.registry.lock:
                existing = self.registry.models.get(model_id)
            if existing is not None and existing.create_future is not None:
                return existing.create_future  # an SDK retry of the same load
            m = Model(model_id, body.session_id, base, spec, body.user_metadata)
            self.registry.add_model(m)
            self.scheduler.open_lane(model_id, first_seq=0)

            def run() -> Outcome:
                self.backend.create_adapter(model_id, spec)
                m.ready = True
                self.backend.load_state(model_id, folder, optimizer=body.optimizer)
                return Outcome(
                    json={"path": body.path, "model_id": model_id, "type": "load_weights"}
                )

            m.create_future = self.scheduler.submit(
                Op(
                    body.session_id,
                    "load_state",
                    run,
                    model_id,
                    0,
                    on_error=lambda: self._unregister(model_id),
                )
            )
            return m.create_future
        if body.model_id is None or body.seq_id is None:
            raise bad_request("model_id", "either model_id+seq_id or session_id+model_seq_id")
        m = self.registry.model(body.model_id)
        saved = LoraSpec(**meta["lora"])
        if replace(saved, seed=None) != replace(m.lora, seed=None):  # the init seed may differ
            raise bad_request("path", f"checkpoint LoRA {meta['lora']} differs from this model's")

        def run_existing() -> Outcome:
            self.backend.load_state(m.model_id, folder, optimizer=body.optimizer)
            return Outcome(json={"path": body.path, "model_id": m.model_id, "type": "load_weights"})

        return self.scheduler.submit(
            Op(m.session_id, "load_state", run_existing, m.model_id, body.seq_id)
        )

    # --- sampling -----------------------------------------------------------------------------

    def create_sampling_session(self, body: wire.CreateSamplingSessionBody) -> str:
        self.registry.session(body.session_id)
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        if body.model_path is None:
            if body.base_model is None:
                raise bad_request("base_model", "base_model or model_path is required")
            self.check_base_model(body.base_model)
            self.registry.add_sampler(
                Sampler(sampler_id, body.session_id, body.base_model, None, None)
            )
            return sampler_id
        ref, meta, folder = self._checkpoint(body.model_path, "model_path")
        spec = LoraSpec(**meta["lora"])
        s = Sampler(sampler_id, body.session_id, meta["base_model"], body.model_path)

        def run() -> Outcome:
            s.handle = self.backend.load_sampler(folder, spec)
            return Outcome(json={})

        # Loading is device work, so it queues like any other op; the sampler is usable once
        # registered, and its samples queue behind the load in the same session FIFO.
        self.registry.add_sampler(s)
        self.scheduler.submit(Op(body.session_id, "load_sampler", run))
        return sampler_id

    def sample(self, body: wire.SampleBody) -> tuple[Future, list[str]]:
        if body.sampling_session_id is None:
            raise bad_request("sampling_session_id", "required (create a sampling client first)")
        s = self.registry.sampler(body.sampling_session_id)
        req = sampling.sample_request(
            body,
            vocab=self.info.vocab_size,
            max_context=self.info.max_context,
            max_samples=self.limits.max_samples,
        )
        tokens = req.prompt.tolist()
        # Ids known before the op runs: the records the op writes use them.
        prefix = secrets.token_hex(8)
        ids = [f"{s.sampler_id}:{prefix}:{i}" for i in range(body.num_samples)]

        def run() -> Outcome:
            r = self.backend.sample(
                s.handle,
                tokens,
                body.num_samples,
                req.params,
                prompt_logprobs=req.prompt_logprobs,
                topk_prompt_logprobs=req.topk_prompt_logprobs,
                prompt_logprobs_last_n=req.prompt_logprobs_last_n,
            )
            seqs = [(q.tokens, q.logprobs, q.stop_reason) for q in r.sequences]
            if req.record:
                for sid, q in zip(ids, r.sequences, strict=True):
                    self.records.add(s.session_id, sid, req.prompt, q.tokens, q.logprobs)
            return Outcome(
                proto=proto.encode_sample_response(seqs, r.prompt_logprobs, r.topk_prompt)
            )

        fut = self.scheduler.submit(Op(s.session_id, "sample", run))
        return fut, ids


def outcome_json(o: Outcome) -> dict[str, Any]:
    if o.error is not None:
        return {"error": o.error, "category": o.category}
    assert o.json is not None
    return o.json
