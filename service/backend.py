"""The narrow interface between the service and a model backend.

The service owns HTTP, ordering, fairness, futures, sessions, storage and accounting; a
backend owns one frozen base model on this process's device(s) and any number of LoRA
adapters on it, addressed by an opaque `adapter` string. Every method is called from the
scheduler's single worker thread, one at a time, so a backend needs no locking, and an
adapter's results never depend on what other adapters did in between (the service's
isolation guarantee rests on that: adapters take turns on the shared base).

Errors: raise `ServiceError` for a request the client got wrong (it fails the future with
category "user"); anything else fails it with category "server". Either way the service
keeps serving.

Optional attributes the service reads when present: `microbatch_tokens` (admission prices a
microbatch), `generators` (0: the backend samples nothing; sampling requests are refused
with NO_GENERATOR before anything is queued) and `generator_tokens` (the KV-cache positions
its generator holds: a longer prompt + max_tokens is a 413, `check_generator_capacity`),
`check_sample(params, *, prompt_logprobs, topk_prompt_logprobs)` (raises a 400 naming the
field for what its sampler cannot give, before the request is queued) and
`detached_sampling` (True: `sample` may run off the worker thread, beside other ops).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from service.errors import ServiceError
from service.types import AdamParams, Datum, FwdBwdResult, LoraSpec, SampleResult, SamplingParams


@dataclass(frozen=True)
class BaseModelInfo:
    name: str  # what clients pass as base_model
    max_context: int  # tokens per sequence
    vocab_size: int
    arch: str
    tokenizer_id: str | None = None
    # Server side only (never sent: a path of this machine): the folder whose files
    # GET /api/v1/tokenizer hands to clients.
    tokenizer_dir: str | None = None


class Backend(Protocol):
    devices: int  # accelerators held: device-seconds = wall seconds x devices
    max_lora_rank: int

    def base_model(self) -> BaseModelInfo: ...

    def create_adapter(self, adapter: str, spec: LoraSpec) -> None: ...

    def drop_adapter(self, adapter: str) -> None: ...

    def forward_backward(
        self,
        adapter: str,
        data: list[Datum],
        loss_fn: str,
        loss_config: dict[str, float | str],
        *,
        forward_only: bool,
    ) -> FwdBwdResult:
        """Per-datum `logprobs` of target_tokens (and the loss's outputs) and `name:reduction`
        metrics; unless `forward_only`, add the loss's gradient to the adapter's gradients
        (they accumulate until `optim_step`)."""
        ...

    def optim_step(self, adapter: str, params: AdamParams) -> dict[str, float]:
        """One AdamW step on the accumulated gradients, then zero them."""
        ...

    def save_state(self, adapter: str, folder: Path) -> None:
        """Adapter weights + optimizer state (everything `load_state` needs) into `folder`."""
        ...

    def load_state(self, adapter: str, folder: Path, *, optimizer: bool) -> None: ...

    def save_sampler_weights(self, adapter: str, folder: Path) -> None:
        """Adapter weights only (PEFT-style safetensors) into `folder`."""
        ...

    def snapshot(self, adapter: str) -> str:
        """Freeze the adapter's current weights for sampling; returns a sampler handle."""
        ...

    def load_sampler(self, folder: Path, spec: LoraSpec) -> str:
        """Load sampler weights saved by `save_sampler_weights`; returns a sampler handle."""
        ...

    def drop_sampler(self, handle: str) -> None: ...

    def sample(
        self,
        handle: str | None,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        *,
        prompt_logprobs: bool,
        topk_prompt_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> SampleResult:
        """Sample from the adapter behind `handle` (None: the base model alone). Prompt
        logprobs (and the top-k ones when k > 0) score the last `prompt_logprobs_last_n`
        prompt tokens (None: all but the first)."""
        ...


NO_GENERATOR = (
    "sampling is off: this resource serves training only (tools.serve --generators 0); "
    "sample from a resource with a generator (sampler weights saved here load there)"
)


def check_generator_capacity(total: int, capacity: int) -> None:
    """A sample of `total` positions (prompt + max_tokens) within the generator's KV cache,
    or 413 naming the option that sizes it."""
    if total > capacity:
        raise ServiceError(
            413,
            f"prompt + max_tokens = {total} positions exceed this resource's generator of "
            f"{capacity} (tools.serve --generator-tokens)",
            field="sampling_params.max_tokens",
        )
