"""Per-GPU, per-precision dense peak FLOP/s: the one table MFU is computed against.

Vendor datasheet figures, dense (not 2:4 sparse). A device we cannot name has no peak, and
MFU is then reported as "n/a" rather than against a guessed GPU (torchtitan falls back to
the A100's 312 TFLOP/s, which silently inflates MFU on unknown parts).
"""

from __future__ import annotations

# TFLOP/s, dense.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0},
    "GB200": {"bf16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0},
    "A100": {"bf16": 312.0},
}


def gpu_kind(device_name: str) -> str | None:
    """Map a torch device name ("NVIDIA H100 80GB HBM3") or a kind ("h100") to a table key."""
    name = device_name.upper()
    # GB200 before B200: "GB200" contains "B200".
    for kind in ("GB200", "B200", "H200", "H100", "A100"):
        if kind in name:
            return kind
    return None


def peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s for this device and precision, or None when unknown (CPU)."""
    kind = gpu_kind(device_name)
    if kind is None:
        return None
    table = PEAK_TFLOPS[kind]
    tf = table.get(precision) or (table.get("fp8") if precision.startswith("fp8") else None)
    return tf * 1e12 if tf else None
