"""Serve a recipe's base model over the Tinker HTTP API (the `tinker` SDK drives it unchanged).

    python -m tools.serve --recipe R [--host 127.0.0.1 --port 8000] [--api-key-file F]
                          [--storage DIR] [--session-ttl S] [--drain S] [--set k=v ...]
                          [--base-name NAME] [--context N] [--tokenizer-id ID]

The base is the recipe's model: `checkpoint.load_hf` (a Hugging Face folder, Llama 3 or
Qwen3), `checkpoint.load_from` (DCP) or `training.seed`. Its name, context and tokenizer:
service/served_base.py and docs/from_tinker.md.

Clients: `tinker.ServiceClient(base_url="http://HOST:PORT", api_key="tml-...")`. Keys come
from `--api-key-file` (one per line, each starting with `tml-`, as the SDK requires); without
it the service accepts any client and refuses to bind to anything but loopback. SIGTERM
drains (see service/server.py). Bad arguments: one line, exit 2. Details: docs/service.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from core.errors import ConfigError
from tools.cli import add_override_arg, add_recipe_arg, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_recipe_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-file", default=None, help="API keys, one per line")
    p.add_argument(
        "--storage", default=None, help="checkpoint folder (default: <output_dir>/service)"
    )
    p.add_argument(
        "--session-ttl",
        type=float,
        default=1800.0,
        help="seconds a session lives after its last request or heartbeat",
    )
    p.add_argument(
        "--drain",
        type=float,
        default=60.0,
        help="seconds SIGTERM lets queued work finish before refusing the rest",
    )
    p.add_argument("--max-body-mb", type=float, default=64.0, help="request size limit")
    p.add_argument(
        "--base-name",
        default=None,
        help="base_model name clients use (default: the Hugging Face folder's org/name, "
        "else titanscale/<job.name>)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens per sequence, prompt + sampled (default: training.seq_len; at most the "
        "model's RoPE table and what fits the device)",
    )
    p.add_argument(
        "--tokenizer-id",
        default=None,
        help="what get_info tells clients to load with AutoTokenizer (default: the Hugging "
        "Face name, else the tokenizer folder's path)",
    )
    add_override_arg(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from recipe.loader import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    from service.core import Limits
    from service.server import ServeOptions, check_exposure, read_api_keys

    if not 0 < args.port < 65536:
        raise ConfigError(f"expected a port in 1..65535, got {args.port}", key="--port")
    opts = ServeOptions(
        host=args.host,
        port=args.port,
        api_key_file=args.api_key_file,
        storage=args.storage or os.path.join(recipe.output_dir, "service"),
        session_ttl_s=args.session_ttl,
        drain_s=args.drain,
        limits=Limits(max_body_bytes=int(args.max_body_mb * (1 << 20))),
    )
    check_exposure(opts)  # bad input before the model is built
    from service.served_base import resolve_served_base

    served = resolve_served_base(
        recipe,
        name=args.base_name,
        context=args.context,
        tokenizer_id=args.tokenizer_id,
        max_samples=opts.limits.max_samples,
    )
    base = recipe.checkpoint.load_from
    if base:  # the base model's weights (else initialised from training.seed)
        from runtime.checkpoint import not_a_checkpoint, verify_checkpoint

        if not os.path.exists(base):
            raise ConfigError(
                f"base checkpoint not found: {base} (train it first, see the recipe's header)",
                file=recipe.source,
                key="checkpoint.load_from",
            )
        why = not_a_checkpoint(base)  # a file, the run's folder, a Hugging Face folder
        if why:
            raise ConfigError(why, file=recipe.source, key="checkpoint.load_from")
        problems = verify_checkpoint(base, checksums=False)
        if problems:
            raise ConfigError(
                f"checkpoint {base} is damaged: " + "; ".join(problems),
                file=recipe.source,
                key="checkpoint.load_from",
            )
    if opts.api_key_file:
        read_api_keys(opts.api_key_file)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from service.server import serve
    from service.titan_backend import TitanLoraBackend

    backend = TitanLoraBackend.from_recipe(recipe, served)
    asyncio.run(serve(backend, opts))


if __name__ == "__main__":
    run(main)
