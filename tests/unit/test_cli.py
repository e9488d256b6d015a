"""One CLI module: every tool takes --recipe / --cluster by name or path through tools.cli,
ends in its one exit path, and a name means the same file as its path."""

from __future__ import annotations

import ast

import pytest

from core.errors import ConfigError
from parallel.cluster import load_cluster
from recipe.loader import load_recipe
from tests.helpers.runs import ROOT

ENTRY_POINTS = sorted(
    p for p in (ROOT / "tools").glob("*.py") if p.name not in ("__init__.py", "cli.py")
)


def _calls(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def test_recipe_and_cluster_arguments_come_from_tools_cli():
    """No tool defines --recipe, --cluster or --set itself (they were defined eight ways)."""
    own = []
    for path in [*ENTRY_POINTS, ROOT / "train.py"]:
        for call in _calls(path):
            if isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
                flags = [a.value for a in call.args if isinstance(a, ast.Constant)]
                if {"--recipe", "--cluster", "--set"} & set(flags):
                    own.append(f"{path.name}:{call.lineno} {flags}")
    assert not own, own


def test_every_tool_with_a_main_ends_in_run_main():
    missing = []
    for path in ENTRY_POINTS:
        src = path.read_text()
        if "def main(" not in src or path.name == "gpu_check.py":  # gpu_check: GPU helper's
            continue
        if 'if __name__ == "__main__":' in src and "run(main)" not in src:
            missing.append(path.name)
    assert not missing, missing


def test_names_and_paths_load_the_same_files():
    by_name = load_recipe("llama3_8b")
    by_path = load_recipe(str(ROOT / "recipes" / "llama3_8b.toml"))
    assert by_name == by_path and by_name.source.endswith("recipes/llama3_8b.toml")
    assert load_recipe().source.endswith("recipes/debug.toml")
    assert load_cluster("hgx_h100_ib") == load_cluster(ROOT / "clusters" / "hgx_h100_ib.toml")
    with pytest.raises(ConfigError, match="did you mean 'hgx_h100_ib'"):
        load_cluster("hgx_h100_lb")
    with pytest.raises(ConfigError, match="not found"):
        load_recipe("no_such_recipe")


def test_launch_takes_a_recipe_by_name(capsys):
    """tools.launch resolved only paths before; a name now renders the same job script."""
    from tools.launch import main

    common = ["--cluster", "hgx_b200_ib", "--nodes", "8", "--dry-run"]
    main(["--recipe", "llama3_70b_b200", *common])
    by_name = capsys.readouterr().out
    main(["--recipe", str(ROOT / "recipes" / "llama3_70b_b200.toml"), *common])
    by_path = capsys.readouterr().out
    assert by_name == by_path and "#SBATCH" in by_name
