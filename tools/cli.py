"""The one command-line module: shared arguments, one resolver, one exit path.

Every tool (and train.py) takes a recipe and a cluster profile by name (`llama3_8b`,
`hgx_h100_ib`: a file in recipes/ or clusters/) or by path, resolved by the loaders
(`recipe.loader.resolve_recipe_path`, `parallel.cluster.resolve_cluster_path`, both
`core.typed_toml.resolve_named`); the same `--set section.key=value` overrides, typed by the
recipe schema; and one exit path: `main` is decorated with `exit_on_config_error` (bad input:
one line, exit 2) and the module ends with `run(main)` (main's int return is the exit code).
No torch import here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from core.errors import ConfigError, exit_on_config_error

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "ROOT",
    "add_cluster_arg",
    "add_override_arg",
    "add_recipe_arg",
    "add_recipe_cluster_args",
    "add_stack_arg",
    "exit_on_config_error",
    "load",
    "load_stack_arg",
    "run",
]


def add_override_arg(
    p: argparse.ArgumentParser,
    help: str = "override a recipe key (repeatable), typed by the recipe schema",
) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=help,
    )


def add_recipe_arg(
    p: argparse.ArgumentParser,
    *,
    required: bool = False,
    default: str | None = None,
    help: str = "",
) -> None:
    """--recipe: a TOML path or a name in recipes/ (default: the debug recipe)."""
    what = help or "recipe TOML or a name in recipes/"
    if not required:
        what += f" (default: {default or 'recipes/debug.toml'})"
    p.add_argument("--recipe", required=required, default=default, help=what)


def add_cluster_arg(p: argparse.ArgumentParser, *, required: bool = False, help: str = "") -> None:
    """--cluster: a profile TOML path or a name in clusters/."""
    p.add_argument(
        "--cluster",
        required=required,
        default=None,
        help=help or "cluster profile TOML or a name in clusters/",
    )


def add_recipe_cluster_args(p: argparse.ArgumentParser) -> None:
    """--recipe, --cluster, --nodes and --set, as the planning tools take them."""
    add_recipe_arg(p, required=True)
    add_cluster_arg(p, required=True)
    p.add_argument("--nodes", type=int, default=None, help="nodes in the job (default: the "
                   "recipe's world size / GPUs per node, else the profile's node count)")  # fmt: skip
    add_override_arg(p, "override a recipe key (repeatable), the same keys as train.py")


def add_stack_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stack",
        default="torchtitan",
        help="software-stack profile in stacks/ (torchtitan: what recipes run; megatron_te: "
        "Megatron-Core + Transformer Engine, for published NeMo / Megatron-Bridge runs)",
    )


def load_stack_arg(args: argparse.Namespace) -> str:
    """The --stack name, checked (a ConfigError naming the known profiles) before any work."""
    from parallel.stacks import load_stack

    load_stack(args.stack)
    return args.stack


def load(args: argparse.Namespace):
    """(recipe, cluster sized for the job) from the planning tools' arguments."""
    from parallel.cluster import load_cluster
    from parallel.planner import world_for
    from recipe.loader import load_recipe

    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"expected a positive node count, got {args.nodes}", key="--nodes")
    recipe = load_recipe(args.recipe, args.overrides)
    cluster = load_cluster(args.cluster)
    cluster, _ = world_for(recipe, cluster, args.nodes)
    return recipe, cluster


def run(main: Callable[..., Any]) -> NoReturn:
    """`if __name__ == "__main__": run(main)`: exit with main's return code (an int; anything
    else is success), bad input as one line and exit 2."""
    rc = exit_on_config_error(main)()
    raise SystemExit(rc if isinstance(rc, int) else 0)
