"""Kernel backends: attention and linear implementations chosen per recipe and device.

Entry points for the runtime: `check_kernels` (recipe validation against the device) and
`apply_kernels` (attention + linear conversion on a torchtitan model config). See
docs/kernels.md.
"""
