"""Serve a recipe's base model over the Tinker HTTP API (the `tinker` SDK drives it unchanged).

    python -m tools.serve --recipe R [--recipe R2 ...] [--host 127.0.0.1 --port 8000]
                          [--api-key-file F] [--storage DIR] [--session-ttl S] [--drain S] [--max-body-mb M]
                          [--max-request-gib G] [--max-resident-gib G]
                          [--max-queued-per-session N]
                          [--max-queued-per-tenant N] [--base-name NAME] [--context N]
                          [--tokenizer-id ID] [--generators 0|1] [--generator-tokens T]
                          [--adapters N] [--op-timeout S] [--limit NAME=VALUE ...]
                          [--sampler titanscale|vllm] [--sampler-window-ms MS]
                          [--set k=v ...]

A model resource over several devices (every rank holds a shard of the base; rank 0 serves):

    python -m tools.torchrun --standalone --nproc-per-node N -m tools.serve --recipe R ...

(or `tools.launch --serve` on Slurm). The resource is planned before anything starts
(parallel/serve.py, the same plan `tools.plan --serve` prints): a base the devices cannot
hold, a generator or a context that does not fit is one line and exit 2. `--generators 0`
serves training only: no generator memory, sampling refused (400 naming the option).

The base is the recipe's model: `checkpoint.load_hf` (a Hugging Face folder, Llama 3 or
Qwen3), `checkpoint.load_from` (DCP) or `training.seed`. Its name, context and tokenizer:
service/served_base.py and docs/from_tinker.md.

Several bases: `--recipe A --recipe B` serves each recipe's base from this one process, on
one device: each base has its own backend (model, adapters, generator), requests pick one by
its name (`base_model`: create_model, create_sampling_client, get_tokenizer) and models and
samplers keep theirs; `get_server_capabilities` lists them all; one store holds every
checkpoint, each recording its base (loading it onto another base is a 400). Memory: the bases
are priced together before anything is built (their resident parts add up, one operation runs
at a time: parallel.serve.plan_together, what `tools.plan --serve --recipe A --recipe B`
prints); a set that does not fit is one line naming the bases and the numbers, exit 2.
`--set` applies to every recipe (a base's own keys go in its own recipe, which may inherit
another with `base = "..."`); `--base-name` is given once per recipe, `--context` and
`--tokenizer-id` once for all or once per recipe. A model resource (torchrun) and
`--sampler vllm` serve one base (several: one line, exit 2).

Clients: `tinker.ServiceClient(base_url="http://HOST:PORT", api_key="tml-...")`. Keys come
from `--api-key-file` (one `KEY` or `TENANT KEY` per line, mode 0600; see
service/tenants.py): each tenant sees only its own sessions, models, samplers, results and
checkpoints. Without it the service accepts any client as one tenant and refuses to bind to
anything but loopback. SIGTERM drains, SIGHUP re-reads the key file (see service/server.py).
Usage: `<storage>/usage.jsonl`, summed by `python -m tools.usage --storage DIR`. Bad
arguments: one line, exit 2, before the model is built and before anything is served.

Sampling: `--sampler titanscale` (default) decodes with our KV-cache generator on the
served base; `--sampler vllm` starts one vLLM engine over the same base weights (its Hugging
Face view, rl/vllm_engine.py; `.venv-vllm`, `bash scripts/setup.sh --vllm`) and every sampling
client samples there: sampler weights load into it as LoRA adapters, concurrent requests of
several tenants meet in one engine batch (multi-LoRA), admission prices the engine's KV
cache; stop strings and prompt logprobs are then refused (400 naming the field). One process
only (a model resource refuses it); without the engine environment it is refused in one line
before the port is bound (exit 2). See service/vllm_sampler.py and docs/vllm.md.
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
    add_recipe_arg(
        p,
        repeat=True,
        help="recipe TOML or a name in recipes/; repeat it to serve several bases from one "
        "process (one device; not with torchrun or --sampler vllm)",
    )
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
        "--max-resident-gib",
        type=float,
        default=None,
        help="memory of adapters (x4: weights, gradients, AdamW moments) and sampler snapshots "
        "held between requests; beyond, 429 (service/resident.py); default: the half of the "
        "memory available once the model is built that --max-request-gib leaves",
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
        action="append",
        default=None,
        help="base_model name clients use (default: the Hugging Face folder's org/name, "
        "else titanscale/<job.name>); with several --recipe, once per recipe in order",
    )
    p.add_argument(
        "--context",
        action="append",
        type=int,
        default=None,
        help="tokens per sequence, prompt + sampled (default: training.seq_len; at most the "
        "model's RoPE table and what fits the device); with several --recipe, once for "
        "every base or once per recipe in order",
    )
    p.add_argument(
        "--tokenizer-id",
        action="append",
        default=None,
        help="what get_info tells clients to load with AutoTokenizer (default: the served "
        "name; clients fetch its files with python -m tools.tokenizer); with several "
        "--recipe, once for every base or once per recipe in order",
    )
    p.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a per-request or per-tenant limit (service/limits.py, docs/service.md "
        '"Limits"): max_data, max_samples, max_stop, max_stop_chars, max_metadata_bytes, '
        "max_sessions_per_tenant, max_models_per_tenant, max_finished_sessions_per_tenant, "
        "op_deadline_factor, op_deadline_min_s",
    )
    p.add_argument(
        "--piece-tokens",
        type=int,
        default=8192,
        help="fair sharing: a forward_backward runs in pieces of at most this many tokens, "
        "other tenants' requests between them (0: whole requests)",
    )
    p.add_argument(
        "--tenant-token-rate",
        type=float,
        default=None,
        help="tokens/s each tenant may send (429 with Retry-After beyond; default: unlimited)",
    )
    p.add_argument(
        "--tenant-token-burst",
        type=float,
        default=65536.0,
        help="tokens a tenant may send at once before --tenant-token-rate applies",
    )
    p.add_argument(
        "--storage-quota-gib",
        type=float,
        default=None,
        help="checkpoint storage per tenant (a save beyond it gets 413; default: none)",
    )
    p.add_argument(
        "--prices",
        default=None,
        help="price table (JSON: usd_per_gpu_hour, usd_per_million_tokens by prefill/"
        "sampled/trained) for get_billing_usage's estimated costs",
    )
    add_resource_args(p)
    p.add_argument(
        "--sampler",
        choices=("titanscale", "vllm"),
        default="titanscale",
        help="what sampling clients sample with: titanscale (our KV-cache generator on the "
        "served base) or vllm (one vLLM engine over the same base, adapters as LoRA, several "
        "tenants per engine batch; needs `bash scripts/setup.sh --vllm`; one process only)",
    )
    p.add_argument(
        "--sampler-window-ms",
        type=float,
        default=20.0,
        help="--sampler vllm: how long a sample request waits for others to join its engine batch",
    )
    p.add_argument(
        "--op-timeout",
        type=float,
        default=900.0,
        help="a model resource (torchrun): seconds one operation may take on all ranks; "
        "past it the operation fails and the service stops (exit 1)",
    )
    add_override_arg(p)
    return p.parse_args(argv)


def recipe_paths(args: argparse.Namespace) -> list[str | None]:
    """The --recipe values in order (None: the default recipe)."""
    return list(args.recipe) if args.recipe else [None]


def base_options(args: argparse.Namespace) -> list[tuple[str | None, int | None, str | None]]:
    """(--base-name, --context, --tokenizer-id) of each base, in --recipe order: each option
    given never, once (every base; not --base-name with several: the names must differ) or
    once per recipe; otherwise one line naming the option."""
    n = len(recipe_paths(args))

    def per_base(values: list | None, flag: str, shared: bool) -> list:
        if not values:
            return [None] * n
        if len(values) == n:
            return list(values)
        if len(values) == 1 and shared:
            return list(values) * n
        raise ConfigError(
            f"given {len(values)} times for {n} --recipe: give it once per recipe, in order"
            + ("" if shared else " (each base needs its own name)"),
            key=flag,
        )

    names = per_base(args.base_name, "--base-name", shared=False)
    contexts = per_base(args.context, "--context", shared=True)
    tokenizers = per_base(args.tokenizer_id, "--tokenizer-id", shared=True)
    return list(zip(names, contexts, tokenizers, strict=True))


def check_args(args: argparse.Namespace) -> None:
    """Every number finite and in range (one line naming the flag otherwise)."""
    base_options(args)
    if not 0 <= args.port < 65536:
        raise ConfigError(f"expected a port in 0..65535, got {args.port}", key="--port")
    positive_arg(args.session_ttl, "--session-ttl")
    positive_arg(args.max_body_mb, "--max-body-mb", bound=1 << 20)
    if args.drain != 0:
        positive_arg(args.drain, "--drain")
    if args.max_request_gib is not None:
        positive_arg(args.max_request_gib, "--max-request-gib", bound=1 << 20)
    if args.max_resident_gib is not None:
        positive_arg(args.max_resident_gib, "--max-resident-gib", bound=1 << 20)
    positive_arg(args.max_queued_per_session, "--max-queued-per-session", bound=1 << 20)
    positive_arg(args.max_queued_per_tenant, "--max-queued-per-tenant", bound=1 << 20)
    if args.piece_tokens != 0:
        positive_arg(args.piece_tokens, "--piece-tokens", bound=1 << 30)
    if args.tenant_token_rate is not None:
        positive_arg(args.tenant_token_rate, "--tenant-token-rate", bound=1e12)
    positive_arg(args.tenant_token_burst, "--tenant-token-burst", bound=1e12)
    if args.storage_quota_gib is not None:
        positive_arg(args.storage_quota_gib, "--storage-quota-gib", bound=1 << 30)
    check_resource_args(args)
    positive_arg(args.op_timeout, "--op-timeout", bound=7 * 86400)
    if args.sampler_window_ms != 0:
        positive_arg(args.sampler_window_ms, "--sampler-window-ms", bound=60_000)
    from service.limits import parse_limit

    for text in args.limit:
        try:
            parse_limit(text)
        except ValueError as e:
            raise ConfigError(str(e), key="--limit") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Library warnings from the imports below (torch, torchao) are held back until the input
    # is known good: a refused argument leaves exactly one line on stderr.
    with held_stderr():
        recipes, opts, keys, served, sock, plans = _prepare(args)
    return _serve(args, recipes, opts, keys, served, sock, plans)


def _prepare(args: argparse.Namespace):
    """Every check that can refuse the command, ending with the bound port (rank 0 of a
    model resource; every rank runs the other checks, so bad input is exit 2 everywhere
    before any process group)."""
    check_args(args)
    from core.launch_env import launch_env

    env = launch_env()
    paths = recipe_paths(args)
    if len(paths) > 1:
        check_several_bases(args, env.world_size)
    if args.sampler == "vllm":
        check_engine_sampler(args, env.world_size)
    from recipe.loader import load_recipe

    recipes = [load_recipe(p, args.overrides) for p in paths]
    recipe = recipes[0]  # the first recipe's output_dir holds the default --storage
    from service.accounting import Prices
    from service.limits import Limits, with_settings
    from service.server import ServeOptions, bind, check_exposure
    from service.tenants import KeyFile

    prices = Prices()
    if args.prices is not None:
        try:
            prices = Prices.load(args.prices)
        except ValueError as e:
            raise ConfigError(str(e), key="--prices") from None
    opts = ServeOptions(
        host=args.host,
        port=args.port,
        api_key_file=args.api_key_file,
        storage=args.storage or os.path.join(recipe.output_dir, "service"),
        session_ttl_s=args.session_ttl,
        drain_s=args.drain,
        limits=with_settings(
            Limits(
                max_body_bytes=int(args.max_body_mb * (1 << 20)),
                max_queued_per_session=args.max_queued_per_session,
                max_queued_per_tenant=args.max_queued_per_tenant,
                piece_tokens=args.piece_tokens,
                token_rate=args.tenant_token_rate,
                token_burst=args.tenant_token_burst,
                storage_quota_bytes=int(args.storage_quota_gib * (1 << 30))
                if args.storage_quota_gib is not None
                else None,
            ),
            args.limit,
        ),
        prices=prices,
    )
    check_exposure(opts)  # bad input before the model is built
    keys = KeyFile(opts.api_key_file) if opts.api_key_file and env.rank == 0 else None
    if env.rank == 0:
        out_dir_arg(opts.storage, "--storage")
    from service.served_base import resolve_served_base

    served = [
        resolve_served_base(
            r,
            name=name,
            context=context,
            tokenizer_id=tokenizer_id,
            max_samples=opts.limits.max_samples,
            check_memory=False,  # the resource's plan below prices the memory
        )
        for r, (name, context, tokenizer_id) in zip(recipes, base_options(args), strict=True)
    ]
    seen: dict[str, str | None] = {}
    for r, s in zip(recipes, served, strict=True):
        if s.name in seen:
            raise ConfigError(
                f"{seen[s.name]} and {r.source} both serve {s.name!r}: clients pick a base by "
                "its name (give each --recipe its own --base-name)",
                key="--base-name",
            )
        seen[s.name] = r.source
    if len(recipes) == 1:
        plans = [plan_served_resource(recipe, served[0], args, env.world_size)]
    else:
        plans = plan_bases_together(recipes, served, args)
    for r in recipes:
        check_base_weights(r, env)
    # The port before the model: "in use" is one line now, not after a minute of loading.
    sock = bind(opts.host, opts.port) if env.rank == 0 else None
    return recipes, opts, keys, served, sock, plans


def check_several_bases(args: argparse.Namespace, world: int) -> None:
    """Several --recipe: one process (a model resource shards one base over its ranks, and
    one vLLM engine serves one base), or one line (exit 2) before anything is built."""
    n = len(recipe_paths(args))
    if world > 1:
        raise ConfigError(
            f"{n} bases: a model resource (torchrun, {world} processes) serves one base; run "
            "one tools.serve per base, or several bases without torchrun (one device)",
            key="--recipe",
        )
    if args.sampler == "vllm":
        raise ConfigError(
            f"{n} bases: --sampler vllm starts one engine over one base; serve several bases "
            "with --sampler titanscale, or one tools.serve per base",
            key="--sampler",
        )


def plan_bases_together(recipes: list, served: list, args: argparse.Namespace) -> list:
    """Several bases on this process's device, priced together (parallel.serve.plan_together:
    the residents add up, one operation runs at a time), or one line (exit 2) naming the
    bases and the numbers."""
    from parallel.serve import together_problem
    from service.titan_backend import resource_plans_together

    resources = [resource_of(args, r, 1) for r in recipes]
    plans, device_bytes = resource_plans_together(recipes, served, resources)
    why = together_problem([s.name for s in served], plans, device_bytes)
    if why is not None:
        raise ConfigError(why, key="--recipe")
    return plans


def check_base_weights(recipe, env) -> None:
    """The base's weights exist and are whole: `checkpoint.load_from` a verified checkpoint,
    `checkpoint.load_hf` the recipe's model (one line naming the key otherwise)."""
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
    if recipe.checkpoint.load_hf:  # the checks train.py runs (runtime/session.py)
        from runtime.build import recipe_model_spec
        from runtime.hf import hf_expected, verify_hf_folder

        verify_hf_folder(recipe.checkpoint.load_hf, hf_expected(recipe_model_spec(recipe)),
                         file=recipe.source, rank=env.rank, world=env.world_size)  # fmt: skip


