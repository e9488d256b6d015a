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

from recipe.cli import add_override_arg
from recipe.errors import exit_on_config_error

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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", default=None, help="recipe TOML (default: recipes/debug.toml)")
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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


@exit_on_config_error
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    overrides = list(args.overrides)
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    from recipe.loader import load_recipe
    from recipe.models import model_shape

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
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if isinstance(v, float):
                v = f"{v:.6g}"
            print(f"{k:>26}: {v}")
    sys.stdout.flush()
    return out


if __name__ == "__main__":
    main()
