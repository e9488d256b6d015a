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
exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from core.errors import ConfigError, exit_on_config_error
from tools.cli import run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--source", required=True, help="stdlib, a local file/folder, or a hub name")
    p.add_argument("--subset", default="", help="hub dataset configuration (e.g. en for C4)")
    p.add_argument("--split", default="train", help="hub dataset split (default train)")
    p.add_argument("--data-files", dest="data_files", action="append", default=[],
                   help="hub data files (globs; repeatable)")  # fmt: skip
    p.add_argument("--text-field", dest="text_field", default="text")
    p.add_argument("--streaming", default="auto", help="local files: auto | always | never")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder, or 'embedded'")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=2048,
                   help="embedded tokenizer only: its vocabulary (the debug model's: 2048)")  # fmt: skip
    p.add_argument("--out", required=True, help="store folder to create")
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
    return p.parse_args(argv)


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


@exit_on_config_error
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.num_proc < 1:
        raise ConfigError(f"expected a positive count, got {args.num_proc}", key="--num-proc")
    plans = [parse_plan(s) for s in args.plan]
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
    out = Path(args.out)
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