def check_engine_sampler(args: argparse.Namespace, world: int) -> None:
    """`--sampler vllm`: one process, and the engine environment installed (the check
    rl.generator = "vllm" runs), or one line (exit 2) before the port is bound."""
    if world > 1:
        raise ConfigError(
            f"--sampler vllm serves from one process; this model resource has {world} "
            "(run tools.serve without torchrun, or use --sampler titanscale)",
            key="--sampler",
        )
    if args.generators == 0:
        raise ConfigError("--generators 0 samples nothing: no engine to start", key="--sampler")
    from rl.vllm_engine import require_engine

    require_engine(file=None, key="--sampler")


def add_resource_args(p: argparse.ArgumentParser) -> None:
    """The model resource's options (tools.serve, tools.plan --serve, tools.predict --serve)."""
    p.add_argument(
        "--generators",
        type=int,
        default=1,
        help="1: a generator shares the base (sampling on); 0: training only, no generator "
        "memory, sampling refused",
    )
    p.add_argument(
        "--generator-tokens",
        type=int,
        default=None,
        help="KV-cache positions the generator holds at once (rows x (prompt + max_tokens)); "
        "default: the most full-context rows (up to 64) that fit",
    )
    p.add_argument(
        "--adapters",
        type=int,
        default=None,
        help="resident adapters (training clients) the memory plan reserves room for "
        "(default 4; not a limit)",
    )


