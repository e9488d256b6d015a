"""Train a titanscale recipe with torchtitan.

    python train.py [--recipe recipes/debug.toml] [--set section.key=value ...]
    python -m tools.torchrun --nproc_per_node=N train.py --recipe R   (torchrun, quieter)

Bad input (recipe, overrides, environment) ends with one line and exit code 2, before any
process group starts.
"""

from __future__ import annotations

import argparse

from core.errors import exit_on_config_error, held_stderr
from tools.cli import add_override_arg, add_recipe_arg, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_recipe_arg(p)
    add_override_arg(p)
    return p.parse_args(argv)


@exit_on_config_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Syntax, keys and types first: pure Python, so a typo in a recipe or a --set costs a
    # tenth of a second, not the several seconds of importing torch and torchtitan.
    from core.launch_env import launch_env
    from recipe.loader import blamed, load_recipe

    load_recipe(args.recipe, args.overrides)
    launch_env()  # RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, ... (one line naming the variable)

    # Libraries warn on stderr while they import (torch, torchao); for bad input found below
    # the user's stderr must hold only our one line, so that output waits until prepare passes.
    with held_stderr():
        from torchtitan.tools.logging import init_logger

        from posttrain import jobs
        from rl import loop
        from runtime import session

        init_logger()
        job = session.prepare(args.recipe, args.overrides)
        with blamed(job.recipe):  # post-training checks that need the launch
            if job.recipe.rl.enabled:
                loop.check(job)
            else:
                jobs.check(job)
    if job.recipe.rl.enabled:  # [rl]: rollouts replace the data loader (rl/loop.py)
        from rl.hooks import hook_errors_as_config_errors

        # A user hook that fails the run (rl.on_error = "fail", tasks(), an evaluation
        # reward) ends in its one line and exit 2, not in the loop's traceback.
        with hook_errors_as_config_errors(job.recipe.source):
            loop.run(job)
    else:
        jobs.run(job)


if __name__ == "__main__":
    run(main)
