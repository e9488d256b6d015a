"""Sampling from the policy: a KV-cache decode path over a torchtitan decoder's own modules.

torchtitan's Llama has no KV cache, so decoding here walks the model's modules itself (the
same `tok_embeddings`, `attention_norm`, `qkv_linear`, `rope`, `wo`, `ffn_norm`,
`feed_forward`, `norm`, `lm_head` objects and weights) and keeps keys and values per layer.
Prompts are left-padded; padded keys are masked and RoPE positions count from each row's
first real token, so a row's logits equal the model's full forward on that row alone (checked
in tests/unit/test_rl_generator.py to 1e-5 in float32).

Each prompt is prefilled once: its keys and values are copied to its `n` sample rows
(`torch.index_select` of the prefill cache), so a group costs one prefill, not `n`.
Sampling draws from a `torch.Generator` of its own (seeded by `SamplingParams.seed`, else
from the OS), never from or into torch's global RNG. Stops: token ids (`stop_tokens`, the
caller adds EOS) and strings (`stop_strings`, matched on the decoded completion with the
`decode` callable the generator is given); a stopped sample ends with the token that
completed the stop, as Tinker returns them.

MoE layers (torchtitan's qwen3 MoE flavors: GQA attention, `moe` instead of
`feed_forward`) decode through the layer's own `moe` module. A generator over its own copy
records, per sequence position fed to the model and MoE layer, the top-k expert ids its
routers chose (runtime.routing's seam): `Sample.routing` is (len(prompt) + len(tokens) - 1,
n_moe_layers, top_k) int16 -- the prompt's positions (prefill) and every sampled token but
the last (each fed back for the next); exactly the input positions of the trainer's forward
over prompt + completion, which Rollout Routing Replay replays (rl.trainer, docs/rl.md).

The generator holds its own copy of the weights (optionally in bfloat16: the
inference-numerics side of the train/inference mismatch) and a version number; the trainer
pushes full weights or only its trainable (LoRA adapter) parameters with `update_weights`.
rl/vllm_engine.py's `VllmGenerator` has the same interface over a vLLM engine process.
"""

from __future__ import annotations

import contextlib
import copy
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from runtime import routing

# A context manager factory: `with gather(module):` makes the module's own weights whole.
Gather = Callable[[Any], contextlib.AbstractContextManager]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1  # samples per prompt
    stop_tokens: tuple[int, ...] = ()
    seed: int | None = None
    top_k: int = -1  # keep the k most likely tokens (-1: all)
    stop_strings: tuple[str, ...] = ()  # needs the generator's `decode`

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (use a small value for near-greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1 or self.n < 1:
            raise ValueError("max_tokens and n must be >= 1")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        if any(not x for x in self.stop_strings):
            raise ValueError("stop strings must be non-empty")


def stop_string_at_end(
    toks: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str]
) -> bool:
    """Whether a stop string occurs in the decoded tail of `toks`. Every token decodes to at
    least one byte and a character is at most 4 bytes, so 4 * len + 2 tokens cover the
    longest stop string; the caller checks after every token, so a match is new (it ends in
    the latest token)."""
    need = 4 * max(len(x) for x in stops) + 2
    text = decode(toks[-need:])
    return any(x in text for x in stops)


def stop_string_end(
    toks: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str]
) -> int | None:
    """Where this generator would have stopped `toks` for `stops`: the first k with a stop
    string at the end of toks[:k] (checked after every token, as decoding does), else None.
    For a sampler that cannot stop at strings itself (the vLLM engine without a tokenizer):
    its sample cut at k is the one it would have given stopping there (the tokens before a
    stop do not depend on it)."""
    for k in range(1, len(toks) + 1):
        if stop_string_at_end(toks[:k], stops, decode):
            return k
    return None


@dataclass
class Sample:
    prompt_index: int
    tokens: list[int]  # completion tokens (the token completing a stop, when hit, is last)
    logprobs: list[float]  # log p(token) at the sampling temperature, before top-k/top-p
    finish_reason: str  # "stop" | "length"
    version: int  # weight version that produced it
    # MoE: (prompt + completion - 1 positions, MoE layers, top_k) int16 expert ids
    routing: torch.Tensor | None = None


