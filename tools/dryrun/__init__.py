"""The dry run: the real training step of chosen ranks at the recipe's full world size, on
fake tensors and torch's fake process group, measured against the memory and performance
models (docs/dryrun.md). `python -m tools.dryrun` (tools/dryrun/cli.py).

Modules, each one job, in import order (a module imports only those above it):
job (the checked job), fake_world (torch's fake process group and the patches of torch
internals), trackers (memory and collectives), rank (a rank's world, Trainer config and
report entry), posttrain (an RL update or an [[adapters]] round on the step layer), step
(one rank's training step: the Trainer's, or posttrain's), planned (the models' figures for
a rank), report (side by side, rendered), runner (one process per rank; tools.launch's
check), cli (the command line).
"""