def check_resource_args(args: argparse.Namespace) -> None:
    if args.generators not in (0, 1):
        raise ConfigError(
            f"expected 0 (training only) or 1, got {args.generators} (operations run one at "
            "a time on a resource: a second generator would hold memory and never run)",
            key="--generators",
        )
    if args.generator_tokens is not None:
        if args.generators == 0:
            raise ConfigError(
                "a resource with --generators 0 has no generator to size", key="--generator-tokens"
            )
        positive_arg(args.generator_tokens, "--generator-tokens", bound=1 << 40)
    if args.adapters is not None:
        positive_arg(args.adapters, "--adapters", bound=1 << 20)


def resource_of(args: argparse.Namespace, recipe, devices: int):
    """The parallel.serve.Resource the options ask for."""
    from parallel.serve import DEFAULT_ADAPTERS, Resource

    return Resource(
        devices=devices,
        adapters=args.adapters or DEFAULT_ADAPTERS,
        generators=args.generators,
        generator_tokens=args.generator_tokens or 0,
        microbatch_tokens=recipe.training.microbatch_tokens,
    )


def plan_served_resource(recipe, served, args: argparse.Namespace, devices: int):
    """The resource's plan on this machine's devices, or one line (exit 2) saying what does
    not fit: the base (key model.flavor: more devices), one full-context datum (--context),
    the generator (--generator-tokens), or a base built whole before sharding."""
    from parallel.serve import DTYPE_BYTES
    from service.titan_backend import resource_plan

    plan = resource_plan(recipe, served, resource_of(args, recipe, devices))
    if plan.problems:
        key, why = plan.problems[0]
        raise ConfigError(why, file=recipe.source if "." in key else None, key=key)
    if devices > 1 and not recipe.checkpoint.load_from:
        from recipe.loader import effective_shape

        whole = effective_shape(recipe).total_params * DTYPE_BYTES[recipe.training.dtype]
        if whole > plan.device_bytes:
            raise ConfigError(
                f"a seeded or Hugging Face base is built whole on every rank before it is "
                f"sharded: {whole / 2**30:.1f} GiB on devices of {plan.device_bytes / 2**30:.1f} "
                "GiB; serve it from a DCP checkpoint (loaded shard by shard), e.g. "
                "tools.seed_checkpoint or a training run's step-N",
                file=recipe.source,
                key="checkpoint.load_from",
            )
    return plan


