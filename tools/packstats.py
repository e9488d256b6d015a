"""Pack a source once and report what packing costs: padding, split documents, speed.

    python -m tools.packstats --data PATH|stdlib --tokenizer PATH|embedded --seq-len N \\
        --packing concat|bfd|none [--window W] [--text-field F] [--json]
    python -m tools.packstats --recipe recipes/debug.toml [--set data.packing=bfd ...]

Flags are shorthands for recipe keys (--data = data.source, --tokenizer = model.tokenizer,
--seq-len = training.seq_len, --packing = data.packing, ...), applied as `--set`
overrides on the recipe (default: the debug recipe), so values are checked the same way.
Output keys: documents, tokens (label-bearing positions), sequences, padding_fraction,
split_documents_fraction, tokens_per_sec (one pass: read + tokenize + pack, this process),
plus packing_efficiency, bad_records and seconds. Bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys

from core.errors import ConfigError, exit_on_config_error
from tools.cli import ArgumentParser, add_override_arg, add_recipe_arg, run

FLAG_KEYS = {
    "data": "data.source",
    "tokenizer": "model.tokenizer",
    "seq_len": "training.seq_len",
    "packing": "data.packing",
    "window": "data.window",
    "text_field": "data.text_field",
    "bad_records": "data.bad_records",
    "streaming": "data.streaming",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_recipe_arg(p)
    add_override_arg(p)
    p.add_argument("--data", help="'stdlib' or a .jsonl/.json/.parquet/.txt file or folder")
    p.add_argument("--tokenizer", help="tokenizer folder, or 'embedded'")
    p.add_argument("--seq-len", dest="seq_len")
    p.add_argument("--packing", help="concat | bfd | none")
    p.add_argument("--window", help="bfd window (documents)")
    p.add_argument("--text-field", dest="text_field")
    p.add_argument("--bad-records", dest="bad_records", help="skip | fail")
    p.add_argument("--streaming", help="auto | always | never")
    p.add_argument("--max-records", type=int, default=None, help="stop after N records")
    p.add_argument("--dp", type=int, default=None,
                   help="with --rank/--rows: produce one rank's rows of a DP-way run")  # fmt: skip
    p.add_argument("--rank", type=int, default=0, help="the data-parallel rank (with --dp)")
    p.add_argument("--rows", type=int, default=1000, help="rows to produce (with --dp)")
    p.add_argument("--repeat", type=int, default=1,
                   help="with --dp: build the stream and produce the rows N times; "
                   "rank_seconds is the median")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


@exit_on_config_error
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from core.hardware import MAX_WORLD_SIZE
    from tools.cli import positive_arg

    # Each is a loop over rows or records; a huge value is a run that never ends.
    if args.dp is not None:
        positive_arg(args.dp, "--dp", MAX_WORLD_SIZE)
        if not 0 <= args.rank < args.dp:
            raise ConfigError(
                f"expected 0 <= rank < dp, got rank {args.rank}, dp {args.dp}", key="--rank"
            )
    positive_arg(args.rows, "--rows", 10**7)
    positive_arg(args.repeat, "--repeat", 100)
    if args.max_records is not None:
        positive_arg(args.max_records, "--max-records", 10**9)
    overrides = list(args.overrides)
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    from core.models import model_shape
    from recipe.loader import load_recipe

    recipe = load_recipe(args.recipe, overrides)
    from data.sources import check_source

    check_source(recipe.data.source, file=recipe.source)
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from data.packstats import measure_packing
    from data.tokenizer import resolve_tokenizer

    vocab = (
        recipe.model.vocab_size or model_shape(recipe.model.flavor, recipe.model.family).vocab_size
    )
    tok_path = resolve_tokenizer(
        recipe.model.tokenizer, vocab_size=vocab, recipe_file=recipe.source
    )
    tokenizer = HuggingFaceTokenizer(tokenizer_path=tok_path)
    d = recipe.data
    if args.dp is not None:
        out = rank_rows(
            recipe, tokenizer, dp=args.dp, rank=args.rank, rows=args.rows, repeat=args.repeat
        )
        out["tokenizer"] = tok_path
        _print(out, args.json)
        return out
    from data.store import is_store

    if is_store(d.source):
        from data.packstats import measure_store

        out = measure_store(d.source, tokenizer, seq_len=recipe.training.seq_len,
                            packing=d.packing, window=d.window)  # fmt: skip
        out["tokenizer"] = tok_path
        _print(out, args.json)
        return out
    out = measure_packing(
        d.source,
        tokenizer,
        seq_len=recipe.training.seq_len,
        packing=d.packing,
        window=d.window,
        text_field=d.text_field,
        bad_records=d.bad_records,
        streaming=d.streaming,
        max_records=args.max_records,
    )
    out["tokenizer"] = tok_path
    _print(out, args.json)
    return out


def _print(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if isinstance(v, float):
                v = f"{v:.6g}"
            print(f"{k:>26}: {v}")
    sys.stdout.flush()


def rank_rows(recipe, tokenizer, *, dp: int, rank: int, rows: int, repeat: int = 1) -> dict:
    """Rank `rank`'s first `rows` rows of a `dp`-way run, in this process (no process
    group): the loader's own stream, built as the trainer builds it. `rank_seconds` counts
    from opening the source to the last row (plan, reads, tokenization where streaming);
    with `repeat` > 1 it is the median of that many full repetitions."""
    import statistics

    if repeat < 1:
        raise ConfigError(f"expected a positive count, got {repeat}", key="--repeat")
    runs = [_rank_rows_once(recipe, tokenizer, dp=dp, rank=rank, rows=rows) for _ in range(repeat)]
    out = dict(runs[0])
    secs = [r["rank_seconds"] for r in runs]
    out["rank_seconds"] = statistics.median(secs)
    out["rank_seconds_all"] = secs
    out["rank_cpu_seconds"] = statistics.median(r["rank_cpu_seconds"] for r in runs)
    out["tokens_per_sec_per_rank"] = out["tokens_delivered"] / out["rank_seconds"]
    return out


def _rank_rows_once(recipe, tokenizer, *, dp: int, rank: int, rows: int) -> dict:
    import time

    from data.loader import PackedStream, build_stream
    from runtime.build import dataloader_config

    if dp < 1 or not 0 <= rank < dp:
        raise ConfigError(f"expected 0 <= rank < dp, got rank {rank}, dp {dp}", key="--rank")
    if rows < 1:
        raise ConfigError(f"expected a positive row count, got {rows}", key="--rows")
    L = recipe.training.seq_len
    t0, c0 = time.perf_counter(), time.process_time()
    stream = build_stream(
        dataloader_config(recipe), tokenizer=tokenizer, seq_len=L, dp_rank=rank, dp_world_size=dp
    )
    useful = 0
    n = 0
    for _x, y in stream:
        useful += int((y != -100).sum())
        n += 1
        if n == rows:
            break
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    path = "stream" if isinstance(stream, PackedStream) else getattr(stream, "kind", "?")
    return {
        "path": path,
        "source": recipe.data.source,
        "packing": recipe.data.packing,
        "seq_len": L,
        "dp": dp,
        "rank": rank,
        "rows": n,
        "rank_seconds": dt,
        "rank_cpu_seconds": cpu,
        "tokens_delivered": n * L,
        "useful_tokens": useful,
        "tokens_per_sec_per_rank": n * L / dt if dt > 0 else None,
    }


if __name__ == "__main__":
    run(main)
