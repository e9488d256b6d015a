"""Small, fast stand-ins for the data tests: an in-memory source and a character tokenizer."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from torchtitan.components.tokenizer import BaseTokenizer

from data.sources import Record, Source

BOS, EOS = 1, 2


class CharTokenizer(BaseTokenizer):
    """One token per character (ids 3..vocab-1), BOS=1, EOS=2: fast and exactly invertible."""

    def __init__(self, vocab_size: int = 2048) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id = BOS, EOS

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = [3 + (ord(c) % (self.vocab_size - 3)) for c in text]
        return ([BOS] if add_bos else []) + ids + ([EOS] if add_eos else [])

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i - 3) for i in ids if i > 2)

    def get_vocab_size(self) -> int:
        return self.vocab_size


class ListSource(Source):
    """Records from a list; None = a bad record (reason 'empty')."""

    def __init__(self, texts: list[str | None], name: str = "list") -> None:
        super().__init__(description=f"{name}[{len(texts)}]")
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def records(self, start: int = 0) -> Iterator[Record]:
        for i in range(start, len(self.texts)):
            t = self.texts[i]
            yield (i, t, None) if t else (i, None, "empty")


def lockstep(streams, groups: int | None = None) -> list[tuple[Any, ...]]:
    """Global rows (input, positions, labels), in global order, from dp streams advanced
    in lockstep as training does: `groups` groups of dp rows (None: until the end)."""
    its = [iter(s) for s in streams]
    out: list[tuple[Any, ...]] = []
    g = 0
    while groups is None or g < groups:
        try:
            items = [next(it) for it in its]
        except StopIteration:
            break
        out += [(x["input"], x["positions"], y) for x, y in items]
        g += 1
    return out


def same_rows(a, b) -> bool:
    import torch

    return len(a) == len(b) and all(
        all(torch.equal(u, v) for u, v in zip(ra, rb, strict=True))
        for ra, rb in zip(a, b, strict=True)
    )


def doc_text(i: int, n: int) -> str:
    """n copies of one character naming the document (distinct token ids for i < 2000)."""
    return chr(0x4E00 + (i % 2000)) * n


def random_lengths(seed: int, count: int, lo: int = 1, hi: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(lo, 40), rng.randint(lo, hi)]) for _ in range(count)]


def make_tokenizer_dir(path, texts: list[str], vocab_size: int = 320) -> str:
    """A small byte-level BPE folder (tokenizer.json + tokenizer_config.json) in a second."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return str(path)
