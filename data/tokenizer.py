"""Tokenizer resolution: a folder the user names, or the embedded byte-level BPE.

`embedded` trains a byte-level BPE with `tokenizers` on the standard-library corpus the
first time it is needed (about a second per MB on one core) and caches it under
`$TITANSCALE_CACHE` (default `~/.cache/titanscale`). Several ranks may start at once: the
first takes a file lock and trains, the others wait and load the same files, and the files
appear by atomic rename, so no rank ever reads a half-written tokenizer.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path

from core import jsonio
from core.atomic import publish_folder
from core.errors import ConfigError

# The text files of a Hugging Face tokenizer folder that AutoTokenizer reads (what the
# service hands a client, GET /api/v1/tokenizer, and tools.tokenizer writes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
# Training on the first few MB is enough for a debug vocabulary and keeps first use fast.
_TRAIN_BYTES = 6_000_000


def cache_root() -> Path:
    return Path(os.environ.get("TITANSCALE_CACHE", Path.home() / ".cache" / "titanscale"))


def _embedded_key(vocab_size: int) -> str:
    import tokenizers

    ident = f"py{sys.version_info[:3]}-tok{tokenizers.__version__}-v{vocab_size}-b{_TRAIN_BYTES}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _train_embedded(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from data.corpus import iter_stdlib_documents

    def texts():
        used = 0
        for _, text in iter_stdlib_documents():
            yield text
            used += len(text)
            if used >= _TRAIN_BYTES:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=1)
    )
    publish_folder(tmp, out, replace=False)  # atomic: readers see all files or none


def resolve_tokenizer(spec: str, *, vocab_size: int, recipe_file: str | None = None) -> str:
    """Return a folder holding tokenizer.json for `spec` ('embedded' or a path)."""
    if spec != "embedded":
        p = Path(spec)
        if not (p / "tokenizer.json").exists() and not (p / "vocab.json").exists():
            raise ConfigError(
                f"tokenizer folder {spec!r} has no tokenizer.json (or vocab.json+merges.txt); "
                "give a folder with a Hugging Face tokenizer, or 'embedded'",
                file=recipe_file,
                key="model.tokenizer",
            )
        return str(p)
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create the tokenizer cache {root}: {e.strerror} (set TITANSCALE_CACHE)",
            file=recipe_file,
            key="model.tokenizer",
        ) from None
    out = root / f"tokenizer-{_embedded_key(vocab_size)}"
    if (out / "tokenizer.json").exists():
        return str(out)
    with open(root / ".tokenizer.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one trainer; the others block here, then load
        if not (out / "tokenizer.json").exists():
            _train_embedded(out, vocab_size)
    return str(out)


def tokenizer_id_count(folder: str) -> int | None:
    """The tokenizer's largest token id + 1 (added tokens included): the embedding rows it
    needs. From tokenizer.json, else vocab.json; None when neither reads."""
    tj = Path(folder) / "tokenizer.json"
    if not tj.exists():
        return _vocab_json_id_count(Path(folder))
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tj)).get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def _vocab_json_id_count(folder: Path) -> int | None:
    """vocab.json's largest id + 1 (what torchtitan's HuggingFaceTokenizer builds from a
    vocab.json + merges.txt folder), or None when it is unreadable (torchtitan reports it)."""
    try:
        ids = [int(v) for v in jsonio.loads((folder / "vocab.json").read_bytes()).values()]
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return max(ids) + 1 if ids else None
