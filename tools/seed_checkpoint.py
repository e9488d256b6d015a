"""Write a seed checkpoint (initial weights, unsharded) for a recipe.

    python -m tools.seed_checkpoint --recipe R --out DIR [--set k=v ...]

Then train any layout from identical weights with `--set checkpoint.load_from=DIR/step-0`.
"""

from __future__ import annotations

import argparse

from core.errors import exit_on_config_error
from tools.cli import add_override_arg, add_recipe_arg, run


@exit_on_config_error
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_recipe_arg(p)
    p.add_argument("--out", required=True, help="folder to write (step-0 is created inside)")
    add_override_arg(p)
    args = p.parse_args(argv)
    from torchtitan.tools.logging import init_logger

    from runtime import session

    init_logger()
    # The seed is model weights only: parallel degrees of the recipe do not apply.
    degrees = ["parallel.world_size=0", "parallel.dp_replicate=1", "parallel.dp_shard=-1"]
    degrees += ["parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.ep=1"]
    degrees += ["parallel.auto=false"]
    # Nor do the recipe's checkpoints: a seed loads nothing (fresh initial weights), so the
    # checks of what a run would load (runtime.session.check_checkpoint_fit) do not apply.
    degrees += ["checkpoint.interval=0", "checkpoint.load_from=", "checkpoint.load_hf="]
    degrees += ["checkpoint.export_hf=false", "checkpoint.export_hf_every_checkpoint=false"]
    job = session.prepare(args.recipe, [*args.overrides, *degrees])
    path = session.create_seed_checkpoint(job, args.out)
    print(path)


if __name__ == "__main__":
    run(main)
