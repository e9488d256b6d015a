"""The service's Hugging Face base (`tools.serve` with `checkpoint.load_hf`): for a small
Llama 3 and a small Qwen3 built with `transformers` (random weights, save_pretrained, the
independent reference), the backend's model gives transformers' logits (float32, 1e-4),
and its KV-cache sampler the same next-token logprobs. In process, no server: the HTTP path
is test_cookbook.py's."""

from __future__ import annotations

import pytest
import torch

from tests.integration._hf_interop_worker import hf_model

pytestmark = pytest.mark.slow  # ~1 min on 2 loaded cores (transformers + torchtitan imports)
TOL = 1e-4


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_hf_base_loads_into_the_served_model(family, tmp_path):
    from recipe.loader import load_recipe
    from rl.generator import Generator
    from rl.policy import forward_logits
    from service.served_base import resolve_served_base
    from service.titan_backend import build_lora_model

    torch.manual_seed(0)
    hf = hf_model(family).eval()
    hf.save_pretrained(tmp_path / "hf")
    r = load_recipe(
        "recipes/debug.toml",
        [f"model.family={family}", f"checkpoint.load_hf={tmp_path / 'hf'}", "training.seq_len=64"],
    )
    served = resolve_served_base(r, name="acme/tiny", device_bytes=1 << 40)
    model, info = build_lora_model(r, torch.device("cpu"), served)
    assert (info.name, info.max_context) == ("acme/tiny", 64)
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits.float()
        ours = forward_logits(model, tokens).float()
    assert (ours - ref).abs().max().item() < TOL
    lp, _, _ = Generator.from_model(model).prompt_scores(tokens[0].tolist())
    want = torch.log_softmax(ref[0, :-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
    assert abs(torch.tensor(lp) - want).max().item() < TOL
