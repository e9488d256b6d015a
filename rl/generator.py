"""Sampling from the policy: a KV-cache decode path over a torchtitan decoder's own modules.

torchtitan's Llama has no KV cache, so decoding here walks the model's modules itself (the
same `tok_embeddings`, `attention_norm`, `qkv_linear`, `rope`, `wo`, `ffn_norm`,
`feed_forward`, `norm`, `lm_head` objects and weights) and keeps keys and values per layer.
Prompts are left-padded; padded keys are masked and RoPE positions count from each row's
first real token, so a row's logits equal the model's full forward on that row alone (checked
in tests/unit/test_rl_generator.py to 1e-5 in float32).

The generator holds its own copy of the weights (optionally in bfloat16: the
inference-numerics side of the train/inference mismatch) and a version number; the trainer
pushes full weights or only its trainable (LoRA adapter) parameters with `update_weights`.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1  # samples per prompt
    stop_tokens: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (use a small value for near-greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1 or self.n < 1:
            raise ValueError("max_tokens and n must be >= 1")


@dataclass
class Sample:
    prompt_index: int
    tokens: list[int]  # completion tokens (a stop token, when hit, is the last)
    logprobs: list[float]  # log p(token) at the sampling temperature, before top-p
    finish_reason: str  # "stop" | "length"
    version: int  # weight version that produced it


@dataclass
class _Cache:
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)


def _layers(model: Any) -> list[Any]:
    return list(model.layers.values())


def _check_supported(model: torch.nn.Module) -> None:
    for layer in _layers(model):
        if getattr(layer, "moe", None) is not None:
            raise NotImplementedError("KV-cache decoding of MoE layers is not implemented")
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


def _forward_cached(
    model: Any, tokens, positions, cache: _Cache, start: int, key_ok, *, last_only: bool = True
) -> torch.Tensor:
    h = model.tok_embeddings(tokens)
    for i, layer in enumerate(_layers(model)):
        h = h + _attention(
            layer.attention, layer.attention_norm(h), positions, cache, i, start, key_ok
        )
        h = h + layer.feed_forward(layer.ffn_norm(h))
    if last_only:
        return model.lm_head(model.norm(h[:, -1:]))[:, 0]
    return model.lm_head(model.norm(h))


def _sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator):
    """-> (token, logprob under the tempered distribution) per row."""
    logp = F.log_softmax(logits.float() / p.temperature, dim=-1)
    probs = logp.exp()
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class Generator:
    """Batched sampling with a KV cache from a private copy of a torchtitan decoder."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype = torch.float32,
        pad_id: int = 0,
        max_batch: int = 256,
    ) -> None:
        _check_supported(model)
        # Parameters only: `model.to(dtype)` would also cast RoPE's complex cache to real.
        for prm in model.parameters():
            prm.data = prm.data.to(dtype)
        self.model: Any = model.eval().requires_grad_(False)
        self.dtype = dtype
        self.pad_id = pad_id
        self.max_batch = max_batch
        self.version = 0
        self._lock = threading.Lock()
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._pending_lock = threading.Lock()

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

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Queue an update that the next `generate` applies first: the trainer never waits
        for a generation in flight (asynchronous RL). A newer staged update replaces an older
        one that was never applied."""
        self._check_names(state_dict)
        with self._pending_lock:
            self._pending = (state_dict, version)

    def _check_names(self, state_dict: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        unknown = [k for k in state_dict if k not in own]
        if unknown:
            raise KeyError(f"weights not in the generator's model: {unknown[:5]}")

    @property
    def latest_version(self) -> int:
        """The newest version staged or loaded."""
        with self._pending_lock:
            return self._pending[1] if self._pending is not None else self.version

    def _apply_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            sd, version = pending
            with torch.no_grad():
                self.model.load_state_dict(sd, strict=False)
            self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        """n samples for each prompt, in prompt order; batched up to max_batch rows."""
        rows = [(i, p) for i, p in enumerate(prompts) for _ in range(params.n)]
        if any(not p for _, p in rows):
            raise ValueError("empty prompt")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        out: list[Sample] = []
        with self._lock:
            self._apply_pending()
            version = self.version
            for s in range(0, len(rows), self.max_batch):
                out += self._generate_batch(rows[s : s + self.max_batch], params, gen, version)
        return out

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
            tokens, positions, _, key_ok, cache = self._prefill_inputs(seqs, P)
            logits = _forward_cached(
                self.model, tokens, positions, cache, 0, key_ok, last_only=False
            )
            logp = F.log_softmax(logits.float() / temperature, dim=-1)
            out = []
            for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
                start = P - len(p) - len(c)  # left padding
                idx = torch.arange(len(c), device=logp.device) + start + len(p) - 1
                tgt = torch.tensor(c, device=logp.device)
                out.append(logp[b, idx, tgt].tolist())
            return out

    def _generate_batch(self, rows, params: SamplingParams, gen, version: int) -> list[Sample]:
        dev, B = self.device, len(rows)
        P = max(len(p) for _, p in rows)
        tokens, positions, lens, key_ok, cache = self._prefill_inputs(
            [p for _, p in rows], P + params.max_tokens
        )
        logits = _forward_cached(self.model, tokens, positions, cache, 0, key_ok)
        stop = torch.tensor(list(params.stop_tokens), device=dev, dtype=torch.long)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        toks, lps, stopped = [], [], torch.zeros(B, dtype=torch.bool, device=dev)
        for t in range(params.max_tokens):
            tok, lp = _sample(logits, params, gen)
            toks.append(tok)
            lps.append(lp)
            hit = torch.isin(tok, stop) & ~done
            stopped |= hit
            done |= hit
            if bool(done.all()) or t == params.max_tokens - 1:
                break
            logits = _forward_cached(
                self.model, tok[:, None], (lens + t)[:, None], cache, P + t, key_ok
            )
        tok_m = torch.stack(toks, 1).tolist()
        lp_m = torch.stack(lps, 1).float().tolist()
        out = []
        for b, (i, _) in enumerate(rows):
            seq, lp = tok_m[b], lp_m[b]
            if stopped[b]:
                n = next(j for j, x in enumerate(seq) if x in params.stop_tokens) + 1
                seq, lp = seq[:n], lp[:n]
            out.append(Sample(i, seq, lp, "stop" if stopped[b] else "length", version))
        return out


def vllm_generator(*args, **kwargs):
    """The optional vLLM backend (GPU). Interface: the same `update_weights(state_dict,
    version)` and `generate(prompts, SamplingParams) -> list[Sample]` as `Generator`."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "rl.generator = 'vllm' needs the vllm package, which is not installed; "
            "use rl.generator = 'native' (the KV-cache generator in rl/generator.py)"
        ) from None
    raise NotImplementedError(
        "the vLLM backend is an interface only in this version (weight sync into vLLM's "
        "engine is not written); use rl.generator = 'native'"
    )
