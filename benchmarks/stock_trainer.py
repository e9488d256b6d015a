"""torchtitan's stock Trainer on a titanscale recipe: the baseline for the overhead benchmark.

Same Trainer.Config as train.py builds (same model, data, optimizer, CPU layer), except the
stock MetricsProcessor and the stock Trainer class: what is left is titanscale's own cost.

    python benchmarks/stock_trainer.py --recipe R [--set k=v ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from tools.cli import add_override_arg, add_recipe_arg

    p = argparse.ArgumentParser()
    add_recipe_arg(p)
    add_override_arg(p)
    args = p.parse_args()
    from runtime.platform import bridge_torch

    bridge_torch()  # torch-version bridges before any torchtitan import, as train.py gets them
    import torch
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.tools.logging import init_logger
    from torchtitan.trainer import Trainer

    from runtime import session

    init_logger()
    job = session.prepare(args.recipe, args.overrides)
    job.platform.apply()
    ours = job.config.metrics
    job.config.metrics = MetricsProcessor.Config(
        log_freq=ours.log_freq,
        enable_tensorboard=ours.enable_tensorboard,
        disable_color_printing=True,
    )
    trainer = Trainer(job.config)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
