"""titanscale's dataloader component for torchtitan's Trainer.

Built by the Trainer as `config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=,
seq_len=, local_batch_size=, snapshot_every_n_steps=)`; yields
`({"input": [B, L], "positions": [B, L]}, labels [B, L])` with positions reset to 0 at each
document (torchtitan derives the flex / varlen / dense document masks from them) and
labels = IGNORE_INDEX (-100) where nothing is to be predicted.

Sharding invariant: packed rows form ONE global stream, identical on every rank, and
data-parallel rank r takes rows r, r + dp, r + 2dp, ... So the union of a step's batches is
the same set of rows for every data-parallel size: a 1-process run with local batch B x dp
sees exactly the sequences that dp processes with local batch B see, and a checkpoint
(the global row counter) resumes at any data-parallel size. Cost: every rank tokenizes the
whole stream, dp times the tokenization work of document-level sharding; tokenization runs
at >1M tokens/s/core, far above what one GPU consumes at the dp sizes we plan for.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer

from data.corpus import iter_stdlib_documents


def iter_documents(source: str, text_field: str, start: int = 0) -> Iterator[tuple[int, str]]:
    """(document index, text) from `source`, from document index `start`."""
    if source == "stdlib":
        yield from iter_stdlib_documents(start=start)
        return
    raise ValueError(f"unsupported data source {source!r}")


class PackedStream(IterableDataset, Stateful):
    """Concat-then-split packing of the global document stream, this rank's rows only."""

    def __init__(
        self,
        *,
        source: str,
        text_field: str,
        tokenizer: BaseTokenizer,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        infinite: bool = True,
    ) -> None:
        self.source = source
        self.text_field = text_field
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        # Global position: the next document to read, the next global row index, the epoch,
        # and the partial row carried between documents. Saved in checkpoints.
        self._next_doc = 0
        self._row = 0
        self._epoch = 0
        self._buf_in: list[int] = []
        self._buf_lab: list[int] = []
        self._buf_pos: list[int] = []

    def _emit(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        # Rows are consumed a whole data-parallel group (dp rows) at a time, so between two
        # yields every rank holds the same stream state: a checkpoint taken on any rank is
        # valid for all ranks at any data-parallel size.
        L, dp = self.seq_len, self.dp_world_size
        while len(self._buf_in) >= L * dp:
            start = self.dp_rank * L
            inp = self._buf_in[start : start + L]
            lab = self._buf_lab[start : start + L]
            pos = self._buf_pos[start : start + L]
            del self._buf_in[: L * dp], self._buf_lab[: L * dp], self._buf_pos[: L * dp]
            self._row += dp
            # A document split across rows continues at position p > 0; restart it at 0 so
            # the row's first token starts a (partial) document for the mask and RoPE.
            if pos[0] != 0:
                off = pos[0]
                for i, p in enumerate(pos):
                    if p == 0 and i > 0:
                        break
                    pos[i] = p - off
            yield (
                {"input": torch.tensor(inp), "positions": torch.tensor(pos)},
                torch.tensor(lab),
            )

    def __iter__(self):
        while True:
            for idx, text in iter_documents(self.source, self.text_field, self._next_doc):
                ids = self.tokenizer.encode(text, add_bos=True, add_eos=True)
                self._next_doc = idx + 1
                # Shift within the document: its last token never predicts the next
                # document's first token (torchtitan's convention).
                self._buf_in.extend(ids[:-1])
                self._buf_lab.extend(ids[1:])
                self._buf_pos.extend(range(len(ids) - 1))
                yield from self._emit()
            if not self.infinite:
                return
            self._epoch += 1
            self._next_doc = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_doc": self._next_doc,
            "row": self._row,
            "epoch": self._epoch,
            "buf_in": list(self._buf_in),
            "buf_lab": list(self._buf_lab),
            "buf_pos": list(self._buf_pos),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._next_doc = sd["next_doc"]
        self._row = sd["row"]
        self._epoch = sd["epoch"]
        self._buf_in, self._buf_lab, self._buf_pos = (
            list(sd["buf_in"]),
            list(sd["buf_lab"]),
            list(sd["buf_pos"]),
        )


class TitanscaleDataLoader(ParallelAwareDataloader):
    """torchtitan dataloader component over `PackedStream`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        source: str = "stdlib"
        """'stdlib' or a local file/folder (see recipe [data] source)."""

        packing: str = "concat"
        """Packing strategy (recipe [data] packing)."""

        text_field: str = "text"
        """Record field holding the text."""

        infinite: bool = True
        """Loop over the source when it runs out."""

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
        ds = PackedStream(
            source=config.source,
            text_field=config.text_field,
            tokenizer=tokenizer,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            infinite=config.infinite,
        )
        super().__init__(
            ds,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            num_workers=config.num_workers,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )

    # The stream state is identical on every rank (see PackedStream._emit), so it is saved
    # under one key instead of torchtitan's per-dp-rank keys, which also lets a run resume at
    # a different data-parallel size (torchtitan's loader refuses that).
    def state_dict(self) -> dict[str, Any]:
        return {"titanscale_stream": pickle.dumps(StatefulDataLoader.state_dict(self))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if "titanscale_stream" not in state_dict:
            raise ValueError(
                "checkpoint has no titanscale data position (written by another dataloader?)"
            )
        StatefulDataLoader.load_state_dict(self, pickle.loads(state_dict["titanscale_stream"]))

    @staticmethod
    def useful_tokens(labels: torch.Tensor) -> int:
        return int((labels != IGNORE_INDEX).sum())
