"""Rendering a Slurm job script as tools.launch does, with fixed paths (no Slurm needed)."""

from __future__ import annotations

from launch.sbatch import LaunchOptions, check_launch, render_sbatch
from recipe.loader import load_recipe
from tests.helpers.runs import ROOT

B200 = ROOT / "recipes" / "llama3_70b_b200.toml"


def render_job(recipe_path, cluster, nodes, overrides=(), **kw):
    """(job script text, warnings) for `nodes` hosts of `cluster`."""
    recipe = load_recipe(recipe_path, list(overrides))
    opts = LaunchOptions(
        nodes=nodes,
        output_dir="/scratch/run",
        recipe_path=str(recipe_path),
        cluster_path=str(cluster.source),
        overrides=tuple(overrides),
        python="/opt/venv/bin/python",
        workdir="/opt/titanscale",
        **kw,
    )
    layout, warnings = check_launch(recipe, cluster, opts)
    return render_sbatch(recipe, cluster, layout, opts), warnings