def _serve(args: argparse.Namespace, recipes, opts, keys, served, sock, plans) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from core.launch_env import launch_env
    from service.server import bound_host_memory

    bound_host_memory()  # before the model's tensors are allocated
    env = launch_env()
    world = env.world_size
    if env.rank == 0:
        # With several bases each plan's device is the device less the others' resident parts.
        for s, plan in zip(served, plans, strict=True):
            logging.getLogger("service").info("resource: %s: %s", s.name, describe_plan(plan))
        if len(plans) > 1:
            from parallel.serve import together_gib

            logging.getLogger("service").info(
                "resource: %d bases together: %.2f GiB per device planned (their resident "
                "parts and the largest transient part: one operation runs at a time)",
                len(plans),
                together_gib(plans),
            )
    if world == 1:
        from service.titan_backend import TitanLoraBackend

        backends = [
            TitanLoraBackend.from_recipe(r, s, plan=p)
            for r, s, p in zip(recipes, served, plans, strict=True)
        ]
        if args.sampler != "vllm":
            return _run_service(args, recipes, opts, keys, sock, backends, None)
        recipe, backend = recipes[0], backends[0]  # one base (check_several_bases)
        from service.vllm_sampler import start_engine

        engine = start_engine(backend, recipe, window_s=args.sampler_window_ms / 1000)
        logging.getLogger("service").info(
            "sampler: one vLLM engine over the served base, %d LoRA slots, KV cache of %d tokens",
            engine.engine.cfg.max_loras,
            engine.kv_tokens,
        )
        try:
            return _run_service(args, recipes, opts, keys, sock, backends, None)
        finally:
            engine.close()
            engine.engine.close()
    return _serve_resource(args, recipes[0], opts, keys, served[0], sock, plans[0])


