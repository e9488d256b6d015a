"""Serve a recipe's base model over the Tinker HTTP API (the `tinker` SDK drives it unchanged).

    python -m tools.serve --recipe R [--host 127.0.0.1 --port 8000] [--api-key-file F]
                          [--storage DIR] [--session-ttl S] [--drain S] [--max-body-mb M]
                          [--max-request-gib G] [--max-queued-per-session N]
                          [--max-queued-per-tenant N] [--base-name NAME] [--context N]
                          [--tokenizer-id ID] [--set k=v ...]

The base is the recipe's model: `checkpoint.load_hf` (a Hugging Face folder, Llama 3 or
Qwen3), `checkpoint.load_from` (DCP) or `training.seed`. Its name, context and tokenizer:
service/served_base.py and docs/from_tinker.md.

Clients: `tinker.ServiceClient(base_url="http://HOST:PORT", api_key="tml-...")`. Keys come
from `--api-key-file` (one `KEY` or `TENANT KEY` per line, mode 0600; see
service/tenants.py): each tenant sees only its own sessions, models, samplers, results and
checkpoints. Without it the service accepts any client as one tenant and refuses to bind to
anything but loopback. SIGTERM drains, SIGHUP re-reads the key file (see service/server.py).
Usage: `<storage>/usage.jsonl`, summed by `python -m tools.usage --storage DIR`. Bad
arguments: one line, exit 2, before the model is built and before anything is served.
Details: docs/service.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from core.errors import ConfigError, held_stderr
from tools.cli import (
    ArgumentParser,
    add_override_arg,
    add_recipe_arg,
    out_dir_arg,
    positive_arg,
    run,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_recipe_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (logged)")
    p.add_argument("--api-key-file", default=None, help="API keys: KEY or TENANT KEY per line")
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
        "--max-request-gib",
        type=float,
        default=None,
        help="memory one request may use beyond the resident model (admission control); "
        "default: half the memory available once the model is built",
    )
    p.add_argument(
        "--max-queued-per-session",
        type=int,
        default=64,
        help="requests a session may have queued (429 with Retry-After beyond)",
    )
    p.add_argument(
        "--max-queued-per-tenant",
        type=int,
        default=256,
        help="requests a tenant may have queued over all its sessions",
    )
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


def check_args(args: argparse.Namespace) -> None:
    """Every number finite and in range (one line naming the flag otherwise)."""
    if not 0 <= args.port < 65536:
        raise ConfigError(f"expected a port in 0..65535, got {args.port}", key="--port")
    positive_arg(args.session_ttl, "--session-ttl")
    positive_arg(args.max_body_mb, "--max-body-mb", bound=1 << 20)
    if args.drain != 0:
        positive_arg(args.drain, "--drain")
    if args.max_request_gib is not None:
        positive_arg(args.max_request_gib, "--max-request-gib", bound=1 << 20)
    positive_arg(args.max_queued_per_session, "--max-queued-per-session", bound=1 << 20)
    positive_arg(args.max_queued_per_tenant, "--max-queued-per-tenant", bound=1 << 20)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Library warnings from the imports below (torch, torchao) are held back until the input
    # is known good: a refused argument leaves exactly one line on stderr.
    with held_stderr():
        recipe, opts, keys, served, sock = _prepare(args)
    _serve(args, recipe, opts, keys, served, sock)


def _prepare(args: argparse.Namespace):
    """Every check that can refuse the command, ending with the bound port."""
    check_args(args)
    from recipe.loader import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    from service.core import Limits
    from service.server import ServeOptions, bind, check_exposure
    from service.tenants import KeyFile

    opts = ServeOptions(
        host=args.host,
        port=args.port,
        api_key_file=args.api_key_file,
        storage=args.storage or os.path.join(recipe.output_dir, "service"),
        session_ttl_s=args.session_ttl,
        drain_s=args.drain,
        limits=Limits(
            max_body_bytes=int(args.max_body_mb * (1 << 20)),
            max_queued_per_session=args.max_queued_per_session,
            max_queued_per_tenant=args.max_queued_per_tenant,
        ),
    )
    check_exposure(opts)  # bad input before the model is built
    keys = KeyFile(opts.api_key_file) if opts.api_key_file else None
    out_dir_arg(opts.storage, "--storage")
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
    # The port before the model: "in use" is one line now, not after a minute of loading.
    sock = bind(opts.host, opts.port)
    return recipe, opts, keys, served, sock


def _serve(args: argparse.Namespace, recipe, opts, keys, served, sock) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from dataclasses import replace

    from service.admission import cost_model_from_recipe, default_budget_bytes
    from service.server import bound_host_memory, serve
    from service.titan_backend import TitanLoraBackend

    bound_host_memory()  # before the model's tensors are allocated
    backend = TitanLoraBackend.from_recipe(recipe, served)
    cost = cost_model_from_recipe(recipe)
    budget = (
        args.max_request_gib * (1 << 30)
        if args.max_request_gib is not None
        else default_budget_bytes()
    )
    opts = replace(opts, limits=replace(opts.limits, max_request_bytes=budget))
    asyncio.run(serve(backend, opts, sock=sock, keys=keys, cost=cost))


if __name__ == "__main__":
    run(main)
