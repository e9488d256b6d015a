"""Training runtime. Importing the package installs the torch-version bridges (runtime.platform,
items 6-9) before any runtime module imports torchtitan."""

from runtime.platform import bridge_torch

bridge_torch()
