"""The one `--set section.key=value` command-line argument, shared by every tool.

Every CLI that takes a recipe takes the same overrides, parsed later by
`recipe.loader.load_recipe(path, overrides)` and typed by the recipe schema. No torch import.
"""

from __future__ import annotations

import argparse


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