@dataclass
class _Cache:
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)


def kv_cache_bytes(
    layers: int, kv_heads: int, head_dim: int, rows: int, slots: int, itemsize: int
) -> int:
    """Bytes of the generator's keys and values for `rows` sequences of `slots` positions
    (a prefill holds one such cache for its prompts, decoding one for its sample rows)."""
    return 2 * layers * kv_heads * head_dim * rows * slots * itemsize


def _layers(model: Any) -> list[Any]:
    return list(model.layers.values())


def _check_supported(model: torch.nn.Module) -> None:
    for layer in _layers(model):
        if not hasattr(layer, "attention") or not hasattr(layer.attention, "qkv_linear"):
            raise NotImplementedError(f"unsupported layer type {type(layer).__name__}")


def _attention(attn, x, positions, cache: _Cache, i: int, start: int, key_ok: torch.Tensor):
    """One attention call over L new positions [start, start+L), writing the cache."""
    q, k, v = attn.qkv_linear(x)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = attn.rope(q, k, positions)
    L = x.shape[1]
    cache.k[i][:, start : start + L] = k
    cache.v[i][:, start : start + L] = v
    end = start + L
    K, V = cache.k[i][:, :end], cache.v[i][:, :end]
    # key j visible to query at slot s iff j <= s and j is not a left pad.
    causal = (
        torch.arange(end, device=x.device)[None, :]
        <= torch.arange(start, end, device=x.device)[:, None]
    )
    mask = causal[None, None] & key_ok[:, None, None, :end]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        K.transpose(1, 2),
        V.transpose(1, 2),
        attn_mask=mask,
        scale=attn.scaling,
        enable_gqa=attn.enable_gqa,
    )
    return attn.wo(out.transpose(1, 2).flatten(2))