def describe_plan(plan) -> str:
    m, r = plan.memory, plan.resource
    how = ""
    if r.devices > 1:
        how = (
            ", decoding with the base gathered once per request"
            if m.whole_base_decode
            else ", decoding with the base gathered layer by layer"
        )
    gen = (
        f"a generator of {m.generator_tokens:,} KV-cache tokens "
        f"({plan.concurrent_samples} full-context samples at once{how})"
        if r.generators
        else "no generator (--generators 0: training only)"
    )
    return (
        f"{r.devices} device(s), the base FSDP-sharded over {r.devices} rank(s); "
        f"microbatches of {m.microbatch_tokens:,} tokens; {gen}; planned "
        f"{plan.memory.required_gib_on(plan.kind):.2f} GiB per device of "
        f"{plan.device_bytes / 2**30:.1f} ({plan.kind})"
    )


def _run_service(args, recipes, opts, keys, sock, backends, dispatcher) -> int:
    """Rank 0 (or the only process): the HTTP service on `backends` (one per recipe, in
    order) until it stops."""
    from dataclasses import replace

    from service.admission import cost_model_from_recipe, default_budget_bytes
    from service.server import serve

    costs = [cost_model_from_recipe(r) for r in recipes]
    budget = (
        args.max_request_gib * (1 << 30)
        if args.max_request_gib is not None
        else default_budget_bytes()
    )
    resident = (
        args.max_resident_gib * (1 << 30)
        if args.max_resident_gib is not None
        else default_budget_bytes()
    )
    opts = replace(
        opts,
        limits=replace(opts.limits, max_request_bytes=budget, max_resident_bytes=resident),
    )
    failed = asyncio.run(
        serve(backends, opts, sock=sock, keys=keys, cost=costs, resource=dispatcher)
    )
    return 0 if failed is None else 1


