"""titanscale's dataloader component for torchtitan's Trainer.

Built by the Trainer as `config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=,
seq_len=, local_batch_size=, snapshot_every_n_steps=)`; yields
`({"input": [B, L], "positions": [B, L]}, labels [B, L])` with positions reset to 0 at each
document (torchtitan derives the flex / varlen / dense document masks from them) and
labels = IGNORE_INDEX (-100) on padding. Packing: concat | bfd | none (data.packing).

Sharding invariant: packed rows form ONE global stream, identical on every rank, and
data-parallel rank r takes rows r, r + dp, r + 2dp, ... So the union of a step's batches is
the same set of rows for every data-parallel size: a 1-process run with local batch B x dp
sees exactly the sequences that dp processes with local batch B see, and a checkpoint
(the global stream position) resumes at any data-parallel size with no document repeated
or skipped. Cost: every rank reads and tokenizes the whole stream (dp times the work of
document-level sharding) and materializes only its own rows; benchmarks/packing.md gives
the tokens/s one core sustains, which bounds dp x tokens/s per data-parallel replica.
A prepared token store (`[data] source = "<store folder>"`, tools.prepare_data) and
`[[data.sources]]` mixes go through data.store_stream instead: the same rows, but each rank
plans and reads only its own (`build_stream` chooses).

Checkpoint contents (one key, identical on every rank): the next source record, the epoch,
the packer's pending pieces and the rows decided but not yet consumed, the tokens of the
documents they reference (int32), the cumulative packing and bad-record counts, and a
fingerprint (source, packing, seq_len, window, vocab) that must match on resume.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, default_collate
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer
from torchtitan.tools.logging import logger

from core.errors import ConfigError
from data.chat import CHAT_BAD_REASONS, ChatRenderer, make_renderer
from data.packing import (
    LOSS_WEIGHT_DELTA,
    LOSS_WEIGHTS,
    PACKINGS,
    Piece,
    Row,
    group_weight_delta,
    make_packer,
    materialize,
    weigh_row,
)
from data.sources import BAD_REASONS, RAW_RECORD, Source, open_source

BAD_RECORD_POLICIES = ("skip", "fail")
STREAMING_MODES = ("auto", "always", "never")
STATE_KEY = "titanscale_stream"
STATE_VERSION = 3  # 3: epochs flushed separately


def _plain(obj: Any) -> Any:
    """json.dumps default: numpy arrays and scalars as lists and numbers."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


# Records read and tokenized together (one encode_batch call); only documents actually
# pushed to the packer advance the saved position, so the chunk size never shows in state.
_CHUNK = 64

# SFT weights (data.chat "weight") whose first positive one lies in SCALE_FREE are used as
# given; otherwise every weight is divided by that first one (PackedStream._relative_weight).
SCALE_FREE = (2.0**-16, 2.0**16)
# A weight relative to that scale may span this factor either way (2^32 = 4.3e9); beyond it
# the record is bad ("weight"). Why: a
# step's normalizer is the trained-token count + sum(w - 1) (runtime.trainer), which keeps
# 21 of float64's 53 bits of a weight of 2^-32, and sum(w x CE) runs in float32 per token
# (2^32 x CE x 2^31 tokens stays far below float32's 3.4e38).
WEIGHT_RANGE = 2.0**32


class BadRecordError(ConfigError):
    """A bad record under `[data] bad_records = "fail"`."""


