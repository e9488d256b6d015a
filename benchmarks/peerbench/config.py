"""The facts both sides of every pair share: the pair names, the hyperparameters both sides
get (LoRA, AdamW), the tolerance of the step-0 agreement, the service's benchmark key and the
skyrl-tx install command. Stdlib only: the skyrl-tx venv imports it too."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "benchmarks" / "peers.py"  # the documented command; workers run through it too
PAIRS = (
    "sft_lora_packed",
    "sft_lora_unpacked",
    "full_ft",
    "generate",
    "grpo",
    "dpo",
    "service",
)
SKYRL_INSTALL = (
    "python3.11 -m venv .venv-skyrl && .venv-skyrl/bin/pip install 'skyrl-tx[tinker]==0.3.0' "
    "'jax[cpu]>=0.8,<1.0' 'flax>=0.12.2' 'optax>=0.2.5' 'tinker==0.16.1'"
)
API_KEY = "tml-peers-benchmark-key"  # service.tenants: at least 16 characters after tml-
TOL = 1e-4  # step-0 loss agreement the issue asks for (SFT and DPO)

# Shared hyperparameters (both sides of a pair get these).
LORA = {"rank": 16, "alpha": 32.0}
# titanscale's LoRA targets (torchtitan names) and the same layers in transformers' Llama.
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}  # torchtitan's AdamW defaults
