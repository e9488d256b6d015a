"""Shared bits of the planning CLIs: --recipe/--cluster/--nodes/--set, resolved the same way."""

from __future__ import annotations

import argparse
from pathlib import Path

from core.errors import ConfigError
from recipe.cli import add_override_arg

ROOT = Path(__file__).resolve().parent.parent


def add_recipe_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="recipe TOML (or a name in recipes/)")
    p.add_argument("--cluster", required=True, help="cluster profile TOML (or a name in clusters/)")
    p.add_argument("--nodes", type=int, default=None, help="nodes in the job (default: the "
                   "recipe's world size / GPUs per node, else the profile's node count)")  # fmt: skip
    add_override_arg(p, "override a recipe key (repeatable), the same keys as train.py")


def resolve_recipe_path(name: str) -> str:
    p = Path(name)
    if p.exists() or p.suffix == ".toml" or "/" in name:
        return name
    cand = ROOT / "recipes" / f"{name}.toml"
    return str(cand) if cand.exists() else name


def load(args: argparse.Namespace):
    """(recipe, cluster sized for the job) from the common arguments."""
    from parallel.cluster import load_cluster
    from parallel.planner import world_for
    from recipe.loader import load_recipe

    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"expected a positive node count, got {args.nodes}", key="--nodes")
    recipe = load_recipe(resolve_recipe_path(args.recipe), args.overrides)
    cluster = load_cluster(args.cluster)
    cluster, _ = world_for(recipe, cluster, args.nodes)
    return recipe, cluster
