"""Tokenize a source once into a memory-mapped token store (data/store.py).

    python -m tools.prepare_data --source stdlib --tokenizer embedded --out stores/stdlib
    python -m tools.prepare_data --source allenai/c4 --subset en --split train \\
        --data-files 'en/c4-train.0000*-of-01024.json.gz' --tokenizer path/to/tok --out stores/c4
    python -m tools.prepare_data --source corpus/ --tokenizer tok/ --out stores/corpus \\
        --num-proc 8 --plan bfd:8192:256

Then train with `[data] source = "stores/c4"`: rank r reads only its own rows. The run
shows a progress bar, resumes from `<out>.partial/` when interrupted (run the same command
again), and publishes `<out>` atomically with a manifest (source fingerprint, tokenizer
hash, documents, tokens). `--plan bfd:SEQ_LEN[:WINDOW]` also caches the bfd packing plan
for that seq_len (concat and none need none). An existing store for the same source and
tokenizer is left as is (exit 0); anything else at `--out` is refused. Bad input: one line,
exit 2 (a missing or wrong argument too, not a usage block).

    python -m tools.prepare_data --verify stores/c4     # every recorded checksum, one pass

A resume starts after the last shard that is intact on disk (size and CRC32 as written); an
unreadable progress.json starts over. Both are said in one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from core.errors import ConfigError, exit_on_config_error
from tools.cli import ArgumentParser, positive_arg, run

# The embedded byte-level BPE holds the 256 byte symbols and 3 special tokens at least.
MIN_EMBEDDED_VOCAB = 259
INT_LIMIT = 2**31 - 1  # recipe.limits.INT_LIMIT: token ids and counts are int32 in places
# Arrow list offsets are int32: a shard closes after the record that reaches --shard-tokens,
# so the bound leaves room for one more document of up to 2^30 tokens.
MAX_SHARD_TOKENS = 1 << 30
MAX_PROCS = 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--verify", metavar="STORE",
                   help="check every recorded checksum of a prepared store, then exit")  # fmt: skip
    # Required unless --verify (checked below, with argparse's own wording).
    p.add_argument("--source", help="stdlib, a local file/folder, or a hub name (required)")
    p.add_argument("--subset", default="", help="hub dataset configuration (e.g. en for C4)")
    p.add_argument("--split", default="train", help="hub dataset split (default train)")
    p.add_argument("--data-files", dest="data_files", action="append", default=[],
                   help="hub data files (globs; repeatable)")  # fmt: skip
    p.add_argument("--text-field", dest="text_field", default="text")
    p.add_argument("--streaming", default="auto", help="local files: auto | always | never")
    p.add_argument("--tokenizer", help="tokenizer folder, or 'embedded' (required)")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=2048,
                   help="embedded tokenizer only: its vocabulary (the debug model's: 2048)")  # fmt: skip
    p.add_argument("--out", help="store folder to create (required)")
    p.add_argument("--num-proc", dest="num_proc", type=int, default=1,
                   help="tokenizer processes")  # fmt: skip
    p.add_argument("--shard-tokens", dest="shard_tokens", type=int, default=1 << 27,
                   help="tokens per Arrow shard (the unit of resume)")  # fmt: skip
    p.add_argument("--plan", action="append", default=[],
                   help="cache a bfd plan: bfd:SEQ_LEN[:WINDOW] (repeatable)")  # fmt: skip
    p.add_argument("--max-records", dest="max_records", type=int, default=None,
                   help="only the first N records (tests, benchmarks)")  # fmt: skip
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--json", action="store_true", help="print the manifest as one JSON object")
    args = p.parse_args(argv)
    missing = [f"--{k.replace('_', '-')}" for k in ("source", "tokenizer", "out")
               if getattr(args, k) is None]  # fmt: skip
    if args.verify is None and missing:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def _fingerprint(args: argparse.Namespace, source) -> str:
    from data.sources import check_source, local_files
    from data.store import source_fingerprint

    where = check_source(args.source, key="--source")
    extra = json.dumps(
        [
            source.description,
            args.text_field,
            args.subset,
            args.split,
            args.data_files,
            args.max_records,
        ]  # fmt: skip
    )
    if where == "stdlib":
        from data.corpus import stdlib_files

        return source_fingerprint(stdlib_files(), extra)
    if where == "local":
        return source_fingerprint(local_files(Path(args.source), file=None, key="--source")[1],
                                  extra)  # fmt: skip
    return source_fingerprint([], extra)  # hub: its name, configuration, split and files


def parse_plan(spec: str) -> tuple[int, int]:
    parts = spec.split(":")
    try:
        if parts[0] != "bfd" or len(parts) not in (2, 3):
            raise ValueError
        seq_len = int(parts[1])
        window = int(parts[2]) if len(parts) == 3 else 256
        if seq_len < 1 or window < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"expected bfd:SEQ_LEN[:WINDOW], got {spec!r}", key="--plan") from None
    return seq_len, window


def check_sizes(args: argparse.Namespace) -> None:
    """Counts and sizes: positive and bounded (one line naming the argument)."""
    positive_arg(args.num_proc, "--num-proc", MAX_PROCS)
    positive_arg(args.shard_tokens, "--shard-tokens", MAX_SHARD_TOKENS)
    if args.max_records is not None:
        positive_arg(args.max_records, "--max-records", INT_LIMIT)
    if args.tokenizer == "embedded":
        positive_arg(args.vocab_size, "--vocab-size", INT_LIMIT)
        if args.vocab_size < MIN_EMBEDDED_VOCAB:
            raise ConfigError(
                f"{args.vocab_size} is too small: the embedded byte-level tokenizer holds the "
                f"256 byte symbols and 3 special tokens (at least {MIN_EMBEDDED_VOCAB})",
                key="--vocab-size",
            )


def out_arg(path: str) -> Path:
    """--out: a folder that can be created next to its parent (checked before any work)."""
    from core.typed_toml import show
    from tools.cli import out_dir_arg

    out = Path(path)
    if not path or not out.name or out.name in (".", ".."):
        raise ConfigError(f"expected a new folder name, got {show(path)}", key="--out")
    out_dir_arg(str(out.parent), "--out")  # a file in the way, no permission: one line
    return out


def verify(path: str) -> dict:
    from data.store import TokenStore

    store = TokenStore(path, key="--verify", checksums=False)
    store.verify()
    m = store.manifest
    print(f"{path}: intact ({m['documents']:,} documents, {m['tokens']:,} tokens, "
          f"{len(m['shards'])} shards)")  # fmt: skip
    return m


def _fault_seam():
    """TITANSCALE_FAULT's `at=shard` point (runtime/faults.py; tests kill a run after a
    chosen shard is durable); None when no fault is set, so nothing runs per shard."""
    import os

    from runtime import faults

    if not os.environ.get(faults.ENV):
        return None
    faults.check()
    return lambda n: faults.inject("shard", n)


@exit_on_config_error
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.verify is not None:
        return verify(args.verify)
    check_sizes(args)
    plans = [parse_plan(s) for s in args.plan]
    out = out_arg(args.out)
    from data.sources import check_source, open_source
    from data.store import TokenStore, is_store, prepare, tokenizer_hash
    from data.tokenizer import resolve_tokenizer

    if args.source != "stdlib" and is_store(args.source):
        raise ConfigError(f"{args.source!r} is already a prepared store", key="--source")
    check_source(args.source, key="--source")
    tok_dir = resolve_tokenizer(args.tokenizer, vocab_size=args.vocab_size)
    source = open_source(
        args.source,
        text_field=args.text_field,
        streaming=args.streaming,
        subset=args.subset,
        split=args.split,
        data_files=args.data_files or None,
        key="--source",
    )
    if args.max_records is not None:
        from data.packstats import LimitedSource

        source = LimitedSource(source, args.max_records)
    fp = _fingerprint(args, source)
    t0 = time.perf_counter()
    if is_store(out):
        m = TokenStore(out, key="--out").manifest
        if m["source"]["fingerprint"] != fp or m["tokenizer"]["hash"] != tokenizer_hash(tok_dir):
            raise ConfigError(
                f"{str(out)!r} holds a store of another source or tokenizer; remove it or "
                "choose another --out",
                key="--out",
            )
        print(f"{out}: already prepared ({m['documents']:,} documents, {m['tokens']:,} tokens)",
              file=sys.stderr)  # fmt: skip
        manifest = m
    elif out.exists():
        raise ConfigError(f"{str(out)!r} exists and is not a token store", key="--out")
    else:
        manifest = prepare(
            source,
            tokenizer_dir=tok_dir,
            tokenizer_spec=args.tokenizer,
            out=out,
            fingerprint=fp,
            num_proc=args.num_proc,
            shard_tokens=args.shard_tokens,
            progress=args.progress,
            on_shard=_fault_seam(),
        )
    seconds = time.perf_counter() - t0
    if plans:
        from data.plan import make_plan, plan_cache_dir

        store = TokenStore(out)
        pairs = store.token_counts() - 1
        for seq_len, window in plans:
            p = make_plan("bfd", pairs, seq_len, window=window,
                          cache=plan_cache_dir(out, seq_len, window))  # fmt: skip
            print(f"plan bfd seq_len {seq_len} window {window}: {p.rows_per_epoch:,} rows",
                  file=sys.stderr)  # fmt: skip
    result = {**manifest, "out": str(out), "seconds": seconds}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens, "
              f"bad records {manifest['bad_records']}")  # fmt: skip
    return result


if __name__ == "__main__":
    run(main)
