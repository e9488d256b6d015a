"""The service's operations: each SDK request, on behalf of one tenant, becomes a validated
`Op` on the scheduler that calls the backend, or an immediate answer. No training logic lives
here: losses, optimizer, adapters and sampling are the backend's (the same objects train.py
uses).

Every method takes the caller's tenant and resolves ids through it (`Registry`, `FutureStore`,
the tenant's `CheckpointStore`): another tenant's session, model, sampler, future or
checkpoint is "not found", answered exactly like one that does not exist, and nothing of it
changes. Training requests carry a `seq_id`; one refused before it is queued still takes its
place in its model's order (`Scheduler.refuse`), so the client's next request runs.
Admission: forward_backward and sample are priced (service/admission.py) before they are
queued, and refused with 413 naming the limit when they can never fit.

Several bases (tools.serve --recipe A --recipe B): one `Base` (backend, what clients see of
it, its cost model) per served base, picked by the request's `base_model`; a model or
sampler keeps the base it was created on, and every op runs on that base's backend. The
scheduler, store, usage log, resident ledger and limits are shared: one worker runs every
base's ops, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from data.tokenizer import TOKENIZER_FILES
from service import proto, sampling, surface, wire
from service.accounting import AccountingLog, Prices, UsageIndex, billing_events, summarize
from service.admission import (
    CostModel,
    Price,
    Throughput,
    max_rows,
    price_forward_backward,
    price_sample,
)
from service.backend import NO_GENERATOR, Backend, BaseModelInfo, check_generator_capacity
from service.deadline import op_deadline
from service.errors import ServiceError, bad_request, log_safe, not_found, scrub_paths
from service.futures import Future, FutureStore, Outcome
from service.limits import Limits, check_count, check_metadata, check_stop
from service.resident import TRAINED_COPIES, ResidentLedger
from service.scheduler import Op, Scheduler, TokenBucket, merge_metrics, split_pieces
from service.sessions import Model, Registry, Sampler, Session
from service.storage import (
    KINDS,
    CheckpointRef,
    CheckpointStore,
    Storage,
    check_model_id,
    check_name,
    checkpoint_ref,
    parse_tinker_path,
)
from service.types import LoraSpec

log = logging.getLogger("service")
INTERNAL_OPS = ("free", "load_sampler")  # ops the service queues itself: no client polls them
GIB = 1 << 30


def _consumes_seq(e: ServiceError) -> bool:
    """A refusal takes its seq_id place unless the SDK sends the same request again as new
    (408/409/429) or the session ended (410). A 5xx takes it too: the SDK's retry of the same
    seq_id then gets the placeholder's error instead of waiting for a step that never runs."""
    return e.status >= 400 and e.status not in (408, 409, 410, 429)


def _as_service_error(e: Exception) -> ServiceError:
    """Any exception while validating a request as the one error the client gets (a damaged
    file's RecursionError, a bug's KeyError): 500 with the type only, logged with its trace."""
    if isinstance(e, ServiceError):
        return e
    log.error("service: validating a request failed", exc_info=e)
    return ServiceError(500, f"internal error ({type(e).__name__})")


@dataclass
class DecodedFwdBwd:
    """A forward_backward body decoded and checked off the event loop
    (`Service.decode_forward_backward`): the header, and the checked datums or the refusal
    that the request's seq_id place completes with."""

    req: proto.FwdBwdRequest
    data: list[Any]
    error: ServiceError | None = None
    base: str | None = None  # the base whose vocabulary and context checked the tokens


def _str_dict(d: dict[str, Any] | None) -> dict[str, str] | None:
    return None if d is None else {str(k): str(v) for k, v in d.items()}


@dataclass(frozen=True)
class Base:
    """One served base: its backend, what clients see of it, and its admission price."""

    backend: Backend
    info: BaseModelInfo
    cost: CostModel | None

    @classmethod
    def of(cls, backend: Backend, cost: CostModel | None) -> Base:
        # A backend that runs forward_backward in microbatches declares its token budget;
        # the same price function then charges one microbatch's memory (and admits more).
        mb = getattr(backend, "microbatch_tokens", None)
        priced = replace(cost, microbatch_tokens=mb) if cost is not None and mb else cost
        return cls(backend, backend.base_model(), priced)

    @property
    def name(self) -> str:
        return self.info.name