def _serve_resource(args, recipe, opts, keys, served, sock, plan) -> int:
    """Every rank of a model resource: the process group, this rank's shard, then rank 0
    serves and the others follow (service/distributed.py)."""
    import sys

    import torch

    from runtime.platform import Platform
    from service.distributed import (
        Dispatcher,
        Group,
        ResourceBackend,
        ResourceBroken,
        follow,
        rank_info,
    )
    from service.titan_backend import TitanLoraBackend

    log = logging.getLogger("service")
    platform = Platform.detect()
    platform.apply()
    if not platform.is_cpu:
        from core.launch_env import launch_env

        torch.cuda.set_device(launch_env().local_rank)  # NCCL binds to it
    group = Group.start(
        backend=platform.backend, device_type=platform.device_type, timeout_s=args.op_timeout
    )
    backend = TitanLoraBackend.from_recipe(recipe, served, mesh=group.mesh, plan=plan)
    ranks = group.gather(rank_info(group, backend.model))
    if group.rank > 0:
        rc = follow(group, backend)
        if rc:  # the group is unusable: do not wait for it at exit
            sys.stdout.flush()
            os._exit(rc)
        group.close()
        return 0
    assert ranks is not None
    for r in ranks:
        log.info(r.line(group.world))
    dispatcher = Dispatcher(group, backend, ranks, op_timeout_s=args.op_timeout)
    try:
        rc = _run_service(
            args, [recipe], opts, keys, sock, [ResourceBackend(backend, dispatcher)], dispatcher
        )
    except ResourceBroken:  # during the warm-up, before serving
        rc = 1
    if dispatcher.broken is not None:
        print(f"error: {dispatcher.broken}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # a thread may be blocked in a collective of the lost group
    dispatcher.close()
    group.close()
    return rc


if __name__ == "__main__":
    run(main)