def encode_documents(tokenizer: BaseTokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """BOS + tokens + EOS per text, as int32 arrays; identical to `tokenizer.encode(text,
    add_bos=True, add_eos=True)` (torchtitan's call), batched through `tokenizers` when the
    tokenizer is torchtitan's HuggingFaceTokenizer."""
    if isinstance(tokenizer, HuggingFaceTokenizer):
        encs = tokenizer.tokenizer.encode_batch(list(texts))
        pre = (
            [tokenizer.bos_id]
            if (tokenizer.bos_id is not None and not tokenizer.hf_adds_bos)
            else []
        )
        post = (
            [tokenizer.eos_id]
            if (tokenizer.eos_id is not None and not tokenizer.hf_adds_eos)
            else []
        )
        return [np.array(pre + e.ids + post, dtype=np.int32) for e in encs]
    return [
        np.array(tokenizer.encode(t, add_bos=True, add_eos=True), dtype=np.int32) for t in texts
    ]


class PackedStream(IterableDataset, Stateful):
    """The global packed stream; this rank's rows only (row r of every group of dp rows)."""

    def __init__(
        self,
        *,
        source: str | Source,
        tokenizer: BaseTokenizer,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        packing: str = "concat",
        text_field: str = "text",
        window: int = 256,
        bad_records: str = "skip",
        streaming: str = "auto",
        infinite: bool = True,
        renderer: ChatRenderer | None = None,
        truncate: bool = False,
        weights: bool = True,
    ) -> None:
        if packing not in PACKINGS:
            raise ConfigError(f"expected one of {PACKINGS}, got {packing!r}", key="data.packing")
        if bad_records not in BAD_RECORD_POLICIES:
            raise ConfigError(
                f"expected one of {BAD_RECORD_POLICIES}, got {bad_records!r}",
                key="data.bad_records",
            )
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_world_size - 1}")
        # SFT (`renderer` given): records are whole JSON lines, rendered by data.chat.
        self.renderer = renderer
        self.truncate = truncate
        # SFT: apply records' "weight" (False: the validator's plain token-mean loss).
        self.use_weights = weights and renderer is not None
        self.source = (
            source
            if isinstance(source, Source)
            else open_source(
                source,
                text_field=RAW_RECORD if renderer is not None else text_field,
                streaming=streaming,
            )
        )
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.packing = packing
        self.window = window
        self.bad_records = bad_records
        self.infinite = infinite
        self.pad_id = _pad_id(tokenizer)
        # Rows one optimizer microstep takes over all ranks (local batch x dp; set by the
        # loader). A pass shorter than this is re-read within a step: logged sparingly.
        self.rows_per_step = dp_world_size
        self.fingerprint = {
            "source": self.source.description,
            "text_field": text_field,
            "packing": packing,
            "seq_len": seq_len,
            "window": window if packing == "bfd" else None,
            "vocab_size": tokenizer.get_vocab_size(),
        }
        if renderer is not None:
            self.fingerprint["format"] = f"sft:{renderer.template}:truncate={truncate}"
        self._reset()

    def _reset(self) -> None:
        self.packer = make_packer(self.packing, self.seq_len, window=self.window)
        self._next_record = 0
        self._epoch = 0
        self._n_records: int | None = None
        self._doc_seq = 0  # ids for pushed documents (unique across epochs)
        self._queue: list[Row] = []  # rows decided, not yet consumed (global order)
        self._tokens: dict[int, np.ndarray] = {}
        # Loss weights of documents whose weight is not 1 (sparse: empty for unweighted data,
        # which then costs nothing; data.packing.weigh_row).
        self._weights: dict[int, float] = {}
        self._rows_consumed = 0
        self._bad = dict.fromkeys(self._bad_reasons(), 0)
        self._finished = False
        self._prune_at = 2 * self.window + 64
        self._small_warned = False
        # SFT weights are relative (docs/sft.md): divided by this scale, fixed by the first
        # record of positive weight (_relative_weight); None until that record is read.
        self._weight_scale: float | None = None

    # -- the stream -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        dp = self.dp_world_size
        while not self._finished:
            good_in_epoch = 0
            weighted_in_epoch = 0  # documents with a positive loss weight
            pass_start = self._next_record
            rows_before = len(self._queue) + self._rows_consumed
            tokens_in_epoch = 0
            records = self.source.records(self._next_record)
            exhausted = False
            while not exhausted:
                chunk = []
                for rec in records:
                    chunk.append(rec)
                    if len(chunk) == _CHUNK:
                        break
                else:
                    exhausted = True
                # A record has text xor a bad-record reason (data.sources contract).
                texts = [t for _, t, _ in chunk if t is not None]
                encoded = iter(self._encode(texts)) if texts else iter(())
                for idx, text, bad in chunk:
                    ids = next(encoded) if text is not None else None
                    weight = 1.0
                    if isinstance(ids, str):  # an SFT record that does not render
                        bad, ids = ids, None
                    elif isinstance(ids, tuple):  # an SFT record and its loss weight
                        ids, weight = ids
                        if self.use_weights:
                            weight, why = self._relative_weight(weight)
                            bad = bad or why
                    if ids is not None and len(ids) < 2:
                        bad = "empty"  # no next-token pair (a tokenizer without BOS/EOS)
                    self._next_record = idx + 1
                    if bad is not None:
                        self._record_bad(idx, bad)
                        continue
                    good_in_epoch += 1
                    weighted_in_epoch += weight > 0.0
                    assert ids is not None
                    tokens_in_epoch += len(ids) - 1
                    doc = self._doc_seq
                    self._doc_seq += 1
                    self._tokens[doc] = ids
                    if weight != 1.0 and self.use_weights:
                        self._weights[doc] = weight
                    self._queue.extend(self.packer.push(doc, len(ids) - 1))
                    while len(self._queue) >= dp:
                        yield self._take_group()
            # One pass over the source done.
            if good_in_epoch and not weighted_in_epoch and pass_start == 0 and self.use_weights:
                # Every usable record has weight 0: every label would be masked, and the run
                # would train nothing and report success.
                raise ConfigError(
                    f'{self.source.description}: every usable record has "weight": 0 '
                    f"({good_in_epoch} records): nothing would be trained",
                    key="data.source",
                )
            if good_in_epoch == 0 and pass_start == 0:
                raise ConfigError(
                    f"{self.source.description}: no usable documents "
                    f"(bad records: {self._bad_summary()})",
                    key="data.source",
                )
            self._n_records = self._next_record
            # Each epoch is packed on its own: the packer is flushed at the end of a pass,
            # so epochs are periodic and a prepared store's plan (data.plan) can seek to any
            # row (cost: at most one partly padded row per epoch).
            self._queue.extend(self.packer.flush())
            if self.infinite:
                self._epoch += 1
                self._next_record = 0
                rows = len(self._queue) + self._rows_consumed - rows_before
                self._log_epoch(rows, tokens_in_epoch, whole=pass_start == 0)
                continue
            while len(self._queue) % dp:
                # Keep every rank at the same number of rows: pad the last group with rows
                # of padding (labels all IGNORE_INDEX) instead of dropping real rows.
                self._queue.append(self.packer.padding_row())
            while self._queue:
                yield self._take_group()
            self._finished = True

    def _log_epoch(self, rows: int, tokens: int, *, whole: bool) -> None:
        """One line per epoch, unless a pass is shorter than one step's batch: then a warning
        once and epoch lines at powers of two only (a 3-token source would otherwise log
        hundreds of epochs per step)."""
        e, desc = self._epoch, self.source.description
        if rows >= self.rows_per_step or not whole:
            logger.info(f"data: epoch {e} of {desc}")
            return
        if not self._small_warned:
            self._small_warned = True
            logger.warning(
                f"data: {desc} holds {tokens} tokens per pass ({rows} rows of seq_len "
                f"{self.seq_len}), less than one step's batch ({self.rows_per_step} rows = "
                "local batch x data-parallel size): every step re-reads it; epoch lines "
                "are logged at powers of two"
            )
        if e & (e - 1) == 0:
            logger.info(
                f"data: epoch {e} of {desc} (dataset re-read {e - 1} times in "
                f"{self._rows_consumed // max(self.rows_per_step, 1)} steps: {tokens} tokens "
                "< one batch)"
            )

    def _bad_reasons(self) -> tuple[str, ...]:
        return BAD_REASONS + (CHAT_BAD_REASONS if self.renderer is not None else ())

    def _encode(self, texts: list[str]) -> list[np.ndarray] | list[tuple[np.ndarray, float] | str]:
        """Token arrays (BOS + text + EOS), or for SFT records (data.chat's masked encoding,
        the record's loss weight), or the bad-record reason."""
        if self.renderer is None:
            return encode_documents(self.tokenizer, texts)
        out: list[tuple[np.ndarray, float] | str] = []
        for line in texts:
            arr, w, bad = self.renderer.render_line(
                line, max_tokens=self.seq_len + 1, truncate=self.truncate
            )
            out.append((arr, w) if arr is not None else str(bad))
        return out

    def _relative_weight(self, weight: float) -> tuple[float, str | None]:
        """(the weight the loss uses, None), or (1, "weight") for a record more than
        WEIGHT_RANGE from the stream's scale. Weights are relative (the loss divides by
        their sum): the scale is 1 when the first record of positive weight lies within
        SCALE_FREE (the weights are used as given), else that record's weight, so a dataset
        whose weights were all multiplied past float32's range (1e39 overflows to inf,
        1e-40 is subnormal, 1e-46 rounds to 0) trains as the same dataset unscaled, equal
        weights giving exactly 1 (the unweighted loss, bit for bit)."""
        if weight == 0.0:
            return 0.0, None
        if self._weight_scale is None:
            lo, hi = SCALE_FREE
            self._weight_scale = 1.0 if lo <= weight <= hi else weight
        rel = weight / self._weight_scale
        if not 1.0 / WEIGHT_RANGE <= rel <= WEIGHT_RANGE:
            return 1.0, "weight"
        return rel, None

    def _record_bad(self, idx: int, reason: str) -> None:
        if self.bad_records == "fail":
            raise BadRecordError(
                f"record {idx} of {self.source.description} is bad ({reason}); set "
                "data.bad_records = 'skip' to skip and count bad records",
                key="data.bad_records",
            )
        self._bad[reason] += 1

    def _bad_summary(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self._bad.items() if v) or "none"

    def _take_group(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        dp = self.dp_world_size
        group = self._queue[:dp]
        row = group[self.dp_rank]
        del self._queue[:dp]
        self._rows_consumed += dp
        inp, lab, pos = materialize(row, self._tokens, self.pad_id)
        batch = {"input": torch.from_numpy(inp), "positions": torch.from_numpy(pos)}
        if self._weights:
            self._apply_weights(group, row, lab, batch)
        if len(self._tokens) > self._prune_at:
            self._prune()
        return batch, torch.from_numpy(lab)

    def _apply_weights(
        self, group: list[Row], row: Row, lab: np.ndarray, batch: dict[str, torch.Tensor]
    ) -> None:
        """Weights of this group's documents (docs/sft.md, "Per-example weights").

        Weight 0 masks the row's labels; a group (all dp rows, the same on every rank) with
        a weight other than 0 and 1 makes every rank's row carry per-token weights and the
        group's normalizer delta, so all ranks agree, without a collective, on which steps
        use the weighted loss and on its normalizer (runtime.trainer).
        """
        ws = self._weights
        mine = [p.doc for p in row.pieces if p.doc in ws]
        if mine:
            token_w = weigh_row(row, lab, ws)
        if any(ws.get(p.doc, 0.0) != 0.0 for r in group for p in r.pieces):
            if not mine:
                token_w = (lab != IGNORE_INDEX).astype(np.float32)
            batch[LOSS_WEIGHTS] = torch.from_numpy(token_w)
            batch[LOSS_WEIGHT_DELTA] = torch.from_numpy(
                np.array(group_weight_delta(group, self._tokens, ws), dtype=np.float64)
            )

    def _referenced(self) -> set[int]:
        refs = set(self.packer.pending_docs())
        for row in self._queue:
            refs.update(p.doc for p in row.pieces)
        return refs

    def _prune(self) -> None:
        refs = self._referenced()
        self._tokens = {d: t for d, t in self._tokens.items() if d in refs}
        self._weights = {d: w for d, w in self._weights.items() if d in refs}
        self._prune_at = 2 * len(self._tokens) + 2 * self.window + 64

    # -- accounting -------------------------------------------------------------------------
    def packing_stats(self) -> dict[str, Any]:
        """Cumulative global counts (identical on every rank): packing and bad records."""
        out: dict[str, Any] = dict(self.packer.stats.as_dict())
        out["rows_consumed"] = self._rows_consumed
        out["epoch"] = self._epoch
        out["bad_records"] = dict(self._bad)
        out["bad_records_total"] = sum(self._bad.values())
        return out

    # -- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        refs = sorted(self._referenced())
        lengths = [len(self._tokens[d]) for d in refs]
        flat = (
            np.concatenate([self._tokens[d] for d in refs]) if refs else np.zeros(0, dtype=np.int32)
        )
        st = self.packer.stats
        return {
            "version": STATE_VERSION,
            "fingerprint": dict(self.fingerprint),
            "next_record": self._next_record,
            "epoch": self._epoch,
            "n_records": self._n_records,
            "doc_seq": self._doc_seq,
            "rows_consumed": self._rows_consumed,
            "finished": self._finished,
            "packer": [list(s) for s in self.packer.state()],
            "queue": [[(p.doc, p.start, p.end) for p in r.pieces] for r in self._queue],
            "docs": refs,
            "doc_lengths": lengths,
            "tokens": flat,
            "stats": {
                "documents": st.documents,
                "rows": st.rows,
                "useful_tokens": st.useful_tokens,
                "padding_tokens": st.padding_tokens,
                "split_documents": st.split_documents,
            },
            "bad": dict(self._bad),
            **({"weight_scale": self._weight_scale} if self.renderer is not None else {}),
            "source_state": self.source.resume_state(self._next_record),
            # SFT: loss weights (not 1) of the referenced documents, as [doc, weight].
            **(
                {"weights": [[d, self._weights[d]] for d in refs if d in self._weights]}
                if self.renderer is not None
                else {}
            ),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("version") != STATE_VERSION:
            raise ValueError(
                f"data position was written by another loader version ({sd.get('version')}, "
                f"expected {STATE_VERSION})"
            )
        diff = {
            k: (sd["fingerprint"].get(k), v)
            for k, v in self.fingerprint.items()
            if sd["fingerprint"].get(k) != v
        }
        if diff:
            detail = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"the checkpoint's data position belongs to another data setup ({detail}); "
                "resume with the same data settings, or exclude the dataloader from loading"
            )
        self._reset()
        offsets = np.cumsum([0, *sd["doc_lengths"]])
        flat = np.asarray(sd["tokens"], dtype=np.int32)
        self._tokens = {
            d: flat[offsets[i] : offsets[i + 1]].copy() for i, d in enumerate(sd["docs"])
        }
        lengths = {d: len(t) - 1 for d, t in self._tokens.items()}
        self.packer.restore([tuple(s) for s in sd["packer"]], lengths)
        self._queue = [
            Row(tuple(Piece(d, s, e, lengths[d]) for d, s, e in r), self.seq_len)
            for r in sd["queue"]
        ]
        for k, v in sd["stats"].items():
            setattr(self.packer.stats, k, v)
        self._next_record = sd["next_record"]
        self._epoch = sd["epoch"]
        self._n_records = sd["n_records"]
        self._doc_seq = sd["doc_seq"]
        self._rows_consumed = sd["rows_consumed"]
        self._finished = sd["finished"]
        self._bad = {**dict.fromkeys(self._bad_reasons(), 0), **sd["bad"]}
        # A position saved before weights were relative: they were absolute (scale 1).
        self._weight_scale = sd.get("weight_scale", 1.0 if sd["doc_seq"] else None)
        if self.use_weights:
            self._weights = {int(d): float(w) for d, w in sd.get("weights", [])}
        self.source.restore(self._next_record, sd.get("source_state"))


def _tokenizer_folder(tokenizer: BaseTokenizer) -> str:
    folder = getattr(tokenizer, "tokenizer_path", None)
    if not folder:
        raise ValueError("SFT rendering needs a tokenizer loaded from a folder")
    return str(folder)


def _pad_id(tokenizer: BaseTokenizer) -> int:
    eos = getattr(tokenizer, "eos_id", None)
    return int(eos) if eos is not None else 0


def _open_store(spec: str, tokenizer: BaseTokenizer, key: str) -> Any:
    """A prepared store, refused when tokenized with another tokenizer than this one."""
    from data.store import TokenStore

    store = TokenStore(spec, key=key)
    tok_dir = getattr(tokenizer, "tokenizer_path", None)
    if tok_dir is not None:
        store.check_tokenizer(tok_dir)
    return store


def open_rows(
    spec: str,
    *,
    tokenizer: BaseTokenizer,
    seq_len: int,
    packing: str,
    window: int,
    text_field: str = "text",
    streaming: str = "auto",
    subset: str = "",
    split: str = "train",
    data_files: list[str] | None = None,
    bad_records: str = "skip",
    key: str = "data.source",
) -> Any:
    """A data.store_stream.PlannedRows over a prepared store, or over a small source
    tokenized in memory (mixing accepts both)."""
    from data.store import is_store
    from data.store_stream import MemoryStore, PlannedRows

    store: Any
    if is_store(spec):
        store = _open_store(spec, tokenizer, key)
    else:
        src = open_source(
            spec,
            text_field=text_field,
            streaming=streaming,
            subset=subset,
            split=split,
            data_files=data_files,
            key=key,
        )
        store = MemoryStore(src, tokenizer, bad_records=bad_records)
        if store.n_docs == 0:
            raise ConfigError(f"{src.description}: no usable documents", key=key)
    return PlannedRows(
        store, packing=packing, seq_len=seq_len, window=window, pad_id=_pad_id(tokenizer)
    )


def build_stream(
    config: TitanscaleDataLoader.Config,
    *,
    tokenizer: BaseTokenizer,
    seq_len: int,
    dp_rank: int,
    dp_world_size: int,
) -> Any:
    """The loader's row stream: a weighted mix ([[data.sources]]), one prepared store
    (rank r reads only its rows), or the streaming path (every rank reads everything)."""
    from data.store import is_store
    from data.store_stream import MixedStream, MixSource, StoreStream

    vocab = tokenizer.get_vocab_size()
    if config.sources:
        mix = []
        for i, entry in enumerate(config.sources):
            rows = open_rows(
                entry["source"],
                tokenizer=tokenizer,
                seq_len=seq_len,
                packing=config.packing,
                window=config.window,
                text_field=entry.get("text_field", "text"),
                streaming=config.streaming,
                subset=entry.get("subset", ""),
                split=entry.get("split", "train"),
                data_files=entry.get("data_files") or None,
                bad_records=config.bad_records,
                key=f"data.sources[{i}].source",
            )
            mix.append(MixSource(entry["source"], float(entry.get("weight", 1.0)), rows))
        return MixedStream(
            mix,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            window=config.mix_window,
            vocab_size=vocab,
        )
    if is_store(config.source):
        return StoreStream(
            _open_store(config.source, tokenizer, "data.source"),
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            packing=config.packing,
            window=config.window,
            infinite=config.infinite,
            pad_id=_pad_id(tokenizer),
            vocab_size=vocab,
        )
    sft = config.format == "sft"
    if sft and (config.sources or is_store(config.source)):
        raise ConfigError(
            "sft data is read from JSON Lines directly (not from a prepared store or a mix)",
            key="data.format",
        )
    source = open_source(
        config.source,
        # SFT: records are whole JSON lines, rendered by data.chat.
        text_field=RAW_RECORD if sft else config.text_field,
        streaming=config.streaming,
        subset=config.subset,
        split=config.split,
        data_files=config.data_files or None,
    )
    return PackedStream(
        source=source,
        tokenizer=tokenizer,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        packing=config.packing,
        text_field=config.text_field,
        window=config.window,
        bad_records=config.bad_records,
        streaming=config.streaming,
        infinite=config.infinite,
        renderer=(
            make_renderer(_tokenizer_folder(tokenizer), config.chat_template) if sft else None
        ),
        truncate=config.truncate,
        weights=config.weights,
    )


def collate_rows(
    rows: list[tuple[dict[str, torch.Tensor], torch.Tensor]],
    trim_to: int = 0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """torch's default collate, after giving rows without loss weights (a batch that mixes
    weighted and unweighted groups) their implicit ones: weight 1 on trained pairs, delta 0.
    Batches without weighted rows are collated untouched. `trim_to` > 0: the batch is then
    cut after its last trained pair (`trim_padding`)."""
    if any(LOSS_WEIGHTS in d for d, _ in rows):
        for d, lab in rows:
            if LOSS_WEIGHTS not in d:
                d[LOSS_WEIGHTS] = (lab != IGNORE_INDEX).to(torch.float32)
                d[LOSS_WEIGHT_DELTA] = torch.zeros((), dtype=torch.float64)
    batch, labels = default_collate(rows)
    if trim_to:
        batch, labels = trim_padding(batch, labels, trim_to)
    return batch, labels


def trim_padding(
    batch: dict[str, torch.Tensor], labels: torch.Tensor, multiple: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Cut every [B, L] tensor of a batch after the last column holding a trained pair in
    any row, rounded up to `multiple` (at most L; a batch with no trained pair keeps
    `multiple` columns). The columns cut are padding, or prompt tokens after every trained
    pair of the batch: under causal attention they change no trained position's logits, so
    the loss and its gradient are those of the full rows, on fewer tokens. Why: with
    packing = "none" every row is one example padded to seq_len, and short examples would
    cost seq_len tokens each (benchmarks/peers.md: 26-token examples at seq_len 256, 10x)."""
    L = labels.shape[1]
    trained = (labels != IGNORE_INDEX).any(0).nonzero()
    end = int(trained[-1]) + 1 if len(trained) else 1
    end = min(L, -(-end // multiple) * multiple)
    if end == L:
        return batch, labels
    cut = {k: v[:, :end] if v.dim() == 2 and v.shape[1] == L else v for k, v in batch.items()}
    return cut, labels[:, :end]


class TitanscaleDataLoader(ParallelAwareDataloader):
    """torchtitan dataloader component over `PackedStream`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        source: str = "stdlib"
        """'stdlib', a local .jsonl/.json/.parquet/.txt file or folder, or a hub name."""

        packing: str = "concat"
        """concat | bfd | none (recipe [data] packing)."""

        text_field: str = "text"
        """Record field holding the text."""

        window: int = 256
        """bfd: documents packed together per round."""

        bad_records: str = "skip"
        """skip (and count) or fail on undecodable / textless / empty records."""

        streaming: str = "auto"
        """Read local files as a stream: auto (above 1 GiB), always, never."""

        infinite: bool = True
        """Loop over the source when it runs out."""

        format: str = "text"
        """text (documents) | sft (chat / prompt-completion records, data.chat)."""

        chat_template: str = "auto"
        """sft: auto (the tokenizer's own chat template if it has one) | embedded | hf."""

        truncate: bool = False
        """sft: cut examples longer than seq_len + 1 tokens (else they are bad records)."""

        weights: bool = True
        """sft: apply the records' "weight" to the loss (the validator reads without)."""

        trim_padding_to: int = 0
        """> 0: cut each batch after its last trained pair, rounded up to a multiple of this
        (data.loader.trim_padding); 0: every row is seq_len long. runtime.build sets it for
        packing = "none" where batch shapes may vary."""

        subset: str = ""
        """Hub sources: the dataset configuration (load_dataset's name=)."""

        split: str = "train"
        """Hub sources: the split."""

        data_files: list[str] = field(default_factory=list)
        """Hub sources: only these data files."""

        sources: list[dict[str, Any]] = field(default_factory=list)
        """A weighted mix: dicts with source, weight, text_field, subset, split, data_files
        (recipe [[data.sources]]); replaces `source` when not empty."""

        mix_window: int = 1000
        """Rows over which mixing proportions are exact."""

        def __post_init__(self) -> None:
            if self.packing not in PACKINGS:
                raise ValueError(f"packing must be one of {PACKINGS}, got {self.packing!r}")
            if self.bad_records not in BAD_RECORD_POLICIES:
                raise ValueError(f"bad_records must be skip or fail, got {self.bad_records!r}")
            if self.streaming not in STREAMING_MODES:
                raise ValueError(f"streaming must be one of {STREAMING_MODES}")
            if self.window < 1:
                raise ValueError(f"window must be positive, got {self.window}")
            if self.trim_padding_to < 0:
                raise ValueError(f"trim_padding_to must be >= 0, got {self.trim_padding_to}")
            if self.num_workers:
                # The stream's position lives in this process's dataset object; worker
                # processes would advance copies of it and the checkpoint would be stale.
                raise ValueError("TitanscaleDataLoader runs in the training process: num_workers=0")

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        self.stream = build_stream(
            config,
            tokenizer=tokenizer,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
        )
        if isinstance(self.stream, PackedStream):
            self.stream.rows_per_step = local_batch_size * dp_world_size
        else:
            # A prepared store (or a mix member) knows its rows per epoch up front.
            rows = getattr(getattr(getattr(self.stream, "rows", None), "plan", None),
                           "rows_per_epoch", None)  # fmt: skip
            if rows is not None and rows < local_batch_size * dp_world_size:
                logger.warning(
                    f"data: {config.source} holds {rows} rows of seq_len {seq_len} per epoch, "
                    f"less than one step's batch ({local_batch_size * dp_world_size} rows = "
                    "local batch x data-parallel size): every step re-reads it"
                )
        super().__init__(
            self.stream,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            num_workers=0,
            collate_fn=functools.partial(collate_rows, trim_to=config.trim_padding_to),
        )

    # The stream state is identical on every rank (rows are consumed a whole dp group at a
    # time), so it is saved under one key instead of torchtitan's per-dp-rank keys: DCP
    # writes it once, every rank reads it, and a run resumes at a different data-parallel
    # size (torchtitan's loader refuses that). StatefulDataLoader's own iterator state is not
    # used: with num_workers=0 the dataset object is the whole position. It is JSON text,
    # not a pickle: loading a checkpoint must never run code from it (runtime.checkpoint
    # loads non-tensor items with weights_only=True, which a pickle would not pass).
    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: json.dumps(self.stream.state_dict(), default=_plain)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if STATE_KEY not in state_dict:
            raise ValueError(
                "checkpoint has no titanscale data position (written by another dataloader?)"
            )
        raw = state_dict[STATE_KEY]
        if not isinstance(raw, str):
            raise ValueError(
                "checkpoint data position is not JSON text (an older pickled format?); "
                "refusing to unpickle it"
            )
        self.stream.load_state_dict(json.loads(raw))

    def packing_stats(self) -> dict[str, Any]:
        return self.stream.packing_stats()

    @staticmethod
    def useful_tokens(labels: torch.Tensor) -> int:
        return int((labels != IGNORE_INDEX).sum())
