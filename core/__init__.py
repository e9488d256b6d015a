"""The bottom layer: facts every other package shares; it imports nothing of ours.

`errors` (ConfigError, exit 2), `hardware` (GPU datasheet numbers and peaks),
`linear_backends` (the linear backends a recipe may choose and what they need), `axes` (mesh
axes, rank order, Layout), `models` (model shapes from torchtitan's registry), `typed_toml`
(the generic typed-TOML -> dataclass engine behind recipes, cluster profiles and claims
files), `hostlist` (Slurm's hostlist syntax, used by profiles and by the launcher).
"""