class Service:
    def __init__(
        self,
        backend: Backend | Sequence[Backend],
        storage: Storage,
        loop: asyncio.AbstractEventLoop,
        *,
        limits: Limits = Limits(),
        session_ttl_s: float = 1800.0,
        cost: CostModel | Sequence[CostModel | None] | None = None,
        accounting: AccountingLog | None = None,
    ):
        """`backend`: one, or one per served base (`cost`: one per backend, in order).
        Requests pick their base by name (`base_model`); models and samplers keep theirs."""
        backends = list(backend) if isinstance(backend, Sequence) else [backend]
        costs = list(cost) if isinstance(cost, Sequence) else [cost] * len(backends)
        if not backends or len(costs) != len(backends):
            raise ValueError("one cost model per backend")
        self.bases: dict[str, Base] = {}
        for b, c in zip(backends, costs, strict=True):
            base = Base.of(b, c)
            if base.name in self.bases:
                raise ValueError(f"two backends serve {base.name!r}")
            self.bases[base.name] = base
        devices = {b.devices for b in backends}
        if len(devices) != 1:  # one worker runs every base's ops on the same devices
            raise ValueError(f"the bases hold different device counts: {sorted(devices)}")
        first = backends[0]
        # The first base: the default where a request may name none (a single-base
        # service's tokenizer route) and of a stored run whose files name no base.
        self.default = next(iter(self.bases.values()))
        self.storage = storage
        self.limits = limits
        self.accounting = accounting
        # usage.jsonl read once; then every record the worker writes is added as it goes
        self.usage_index = UsageIndex(accounting.path if accounting is not None else None)
        self.prices = Prices()  # the operator's price table (tools.serve --prices)

        def record(r: dict[str, Any]) -> None:
            if accounting is not None:
                accounting.write(r)
            self.usage_index.add(r)

        self.futures = FutureStore(loop)
        self.throughput = Throughput()
        self.scheduler = Scheduler(
            self.futures,
            devices=first.devices,
            max_per_session=limits.max_queued_per_session,
            max_per_tenant=limits.max_queued_per_tenant,
            record=record,
            throughput=self.throughput,
            roots=(str(storage.root),),
            # Each op under a deadline priced like its admission (checked by one process's
            # backend; a resource's ranks have --op-timeout instead, service/deadline.py).
            deadline_s=lambda priced_s: op_deadline(
                priced_s, factor=limits.op_deadline_factor, min_s=limits.op_deadline_min_s
            ),
            tokens=TokenBucket(limits.token_rate, limits.token_burst)
            if limits.token_rate
            else None,
        )
        self.resident = ResidentLedger(limits.max_resident_bytes)
        self.published = surface.Published(storage.root)
        self.audit = surface.AuditLog(storage.root)
        self.registry = Registry(session_ttl_s)
        self.records = sampling.StabilityRecords()  # what stable_reinforce trains on
        self.draining = False
        self.last_request = time.monotonic()  # set by the app on every request
        self._roots = (str(storage.root),)

    def store(self, tenant: str) -> CheckpointStore:
        return self.storage.tenant(tenant)

    # --- immediate answers ------------------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": b.name,
                    "max_context_length": b.info.max_context,
                    "trainable": True,
                    "sampleable": self.sampling_off(b) is None,
                }
                for b in self.bases.values()
            ]
        }

    def sampling_off(self, base: Base | None = None) -> str | None:
        """Why `base` (default: the first) samples nothing (a model resource started with
        --generators 0, service/distributed.py), or None."""
        backend = (base or self.default).backend
        return None if getattr(backend, "generators", 1) else NO_GENERATOR

    def check_sampling(self, field: str, base: Base | None = None) -> None:
        """400 naming tools.serve's --generators before anything is queued or created."""
        why = self.sampling_off(base)
        if why is not None:
            raise bad_request(field, why)

    def max_chunk_len(self) -> int:
        """Datums of the full context one forward_backward may carry (the SDK's chunk size:
        it splits a larger batch into requests the admission check accepts; one figure for
        the whole service, so the smallest over the bases)."""
        budget = self.limits.max_request_bytes
        fits = [
            max(1, max_rows(b.cost, b.info.max_context, budget, self.limits.max_data))
            for b in self.bases.values()
            if b.cost is not None and budget is not None
        ]
        return min(fits, default=self.limits.max_data)

    def base(self, name: str, field: str = "base_model") -> Base:
        """The served base of that name, or 400 naming the field and every served base."""
        b = self.bases.get(name)
        if b is None:
            served = ", ".join(repr(n) for n in self.bases)
            raise bad_request(field, f"unknown base model {name!r}; served: {served}")
        return b

    def base_of(self, name: str) -> Base:
        """The base a registered model or sampler was created on (always served: the
        registry holds only what this process created)."""
        return self.bases[name]

    def tokenizer_files(self, tenant: str, base_model: str | None) -> dict[str, Any]:
        """The served tokenizer for a client's `AutoTokenizer.from_pretrained(tokenizer_id)`:
        `tokenizer_id` (a name, never a server path) and the text of the folder's tokenizer
        files (TOKENIZER_FILES: what AutoTokenizer reads of a Hugging Face folder).
        The tokenizer is the base's, the same for every tenant; 404 when none is served."""
        if base_model is not None:
            info = self.base(base_model).info
        elif len(self.bases) == 1:
            info = self.default.info
        else:
            served = ", ".join(repr(n) for n in self.bases)
            raise bad_request("base_model", f"required: this service serves {served}")
        folder = info.tokenizer_dir
        files: dict[str, str] = {}
        for name in TOKENIZER_FILES if folder else ():
            f = Path(folder or "", name)
            if f.is_file():
                files[name] = f.read_text(encoding="utf-8")
        if "tokenizer.json" not in files:
            raise not_found("tokenizer")
        return {"tokenizer_id": info.tokenizer_id or info.name, "files": files}

    def get_info(self, tenant: str, model_id: str) -> dict[str, Any]:
        m = self.registry.model(model_id, tenant)
        info = self.base_of(m.base_model).info
        return {
            "type": "get_info",
            "model_id": m.model_id,
            "model_name": m.base_model,
            "model_data": {
                "arch": info.arch,
                "model_name": m.base_model,
                "tokenizer_id": info.tokenizer_id,
            },
            "is_lora": True,
            "lora_rank": m.lora.rank,
        }

    def usage(self, tenant: str, session_id: str) -> dict[str, Any]:
        s = self.registry.any_session(session_id, tenant)
        u = self.scheduler.session_usage(session_id)
        return {
            "session_id": session_id,
            "device_seconds": u.device_seconds if u else 0.0,
            "devices": self.scheduler.devices,
            "ops": dict(u.ops) if u else {},
            "failed_ops": dict(u.failed) if u else {},
            "finished": s.finished,
        }

    def tenant_usage(self, tenant: str, since: float | None) -> dict[str, Any]:
        """The caller's usage from the accounting log (all time, or since `since`)."""
        if self.accounting is None:
            raise ServiceError(404, "usage accounting is off on this service")
        return summarize(self.usage_index.records(tenant, since)).tenant_json(tenant)

    def billing_usage(self, tenant: str, start: float, end: float) -> dict[str, Any]:
        """`get_billing_usage`: the caller's tokens by kind (and GPU-seconds) in [start, end)."""
        if end <= start:
            raise bad_request("ending_before", "must be after starting_on")
        records = self.usage_index.records(tenant, start, end)
        return billing_events(records, self.prices, self.default.name)

    # --- sessions -----------------------------------------------------------------------------

    def create_session(self, tenant: str, body: wire.CreateSessionBody) -> str:
        if self.draining:
            raise ServiceError(410, "the service is shutting down; no new sessions")
        check_metadata(body.user_metadata, "user_metadata", self.limits)
        check_count(
            "session",
            "live sessions",
            self.registry.count_sessions(tenant),
            self.limits.max_sessions_per_tenant,
            "max_sessions_per_tenant",
        )
        s = self.registry.new_session(body.user_metadata, tenant)
        s.display_name, s.project_id = body.display_name, body.project_id
        log.info("service.session created %s tenant=%s", s.session_id, log_safe(tenant))
        return s.session_id

    def heartbeat(self, tenant: str, session_id: str) -> None:
        self.registry.session(session_id, tenant)

    def finish_session(self, tenant: str, session_id: str, reason: str) -> None:
        models, samplers = self.registry.finish(session_id, reason, tenant)
        self._free(tenant, session_id, models, samplers)
        self.records.drop_session(session_id)
        u = self.scheduler.session_usage(session_id)
        log.info(
            "service.session finished %s tenant=%s reason=%s device_s=%.3f",
            session_id,
            log_safe(tenant),
            log_safe(reason),
            u.device_seconds if u else 0.0,
        )

    def expire_sessions(self) -> None:
        for sid, tenant in self.registry.expired():
            self.finish_session(tenant, sid, "expired")

    def sweep(self) -> None:
        """Periodic: drop fetched results (and the lanes' retry entries pointing at them),
        expire idle sessions, forget long-finished ones."""
        self.scheduler.forget(self.futures.sweep())
        self.expire_sessions()
        self.scheduler.forget_sessions(
            self.registry.forget_finished(self.limits.max_finished_sessions_per_tenant)
        )

    def _free(
        self, tenant: str, session_id: str, models: list[Model], samplers: list[Sampler]
    ) -> None:
        if not models and not samplers:
            return

        def run() -> Outcome:
            for m in models:
                if m.ready:
                    self.base_of(m.base_model).backend.drop_adapter(m.model_id)
            for s in samplers:
                if s.handle is not None:
                    self.base_of(s.base_model).backend.drop_sampler(s.handle)
            return Outcome(json={})

        for m in models:
            self.scheduler.close_lane(m.model_id)
            self.resident.release(m.model_id)
        for s in samplers:
            self.resident.release(s.sampler_id)
        # Shutting down (410): the process is about to free everything anyway.
        with contextlib.suppress(ServiceError):
            self.scheduler.submit(Op(session_id, "free", run, tenant=tenant, internal=True))

    # --- training -----------------------------------------------------------------------------

    def _run_info(self, m: Model) -> dict[str, Any]:
        return {
            "training_run_id": m.model_id,
            "base_model": m.base_model,
            "lora": m.lora.to_json(),
            "user_metadata": _str_dict(m.user_metadata),
            "session_id": m.session_id,
            "created_at": m.created,
        }

    def _new_model(
        self, tenant: str, session: Session, seq: int, base: str, spec: LoraSpec, meta: Any
    ) -> tuple[Model, Future | None]:
        """Register model `<session>:train:<seq>` (or return the existing one's create future:
        an SDK retry of the same create)."""
        model_id = f"{session.session_id}:train:{seq}"
        with self.registry.lock:
            existing = self.registry.models.get(model_id)
        if existing is not None and existing.create_future is not None and existing.lora == spec:
            return existing, existing.create_future
        check_count(
            "model_seq_id",
            "live models",
            self.registry.count_models(tenant),
            self.limits.max_models_per_tenant,
            "max_models_per_tenant",
        )
        self._admit_resident(
            model_id, tenant, spec, TRAINED_COPIES, "this model's adapter", self.base_of(base)
        )
        m = Model(model_id, session.session_id, base, spec, meta, tenant=tenant)
        try:
            self.registry.add_model(m)
        except BaseException:
            self.resident.release(model_id)
            raise
        return m, None

    def _admit_resident(
        self, key: str, tenant: str, spec: LoraSpec, copies: int, what: str, base: Base
    ) -> None:
        """Price what `key` will keep on the device (service/resident.py) before it exists:
        one ledger over every base (they share the device)."""
        price = getattr(base.backend, "adapter_bytes", None)
        if price is not None:
            self.resident.admit(key, tenant, copies * int(price(spec)), what)

    def create_model(self, tenant: str, body: wire.CreateModelBody) -> Future:
        session = self.registry.session(body.session_id, tenant)
        base = self.base(body.base_model)
        if body.optimizer_config.type != "adamw":
            raise bad_request(
                "optimizer_config.type", f"{body.optimizer_config.type!r}: only adamw"
            )
        spec = wire.lora_spec(body.lora_config, max_rank=base.backend.max_lora_rank)
        check_metadata(body.user_metadata, "user_metadata", self.limits)
        m, again = self._new_model(
            tenant, session, body.model_seq_id, body.base_model, spec, body.user_metadata
        )
        if again is not None:
            return again
        store = self.store(tenant)

        def run() -> Outcome:
            base.backend.create_adapter(m.model_id, spec)
            m.ready = True
            store.write_run(m.model_id, self._run_info(m))
            return Outcome(json={"model_id": m.model_id, "type": "create_model"})

        op = Op(session.session_id, "create_model", run, tenant=tenant, base=base.name)
        return self._submit_create(m, op)

    def _submit_create(self, m: Model, op: Op, first_seq: int = 1) -> Future:
        """Queue a model's creating op; refused (429 queue cap, 410 ...), nothing stays
        registered, so the SDK's retry of the same create is a new request (#41)."""
        self.scheduler.open_lane(m.model_id, first_seq=first_seq)
        op.on_error = lambda: self._unregister(m.model_id)
        try:
            m.create_future = self.scheduler.submit(op)
        except BaseException:
            self._unregister(m.model_id)
            raise
        return m.create_future

    def _unregister(self, model_id: str) -> None:
        self.registry.remove_model(model_id)
        self.scheduler.close_lane(model_id)
        self.resident.release(model_id)

    def _sequenced(
        self, tenant: str, model_id: str, seq_id: int, kind: str, build: Callable[[Model], Op]
    ) -> Future:
        """Queue a training request in its model's seq_id order. The model must be the
        tenant's (404 otherwise, nothing consumed); a refusal after that keeps the place."""
        m = self.registry.model(model_id, tenant)
        try:
            op = build(m)
            op.base = m.base_model  # usage records bill by base
            return self.scheduler.submit(op)
        except Exception as exc:  # whatever it is, the seq_id place is resolved (#41)
            e = _as_service_error(exc)
            if _consumes_seq(e):
                self.scheduler.refuse(
                    m.model_id, seq_id, tenant=tenant, session_id=m.session_id, kind=kind, error=e
                )
            if e is exc:
                raise
            raise e from None

    def refuse_request(self, tenant: str, raw: bytes, kind: str, error: ServiceError) -> None:
        """A JSON training request whose body failed validation: if it names a model of this
        tenant and a seq_id, the refusal still takes that place (see `Scheduler.refuse`)."""
        key = wire.sequence_key(raw)
        if key is None or not _consumes_seq(error):
            return
        m = self.registry.find_model(key[0], tenant)
        if m is not None:
            self.scheduler.refuse(
                m.model_id, key[1], tenant=tenant, session_id=m.session_id, kind=kind, error=error
            )

    def decode_forward_backward(self, raw: bytes, tenant: str | None = None) -> DecodedFwdBwd:
        """Decode and check a forward_backward body (no state touched: the app runs it off
        the event loop). Work and memory are bounded by the limits before anything is
        allocated for them (proto.Bounds: the largest served context); a refusal of a
        readable header is kept in the result so that it takes the request's seq_id place.
        Tokens are checked against the base of the named model when it is `tenant`'s (else
        the first base: the request is refused as not found when it is queued)."""
        widest = max(b.info.max_context for b in self.bases.values())
        bounds = proto.Bounds(max_data=self.limits.max_data, max_len=widest)
        try:
            req = proto.decode_forward_backward_request(raw, bounds)
        except ServiceError:
            raise
        except Exception as e:  # whatever the decoder trips on is the client's malformed body
            raise bad_request(
                "body", f"not a ForwardBackwardRequest protobuf ({type(e).__name__})"
            ) from None
        m = self.registry.find_model(req.model_id, tenant) if tenant is not None else None
        base = self.base_of(m.base_model) if m is not None else self.default
        out = DecodedFwdBwd(req, [], req.error, base.name)
        if out.error is None:
            try:
                out.data = wire.fwdbwd_data(
                    req.data,
                    req.loss_fn,
                    vocab=base.info.vocab_size,
                    max_len=base.info.max_context,
                    max_data=self.limits.max_data,
                )
                wire.check_loss_config(req.loss_fn, req.loss_fn_config)
            except Exception as e:
                out.error = _as_service_error(e)
        return out

    def forward_backward(
        self, tenant: str, raw: bytes | DecodedFwdBwd, *, forward_only_path: bool = False
    ) -> Future:
        decoded = (
            raw if isinstance(raw, DecodedFwdBwd) else self.decode_forward_backward(raw, tenant)
        )
        req = decoded.req
        forward_only = req.forward_only or forward_only_path
        kind = "forward" if forward_only else "forward_backward"

        def build(m: Model) -> Op:
            if decoded.error is not None:
                raise decoded.error
            base = self.base_of(m.base_model)
            if decoded.base != base.name:  # checked against another base's bounds
                raise bad_request(
                    "model_id", "the model was not known when this request was read; send it again"
                )
            data = decoded.data
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
            price = self._admit_forward_backward(base, [d.tokens.size for d in data], forward_only)
            cfg = dict(req.loss_fn_config)
            lengths = [int(d.tokens.size) for d in data]
            # Pieces at datum boundaries (service/scheduler.py, Fairness): the loss is a sum
            # over datums, so gradients accumulate over pieces as over microbatches.
            pieces = split_pieces(lengths, self.limits.piece_tokens)
            outputs: list[dict] = []
            parts: list[tuple[dict[str, float], int]] = []

            def run() -> Outcome | None:
                lo, hi = pieces[len(parts)]
                r = base.backend.forward_backward(
                    m.model_id, data[lo:hi], req.loss_fn, cfg, forward_only=forward_only
                )
                outputs.extend(r.outputs)
                parts.append((r.metrics, hi - lo))
                if len(parts) < len(pieces):
                    return None
                op.tokens = {"prefill" if forward_only else "trained": sum(lengths)}
                metrics = merge_metrics(parts)
                return Outcome(proto=proto.encode_forward_backward_output(outputs, metrics))

            op = Op(m.session_id, kind, run, m.model_id, req.seq_id, tenant=tenant, price=price)
            op.rate_tokens = sum(lengths)
            return op

        return self._sequenced(tenant, req.model_id, req.seq_id, kind, build)

    def _admit_forward_backward(
        self, base: Base, lengths: list[int], forward_only: bool
    ) -> Price | None:
        if base.cost is None:
            return None
        price = price_forward_backward(base.cost, lengths, forward_only=forward_only)
        budget = self.limits.max_request_bytes
        if budget is not None and price.bytes > budget:
            fit = max_rows(base.cost, price.length, budget, self.limits.max_data)
            raise ServiceError(
                413,
                f"this request needs about {price.gib:.2f} GiB of activation memory "
                f"({len(lengths)} datums padded to {price.length} tokens, "
                f"{price.microbatches} microbatch(es) of {price.rows}); this service admits "
                f"{budget / GIB:.2f} GiB per request (tools.serve --max-request-gib): send at "
                f"most {fit} datums of {price.length} tokens per request",
                field="data",
            )
        return price

    def optim_step(self, tenant: str, body: wire.OptimStepBody) -> Future:
        def build(m: Model) -> Op:
            params = wire.adam_params(body)

            def run() -> Outcome:
                metrics = self.base_of(m.base_model).backend.optim_step(m.model_id, params)
                return Outcome(json={"metrics": metrics})

            return Op(m.session_id, "optim_step", run, m.model_id, body.seq_id, tenant=tenant)

        return self._sequenced(tenant, body.model_id, body.seq_id, "optim_step", build)

    def _saver(
        self,
        tenant: str,
        m: Model,
        ref: CheckpointRef,
        write: Callable[[Path], None],
        answer: str,
        *,
        overwrite: bool,
        ttl_seconds: int | None,
        user_metadata: dict[str, str] | None,
    ) -> Callable[[], Outcome]:
        """The op that saves `ref` atomically into the tenant's storage."""
        check_metadata(user_metadata, "user_metadata", self.limits)
        store = self.store(tenant)
        meta = {
            "base_model": m.base_model,
            "lora": m.lora.to_json(),
            "kind": KINDS[ref.kind],
            "user_metadata": user_metadata,
        }

        def run() -> Outcome:
            path = store.save(ref, write, meta, overwrite=overwrite, ttl_seconds=ttl_seconds)
            log.info("service.checkpoint saved %s tenant=%s", path, log_safe(tenant))
            return Outcome(json={"path": path, "type": answer})

        return run

    def save_weights(self, tenant: str, body: wire.SaveWeightsBody) -> Future:
        def build(m: Model) -> Op:
            ref = CheckpointRef(m.model_id, "weights", check_name(body.path or "", "path"))
            self.check_quota(tenant)
            run = self._saver(
                tenant,
                m,
                ref,
                lambda d: self.base_of(m.base_model).backend.save_state(m.model_id, d),
                "save_weights",
                overwrite=body.overwrite,
                ttl_seconds=body.ttl_seconds,
                user_metadata=body.user_metadata,
            )
            return Op(m.session_id, "save_state", run, m.model_id, body.seq_id, tenant=tenant)

        return self._sequenced(tenant, body.model_id, body.seq_id, "save_state", build)

    def save_for_sampler(self, tenant: str, body: wire.SaveForSamplerBody) -> Future:
        def build(m: Model) -> Op:
            if body.kind != "snapshot":
                raise bad_request(
                    "kind", f"{body.kind!r} sampling clients are not served; use snapshot"
                )
            run: Callable[[], Outcome]
            if body.path is not None:
                ref = CheckpointRef(m.model_id, "sampler_weights", check_name(body.path, "path"))
                self.check_quota(tenant)
                run = self._saver(
                    tenant,
                    m,
                    ref,
                    lambda d: self.base_of(m.base_model).backend.save_sampler_weights(
                        m.model_id, d
                    ),
                    "save_weights_for_sampler",
                    overwrite=True,
                    ttl_seconds=body.ttl_seconds,
                    user_metadata=body.user_metadata,
                )
            else:
                if body.sampling_session_seq_id is None:
                    raise bad_request("path", "either path or sampling_session_seq_id is required")
                base = self.base_of(m.base_model)
                # a snapshot is for sampling
                self.check_sampling("sampling_session_seq_id", base)
                sampler_id = f"{m.session_id}:sample:{body.sampling_session_seq_id}"
                self._admit_resident(sampler_id, tenant, m.lora, 1, "this sampler snapshot", base)

                def run() -> Outcome:
                    handle = base.backend.snapshot(m.model_id)
                    s = Sampler(sampler_id, m.session_id, m.base_model, None, handle, tenant=tenant)
                    if self.registry.add_sampler(s) is not s:  # a retry: keep the first
                        base.backend.drop_sampler(handle)
                    return Outcome(
                        json={"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
                    )

            op = Op(m.session_id, "save_for_sampler", run, m.model_id, body.seq_id, tenant=tenant)
            if body.path is None:  # a snapshot that was not made holds nothing
                op.on_error = lambda: self.resident.release(sampler_id)
            return op

        return self._sequenced(tenant, body.model_id, body.seq_id, "save_for_sampler", build)

    def _checkpoint(
        self, tenant: str, path: str, field: str = "path"
    ) -> tuple[CheckpointRef, dict, Path]:
        """A checkpoint this tenant may read (its own, or one another tenant published): 404
        when missing or another tenant's unpublished one, 422 when damaged (meta.json, or a
        file that does not match the manifest)."""
        ref = parse_tinker_path(path, field)
        owner = self._reader_store(tenant, ref)
        store = self.store(owner)
        meta = store.meta(ref, verify=True)  # every load: manifest sizes and CRC32s
        if owner != tenant:  # a published checkpoint: the owner's audit log says who read it
            self.audit.add(owner, "checkpoint_read", tinker_path=ref.tinker_path, reader=tenant)
        return ref, meta, store.folder(ref)

    def _spec(self, ref: CheckpointRef, meta: dict) -> LoraSpec:
        try:
            return LoraSpec(**meta["lora"])
        except TypeError:
            raise ServiceError(
                422, f"checkpoint {ref.tinker_path} is damaged (meta.json: bad 'lora')"
            ) from None

    def _same_base(self, ref: CheckpointRef, meta: dict, base: str, field: str) -> Base:
        """The served base a checkpoint was saved on, when it is `base`: weights of one base
        never load onto another (their shapes and meaning differ), a 400 naming both."""
        saved = str(meta.get("base_model"))
        if saved != base:
            raise bad_request(
                field,
                f"checkpoint {ref.tinker_path} belongs to base model {saved!r}, not {base!r} "
                "(a checkpoint loads only onto the base it was trained on)",
            )
        return self.base(base, field)

    def _load_failed(self, what: str, e: Exception) -> ServiceError:
        """A checkpoint that fails to load: one clear error naming it (never a server path)."""
        if isinstance(e, ServiceError):
            return e
        detail = scrub_paths(f"{type(e).__name__}: {e}", self._roots)
        return ServiceError(500, f"{what} could not be loaded ({detail})")

    def load_weights(self, tenant: str, body: wire.LoadWeightsBody) -> Future:
        if body.session_id is not None:  # create a model from the checkpoint
            session = self.registry.session(body.session_id, tenant)
            if body.model_seq_id is None:
                raise bad_request("model_seq_id", "required with session_id")
            ref, meta, folder = self._checkpoint(tenant, body.path)
            if ref.kind != "weights":
                raise bad_request(
                    "path", "load_state needs a training checkpoint (.../weights/...)"
                )
            base = self._same_base(ref, meta, body.base_model or meta["base_model"], "path")
            spec = self._spec(ref, meta)
            check_metadata(body.user_metadata, "user_metadata", self.limits)
            m, again = self._new_model(
                tenant, session, body.model_seq_id, base.name, spec, body.user_metadata
            )
            if again is not None:
                return again
            store = self.store(tenant)

            def run() -> Outcome:
                base.backend.create_adapter(m.model_id, spec)
                m.ready = True
                try:
                    base.backend.load_state(m.model_id, folder, optimizer=body.optimizer)
                except Exception as e:
                    raise self._load_failed(f"checkpoint {ref.tinker_path}", e) from e
                store.write_run(m.model_id, self._run_info(m))
                return Outcome(
                    json={"path": body.path, "model_id": m.model_id, "type": "load_weights"}
                )

            op = Op(session.session_id, "load_state", run, m.model_id, 0, tenant=tenant)
            op.base = base.name
            return self._submit_create(m, op, first_seq=0)
        if body.model_id is None or body.seq_id is None:
            raise bad_request("model_id", "either model_id+seq_id or session_id+model_seq_id")

        def build(m: Model) -> Op:
            ref, meta, folder = self._checkpoint(tenant, body.path)
            if ref.kind != "weights":
                raise bad_request(
                    "path", "load_state needs a training checkpoint (.../weights/...)"
                )
            base = self._same_base(ref, meta, m.base_model, "path")
            saved = self._spec(ref, meta)
            if replace(saved, seed=None) != replace(m.lora, seed=None):  # the seed may differ
                raise bad_request(
                    "path", f"checkpoint LoRA {meta['lora']} differs from this model's"
                )

            def run() -> Outcome:
                try:
                    base.backend.load_state(m.model_id, folder, optimizer=body.optimizer)
                except Exception as e:
                    raise self._load_failed(f"checkpoint {ref.tinker_path}", e) from e
                return Outcome(
                    json={"path": body.path, "model_id": m.model_id, "type": "load_weights"}
                )

            return Op(m.session_id, "load_state", run, m.model_id, body.seq_id, tenant=tenant)

        return self._sequenced(tenant, body.model_id, body.seq_id, "load_state", build)

    # --- sampling -----------------------------------------------------------------------------

    def create_sampling_session(self, tenant: str, body: wire.CreateSamplingSessionBody) -> str:
        session = self.registry.session(body.session_id, tenant)
        field = "base_model" if body.model_path is None else "model_path"
        if all(self.sampling_off(b) for b in self.bases.values()):  # before any file is read
            self.check_sampling(field)
        sampler_id = f"{session.session_id}:sample:{body.sampling_session_seq_id}"
        if body.model_path is None:
            if body.base_model is None:
                raise bad_request("base_model", "base_model or model_path is required")
            self.check_sampling(field, self.base(body.base_model))
            self.registry.add_sampler(
                Sampler(sampler_id, session.session_id, body.base_model, None, None, tenant=tenant)
            )
            return sampler_id
        ref, meta, folder = self._checkpoint(tenant, body.model_path, "model_path")
        spec = self._spec(ref, meta)
        base = self._same_base(ref, meta, body.base_model or meta["base_model"], "model_path")
        self.check_sampling(field, base)
        s = Sampler(
            sampler_id,
            session.session_id,
            base.name,
            body.model_path,
            tenant=tenant,
            state="loading",
        )
        self._admit_resident(sampler_id, tenant, spec, 1, "this sampler's weights", base)
        if self.registry.add_sampler(s) is not s:
            return sampler_id  # an SDK retry of the same create

        def run() -> Outcome:
            try:
                s.handle = base.backend.load_sampler(folder, spec)
            except Exception as e:
                err = self._load_failed(f"sampler weights {ref.tinker_path}", e)
                s.state, s.error = "failed", err.message
                self.resident.release(sampler_id)
                raise err from e
            s.state = "ready"
            return Outcome(json={})

        # Loading is device work, so it queues like any other op; the sampler is usable once
        # registered, and its samples queue behind the load in the same session FIFO.
        self.scheduler.submit(
            Op(
                session.session_id,
                "load_sampler",
                run,
                tenant=tenant,
                internal=True,
                base=base.name,
            )
        )
        return sampler_id

    def join_sampler(self, tenant: str, sampler_id: str) -> int:
        s = self.registry.sampler(sampler_id, tenant)
        with self.registry.lock:
            n = s.clients
            s.clients += 1
        return n

    def sampler_info(self, tenant: str, sampler_id: str) -> dict[str, Any]:
        s = self.registry.sampler(sampler_id, tenant)
        return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def sample(self, tenant: str, body: wire.SampleBody) -> tuple[Future, list[str]]:
        if body.sampling_session_id is None:
            raise bad_request("sampling_session_id", "required (create a sampling client first)")
        s = self.registry.sampler(body.sampling_session_id, tenant)
        base = self.base_of(s.base_model)
        self.check_sampling("sampling_session_id", base)
        check_stop(body.sampling_params.stop, self.limits)
        req = sampling.sample_request(
            body,
            vocab=base.info.vocab_size,
            max_context=base.info.max_context,
            max_samples=self.limits.max_samples,
        )
        capacity = getattr(base.backend, "generator_tokens", None)
        if capacity is not None:
            check_generator_capacity(int(req.prompt.size) + req.params.max_tokens, capacity)
        check = getattr(base.backend, "check_sample", None)
        if check is not None:  # what this backend's sampler cannot give: 400 before queuing
            check(
                req.params,
                prompt_logprobs=req.prompt_logprobs,
                topk_prompt_logprobs=req.topk_prompt_logprobs,
            )
        price = self._admit_sample(
            base,
            int(req.prompt.size),
            req.params.max_tokens,
            body.num_samples,
            req.prompt_logprobs or req.topk_prompt_logprobs > 0,
        )
        tokens = req.prompt.tolist()
        # Ids known before the op runs (the stability records use them); random, so another
        # session cannot name them, and records are looked up within the session anyway.
        prefix = secrets.token_hex(8)
        ids = [f"{s.sampler_id}:{prefix}:{i}" for i in range(body.num_samples)]

        def run() -> Outcome:
            if s.state != "ready" or (s.model_path is not None and s.handle is None):
                # Never the base model in place of weights that did not load.
                raise ServiceError(422, s.error or "the sampler's weights are not loaded")
            r = base.backend.sample(
                s.handle,
                tokens,
                body.num_samples,
                req.params,
                prompt_logprobs=req.prompt_logprobs,
                topk_prompt_logprobs=req.topk_prompt_logprobs,
                prompt_logprobs_last_n=req.prompt_logprobs_last_n,
            )
            seqs = [(q.tokens, q.logprobs, q.stop_reason) for q in r.sequences]
            op.tokens = {
                "prefill": len(tokens) * body.num_samples,
                "sampled": sum(len(q.tokens) for q in r.sequences),
            }
            if req.record:
                for sid, q in zip(ids, r.sequences, strict=True):
                    self.records.add(s.session_id, sid, req.prompt, q.tokens, q.logprobs)
            return Outcome(
                proto=proto.encode_sample_response(seqs, r.prompt_logprobs, r.topk_prompt)
            )

        op = Op(s.session_id, "sample", run, tenant=tenant, price=price, base=base.name)
        # A backend sampling through an engine (tools.serve --sampler vllm) samples off the
        # worker: concurrent requests meet in one engine batch (service/vllm_sampler.py).
        op.detached = bool(getattr(base.backend, "detached_sampling", False))
        op.rate_tokens = (len(tokens) + req.params.max_tokens) * body.num_samples
        fut = self.scheduler.submit(op)
        return fut, ids

    def _admit_sample(
        self, base: Base, prompt_len: int, max_tokens: int, num_samples: int, prompt_lp: bool
    ) -> Price | None:
        if base.cost is None:
            return None
        price = price_sample(
            base.cost, prompt_len, max_tokens, num_samples, prompt_logprobs=prompt_lp
        )
        budget = self.limits.max_request_bytes
        if budget is not None and price.bytes > budget:
            raise ServiceError(
                413,
                f"sampling {num_samples} x (prompt {prompt_len} + {max_tokens} tokens) needs "
                f"about {price.gib:.2f} GiB (KV cache and prefill); this service admits "
                f"{budget / GIB:.2f} GiB per request (tools.serve --max-request-gib)",
                field="num_samples",
            )
        return price

    # --- futures ------------------------------------------------------------------------------

    def future(self, tenant: str, request_id: str) -> Future:
        fut = self.futures.get(request_id, tenant)
        if fut is None:
            raise not_found(f"request {request_id!r}", field="request_id")
        return fut

    # --- REST: training runs, checkpoints, sessions (tinker RestClient) -------------------------

    def _run_json(self, tenant: str, model_id: str) -> dict[str, Any] | None:
        live = self.registry.find_model(model_id, tenant)
        store = self.store(tenant)
        stored = store.run(model_id)
        if live is None and stored is None:
            return None
        items, damaged = store.list(model_id) if stored is not None else ([], [])
        info = self._run_info(live) if live is not None else (stored or {})
        lora = info.get("lora") if isinstance(info.get("lora"), dict) else None
        if lora is None and items:  # a run folder without run.json: read a checkpoint's meta
            with contextlib.suppress(ServiceError):
                meta = store.meta(parse_tinker_path(items[-1]["tinker_path"]))
                info = {**meta, **info}
                lora = meta.get("lora")
        last: dict[str, dict[str, Any] | None] = {"training": None, "sampler": None}
        for c in items:  # oldest first: the last of each type wins
            last[c["checkpoint_type"]] = c
        times = [c["time"] for c in items] + [float(info.get("created_at") or 0.0)]
        if live is not None:
            times.append(live.last_request)
        meta_in = info.get("user_metadata")
        return {
            "training_run_id": model_id,
            "base_model": str(info.get("base_model") or self.default.name),
            "model_owner": tenant,
            "is_lora": True,
            "corrupted": lora is None or bool(damaged),
            "lora_rank": lora.get("rank") if lora else None,
            "last_request_time": max(times),
            "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"],
            "user_metadata": _str_dict(meta_in) if isinstance(meta_in, dict) else None,
        }

    def training_run(self, tenant: str, model_id: str) -> dict[str, Any]:
        run = self._run_json(tenant, check_model_id(model_id, "training_run_id"))
        if run is None:
            raise not_found(f"training run {model_id!r}", field="training_run_id")
        return run

    def training_runs(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        ids = set(self.store(tenant).run_ids())
        with self.registry.lock:
            ids |= {m.model_id for m in self.registry.models.values() if m.tenant == tenant}
        runs = [r for i in ids if (r := self._run_json(tenant, i)) is not None]
        runs.sort(key=lambda r: r["last_request_time"], reverse=True)
        return {
            "training_runs": runs[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    def checkpoints(self, tenant: str, model_id: str) -> dict[str, Any]:
        check_model_id(model_id, "training_run_id")
        store = self.store(tenant)
        if store.run(model_id) is None and self.registry.find_model(model_id, tenant) is None:
            raise not_found(f"training run {model_id!r}", field="training_run_id")
        items, damaged = store.list(model_id)
        for d in damaged:
            log.warning(
                "service.checkpoint damaged tenant=%s %s: %s",
                log_safe(tenant),
                d["tinker_path"],
                d["problem"],
            )
        self._mark_public(items)
        return {"checkpoints": items, "cursor": None, "damaged": damaged}

    def user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        store = self.store(tenant)
        items: list[dict[str, Any]] = []
        damaged: list[dict[str, Any]] = []
        for rid in store.run_ids():
            a, b = store.list(rid)
            items += a
            damaged += b
        items.sort(key=lambda c: c["time"], reverse=True)
        self._mark_public(items)
        return {
            "checkpoints": items[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(items)},
            "damaged": damaged,
        }

    def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        ref = checkpoint_ref(model_id, checkpoint_id)
        self.store(tenant).delete(ref)
        self.published.set(ref.tinker_path, None)
        self.audit.add(tenant, "checkpoint_deleted", tinker_path=ref.tinker_path)
        log.info("service.checkpoint deleted %s tenant=%s", ref.tinker_path, log_safe(tenant))

    def set_checkpoint_ttl(
        self, tenant: str, model_id: str, checkpoint_id: str, ttl_seconds: int | None
    ) -> None:
        self.store(tenant).set_ttl(checkpoint_ref(model_id, checkpoint_id), ttl_seconds)

    def weights_info(self, tenant: str, tinker_path: str) -> dict[str, Any]:
        ref, meta, _ = self._checkpoint(tenant, tinker_path, "tinker_path")
        spec = self._spec(ref, meta)
        return {
            "base_model": meta["base_model"],
            "is_lora": True,
            "lora_rank": spec.rank,
            "train_unembed": spec.train_unembed,
            "train_mlp": spec.train_mlp,
            "train_attn": spec.train_attn,
        }

    def sessions(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        ids = [s.session_id for s in self.registry.tenant_sessions(tenant)]
        return {"sessions": ids[offset : offset + limit]}

    def session_info(self, tenant: str, session_id: str) -> dict[str, Any]:
        s = self.registry.any_session(session_id, tenant)
        return {
            "training_run_ids": sorted(s.models),
            "sampler_ids": sorted(s.samplers),
            "user_metadata": _str_dict(s.user_metadata),
            "display_name": s.display_name,
        }

    # --- the rest of the SDK's surface (service/surface.py) -------------------------------------

    def _mark_public(self, items: list[dict[str, Any]]) -> None:
        for c in items:
            c["public"] = self.published.owner(c["tinker_path"]) is not None

    def check_quota(self, tenant: str, field: str = "path") -> None:
        """413 before a save or copy when the tenant's checkpoints already fill its quota."""
        quota = self.limits.storage_quota_bytes
        if quota is None:
            return
        _, used = surface.folder_usage(self.store(tenant).root)
        if used >= quota:
            raise ServiceError(
                413,
                f"this tenant's checkpoints use {used} bytes of its {quota}-byte storage "
                "quota; delete some (RestClient.delete_checkpoint) first",
                field=field,
            )

    def storage_usage(self, tenant: str) -> dict[str, Any]:
        count, size = surface.folder_usage(self.store(tenant).root)
        return {
            "effective_rate_usd_per_gigabyte_month": None,
            "quota_bytes": self.limits.storage_quota_bytes,
            "data": [
                {
                    "project_id": None,
                    "user_name": tenant,
                    "checkpoint_count": count,
                    "size_bytes": size,
                    "size_gigabytes": size / 1e9,
                }
            ],
        }

    def _owned_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> CheckpointRef:
        ref = checkpoint_ref(model_id, checkpoint_id)
        self.store(tenant).meta(ref)  # 404 unless the caller's (a published one included)
        return ref

    def publish(self, tenant: str, model_id: str, checkpoint_id: str, on: bool) -> None:
        ref = self._owned_checkpoint(tenant, model_id, checkpoint_id)
        if self.published.set(ref.tinker_path, tenant if on else None):
            event = "checkpoint_published" if on else "checkpoint_unpublished"
            self.audit.add(tenant, event, tinker_path=ref.tinker_path)

    def copy_weights(self, tenant: str, body: surface.CopyWeightsBody) -> dict[str, Any]:
        ref, meta, _ = self._checkpoint(tenant, body.source_path, "source_path")
        self.check_quota(tenant, "source_path")
        owner = self._reader_store(tenant, ref)
        path = surface.copy_checkpoint(
            self.store(owner), ref, self.store(tenant), meta, body.ttl_seconds
        )
        self.audit.add(tenant, "checkpoint_copied", tinker_path=path, source=ref.tinker_path)
        return {"tinker_path": path}

    def _reader_store(self, tenant: str, ref: CheckpointRef) -> str:
        """Whose store holds `ref` for this reader: its own, or the publishing owner's."""
        if not self.store(tenant).exists(ref):
            owner = self.published.owner(ref.tinker_path)
            if owner is not None:
                return owner
        return tenant

    def session_trace(self, tenant: str, session_id: str) -> dict[str, Any]:
        self.registry.any_session(session_id, tenant)
        u = self.scheduler.session_usage(session_id)
        ops = list(u.trace) if u is not None else []
        return {"status": "ready", "url": surface.trace_url(session_id, ops)}

    def set_project(self, tenant: str, session_id: str, project_id: str) -> None:
        if not project_id:
            raise bad_request("project_id", "required")
        s = self.registry.any_session(session_id, tenant)
        s.project_id = project_id[:128]

    def search_sessions(self, tenant: str, body: surface.SessionSearchBody) -> dict[str, Any]:
        """The tenant's sessions, newest first, filtered by the request's fields."""
        out = []
        cursor, statuses = body.cursor_key(), body.status_types()
        for s in sorted(
            self.registry.tenant_sessions(tenant),
            key=lambda s: (surface.micros(s.created), s.session_id),
            reverse=True,
        ):
            status = "active" if s.finished is None else "client_finished"
            if cursor is not None and (surface.micros(s.created), s.session_id) >= cursor:
                continue
            if body.session_id is not None and s.session_id != body.session_id:
                continue
            if body.display_name is not None and body.display_name not in (s.display_name or ""):
                continue
            if body.project_ids is not None and s.project_id not in body.project_ids:
                continue
            meta = _str_dict(s.user_metadata) or {}
            if any(meta.get(k) != v for k, v in body.user_metadata.items()):
                continue
            if statuses is not None and status not in statuses:
                continue
            out.append(s)
        page, more = out[: body.limit], len(out) > body.limit
        return {
            "sessions": [
                {
                    "session_id": s.session_id,
                    "created_at": surface.iso(s.created),
                    "owner": tenant,
                    "project_id": s.project_id or "",
                    "status": {"type": "active"}
                    if s.finished is None
                    else {"type": "client_finished", "detail": s.finished},
                    "checkpoints_count": sum(
                        len(self.store(tenant).list(m)[0])
                        for m in s.models
                        if self.store(tenant).run(m) is not None
                    ),
                    "display_name": s.display_name,
                    "user_metadata": _str_dict(s.user_metadata),
                }
                for s in page
            ],
            "next_cursor": {
                "last_created_at": surface.iso(page[-1].created),
                "last_session_id": page[-1].session_id,
            }
            if more
            else None,
        }


def outcome_json(o: Outcome) -> dict[str, Any]:
    if o.error is not None:
        return {"error": o.error, "category": o.category}
    assert o.json is not None
    return o.json