def _whole(module: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _forward_cached(
    model: Any,
    tokens,
    positions,
    cache: _Cache,
    start: int,
    key_ok,
    *,
    last_only: bool = True,
    gather: Gather = _whole,
) -> torch.Tensor:
    # `gather(m)`: m's own weights whole for the block (an FSDP-sharded model: one
    # all-gather per layer, as its own forward does; the others stay sharded).
    with gather(model):
        h = model.tok_embeddings(tokens)
        for i, layer in enumerate(_layers(model)):
            with gather(layer):
                h = h + _attention(
                    layer.attention, layer.attention_norm(h), positions, cache, i, start, key_ok
                )
                ffn = layer.moe if getattr(layer, "moe", None) is not None else layer.feed_forward
                h = h + ffn(layer.ffn_norm(h))
        if last_only:
            return model.lm_head(model.norm(h[:, -1:]))[:, 0]
        return model.lm_head(model.norm(h))


# top_p at or under the top token's probability by this relative margin keeps that token
# alone: the nucleus rule below compares a float32 cumsum minus the token itself, which can
# round a few ulps (1e-6 is ~8 float32 ulps) under the exact prefix mass.
_NUCLEUS_MARGIN = 1e-6


def _one_token(probs: torch.Tensor, top: torch.Tensor, p: SamplingParams) -> bool:
    """Whether the draw below can only return each row's most likely token: top-p keeps
    that token alone in every row (greedy as nucleus sampling: top_p = 1e-9, the RL loop's
    held-out evaluation), or it holds all of the mass (a temperature near 0: the service's
    temperature 0 is 1e-6, under which every other token's probability underflows to 0).
    Then an argmax replaces the sort of the whole vocabulary and the multinomial draw (25%
    of greedy decoding on CPU, benchmarks/peers.md) with the same tokens; on an exact tie
    for the top probability the argmax takes the lowest id where the sort's order of equal
    values is unspecified."""
    if p.top_p < 1.0 and bool((top * (1 - _NUCLEUS_MARGIN) >= p.top_p).all()):
        return True
    return bool((top == 1.0).all()) and bool(((probs > 0).sum(-1) == 1).all())


def _sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator):
    """-> (token, logprob under the tempered distribution) per row. top-k first, then
    top-p on what top-k kept (renormalised), as vLLM does."""
    logp = F.log_softmax(logits.float() / p.temperature, dim=-1)
    probs = logp.exp()
    if 0 < p.top_k < probs.shape[-1]:
        kth = probs.topk(p.top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    top, best = probs.max(dim=-1)
    if _one_token(probs, top, p):
        return best, logp.gather(-1, best[:, None]).squeeze(-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class StagedWeights:
    """Weight versions the trainer stages and the generator applies before its next
    generation (`_apply_pending`, through the subclass's `_load`): the trainer never waits for
    a generation in flight. A newer staged update replaces an older one never applied."""

    version: int

    def _init_staging(self) -> None:
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._pending_lock = threading.Lock()

    def _check_names(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Refuse names the generator cannot load (at staging, in the trainer's thread)."""

    def _load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Queue an update that the next `generate` applies first (asynchronous RL)."""
        self._check_names(state_dict)
        with self._pending_lock:
            self._pending = (state_dict, version)

    @property
    def latest_version(self) -> int:
        """The newest version staged or loaded."""
        with self._pending_lock:
            return self._pending[1] if self._pending is not None else self.version

    def _apply_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._load(*pending)


class Generator(StagedWeights):
    """Batched sampling with a KV cache from a private copy of a torchtitan decoder."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype = torch.float32,
        pad_id: int = 0,
        max_batch: int = 256,
        decode: Callable[[list[int]], str] | None = None,
        shared: bool = False,
        gather: Gather = _whole,
    ) -> None:
        """`shared`: decode through `model` as it is (its dtype, its mode, its trainable
        parameters left alone: the service's trainer and generator share one base, no copy);
        `gather`: see `_forward_cached` (a sharded model's per-layer all-gather)."""
        _check_supported(model)
        if shared:
            dtype = next(model.parameters()).dtype
        else:
            # Parameters only: `model.to(dtype)` would also cast RoPE's complex cache to real.
            for prm in model.parameters():
                prm.data = prm.data.to(dtype)
            model = model.eval().requires_grad_(False)
        self.model: Any = model
        self.gather = gather
        self.dtype = dtype
        self.pad_id = pad_id
        self.max_batch = max_batch
        self.decode = decode  # token ids -> text: what stop strings are matched on
        self.version = 0
        # Called after each decoded token (a caller's deadline: it may raise to stop).
        self.on_token: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._init_staging()
        # MoE routing record (a private copy only: a shared model's forwards are not ours)
        self._seam = None if shared else routing.seam(model)

    @classmethod
    def from_model(cls, model: torch.nn.Module, **kw) -> Generator:
        """A generator over a deep copy of an (unsharded) model."""
        return cls(copy.deepcopy(model), **kw)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load full weights or a subset (a LoRA adapter); refuses unknown names."""
        self._check_names(state_dict)
        with self._lock, torch.no_grad():
            self.model.load_state_dict(state_dict, strict=False)
            self.version = version

    def _check_names(self, state_dict: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        unknown = [k for k in state_dict if k not in own]
        if unknown:
            raise KeyError(f"weights not in the generator's model: {unknown[:5]}")

    def _load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=False)
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        """n samples for each prompt, in prompt order. Prompts are prefilled together (as
        many as fill max_batch sample rows, at least one) and their samples decoded in
        batches of up to max_batch rows."""
        if any(not p for p in prompts):
            raise ValueError("empty prompt")
        if params.stop_strings and self.decode is None:
            raise ValueError("stop strings need the generator's decode function")
        gen = torch.Generator(device=self.device)
        # No seed: one from the OS, not torch.seed() (that would reseed the global RNG).
        gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        per_chunk = max(1, self.max_batch // params.n)
        out: list[Sample] = []
        with self._lock:
            self._apply_pending()
            version = self.version
            for s in range(0, len(prompts), per_chunk):
                chunk = list(range(s, min(len(prompts), s + per_chunk)))
                out += self._generate_prompts(prompts, chunk, params, gen, version)
        return out

    def _all_logits(self, seqs: list[list[int]], total: int):
        """(tokens, logits at every position) of one prefill of `seqs`, left-padded to
        `total`: teacher-forced scoring (score, prompt_scores)."""
        tokens, positions, _, key_ok, cache = self._prefill_inputs(seqs, total)
        logits = _forward_cached(
            self.model, tokens, positions, cache, 0, key_ok, last_only=False, gather=self.gather
        )
        return tokens, logits

    def _prefill_inputs(self, seqs: list[list[int]], total: int):
        """Left-padded tokens, per-row RoPE positions, lengths, key mask and an empty cache
        of `total` slots."""
        dev, B, P = self.device, len(seqs), max(len(p) for p in seqs)
        tokens = torch.full((B, P), self.pad_id, dtype=torch.long, device=dev)
        key_ok = torch.zeros(B, total, dtype=torch.bool, device=dev)
        for b, p in enumerate(seqs):
            tokens[b, P - len(p) :] = torch.tensor(p, device=dev)
            key_ok[b, P - len(p) :] = True
        lens = torch.tensor([len(p) for p in seqs], device=dev)
        positions = (torch.arange(P, device=dev)[None] - (P - lens)[:, None]).clamp(min=0)
        cache = _Cache()
        for layer in _layers(self.model):
            a = layer.attention
            shape = (B, total, a.n_kv_heads, a.head_dim)
            cache.k.append(torch.zeros(shape, dtype=self.dtype, device=dev))
            cache.v.append(torch.zeros(shape, dtype=self.dtype, device=dev))
        return tokens, positions, lens, key_ok, cache

    @torch.no_grad()
    def score(
        self, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0
    ) -> list[list[float]]:
        """Teacher-forced logprobs of each completion after its prompt, through this
        generator's own numerics (dtype, decode path): one prefill of prompt + completion."""
        with self._lock:
            self._apply_pending()
            seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
            P = max(len(x) for x in seqs)
            _, logits = self._all_logits(seqs, P)
            logp = F.log_softmax(logits.float() / temperature, dim=-1)
            out = []
            for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
                start = P - len(p) - len(c)  # left padding
                idx = torch.arange(len(c), device=logp.device) + start + len(p) - 1
                tgt = torch.tensor(c, device=logp.device)
                out.append(logp[b, idx, tgt].tolist())
            return out

    @torch.no_grad()
    def prompt_scores(self, prompt: list[int], k: int = 0):
        """Through this generator's numerics (temperature 1): log p(prompt[t] | prompt[:t])
        for t >= 1 ([P-1] float32) and, when k > 0, the k most likely tokens and their
        logprobs at each of those positions ([P-1, k] int32 / float32)."""
        with self._lock:
            self._apply_pending()
            tokens, logits = self._all_logits([prompt], len(prompt))
        logp = F.log_softmax(logits[0, :-1].float(), dim=-1)
        lp = logp.gather(-1, tokens[0, 1:, None]).squeeze(-1).cpu().numpy()
        if k <= 0:
            return lp.astype(np.float32), None, None
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return (
            lp.astype(np.float32),
            top.indices.cpu().numpy().astype(np.int32),
            top.values.cpu().numpy().astype(np.float32),
        )

    def _generate_prompts(
        self,
        prompts: list[list[int]],
        chunk: list[int],
        params: SamplingParams,
        gen: torch.Generator,
        version: int,
    ) -> list[Sample]:
        """Prefill `chunk`'s prompts once, then decode their n samples each."""
        seqs = [prompts[i] for i in chunk]
        P = max(len(p) for p in seqs)
        tokens, positions, lens, key_ok, cache = self._prefill_inputs(seqs, P + params.max_tokens)
        seam = self._seam
        if seam is not None:
            seam.start_recording()
        try:
            logits = _forward_cached(
                self.model, tokens, positions, cache, 0, key_ok, gather=self.gather
            )
            prefill_ids = seam.take() if seam is not None else None
            return self._decode_rows(chunk, seqs, cache, logits, lens, key_ok, P, params, gen,
                                     version, prefill_ids)  # fmt: skip
        finally:
            if seam is not None:
                seam.recording = None

    def _decode_rows(self, chunk, seqs, cache, logits, lens, key_ok, P, params, gen, version,
                     prefill_ids) -> list[Sample]:  # fmt: skip
        """The n samples of each prefilled prompt, in batches of up to max_batch rows."""
        rows = [j for j in range(len(seqs)) for _ in range(params.n)]
        out: list[Sample] = []
        for s in range(0, len(rows), self.max_batch):
            sub = rows[s : s + self.max_batch]
            src = torch.tensor(sub, device=self.device)
            if sub == list(range(len(seqs))):  # n = 1, one batch: the prefill cache itself
                c, lg, ln, ok = cache, logits, lens, key_ok
            else:  # each sample row starts from a copy of its prompt's keys and values
                c = _Cache(
                    [k.index_select(0, src) for k in cache.k],
                    [v.index_select(0, src) for v in cache.v],
                )
                lg, ln, ok = logits[src], lens[src], key_ok[src]
            ids = None if prefill_ids is None else prefill_ids[src]
            out += self._decode([chunk[j] for j in sub], c, lg, ln, ok, P, params, gen, version,
                                ids)  # fmt: skip
        return out

    def _stop_string_at_end(self, toks: list[int], stops: tuple[str, ...]) -> bool:
        assert self.decode is not None
        return stop_string_at_end(toks, stops, self.decode)

    def _decode(
        self,
        prompt_index: list[int],
        cache: _Cache,
        logits: torch.Tensor,
        lens: torch.Tensor,
        key_ok: torch.Tensor,
        P: int,
        params: SamplingParams,
        gen: torch.Generator,
        version: int,
        prefill_ids: torch.Tensor | None = None,
    ) -> list[Sample]:
        dev, B = self.device, len(prompt_index)
        stop = torch.tensor(list(params.stop_tokens), device=dev, dtype=torch.long)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        ends: list[int | None] = [None] * B  # tokens kept when the row stopped
        hist: list[list[int]] = [[] for _ in range(B)]
        toks, lps = [], []
        step_ids: list[torch.Tensor] = []  # (B, 1, n_moe, K) per token fed back
        for t in range(params.max_tokens):
            if self.on_token is not None:
                self.on_token()
            tok, lp = _sample(logits, params, gen)
            toks.append(tok)
            lps.append(lp)
            hit = torch.isin(tok, stop) & ~done
            if params.stop_strings:
                tl, dl = tok.tolist(), done.tolist()
                for b in range(B):
                    if dl[b]:
                        continue
                    hist[b].append(tl[b])
                    if self._stop_string_at_end(hist[b], params.stop_strings):
                        hit[b] = True
            if bool(hit.any()):
                for b in hit.nonzero().flatten().tolist():
                    ends[b] = t + 1
                done |= hit
            if bool(done.all()) or t == params.max_tokens - 1:
                break
            logits = _forward_cached(
                self.model, tok[:, None], (lens + t)[:, None], cache, P + t, key_ok,
                gather=self.gather,
            )  # fmt: skip
            if self._seam is not None and prefill_ids is not None:
                step_ids.append(self._seam.take())
        tok_m = torch.stack(toks, 1).tolist()
        lp_m = torch.stack(lps, 1).float().tolist()
        out = []
        for b, i in enumerate(prompt_index):
            n = ends[b]
            seq, lp = (tok_m[b], lp_m[b]) if n is None else (tok_m[b][:n], lp_m[b][:n])
            route = None
            if prefill_ids is not None:
                fed = [prefill_ids[b, P - int(lens[b]) :]] + [x[b] for x in step_ids]
                route = torch.cat(fed)[: int(lens[b]) + len(seq) - 1].to(torch.int16).cpu()
            out.append(Sample(i, seq, lp, "length" if n is None else "stop", version, route))
        return out
