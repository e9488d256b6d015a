"""The RL weight push cast to the built-in generator's tensors as it is gathered
(rl.loop.push_like): it loads the same weights as a float32 push does, stages no float32
copy of the bfloat16 parameters, and keeps float32 buffers (an MoE expert bias) float32."""

from __future__ import annotations

import torch

from rl.generator import Generator
from rl.loop import push_like
from rl.policy import full_state_dict
from tests.helpers.tiny_llama import tiny_qwen3_moe


def test_push_cast_like_the_generator_loads_the_same_weights():
    model = tiny_qwen3_moe(1)
    with torch.no_grad():  # a trained load-balancing bias: not representable in bfloat16
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias_E"):
                buf.copy_(torch.linspace(-1, 1, buf.numel()) / 3)
    gen = Generator.from_model(model, dtype=torch.bfloat16)
    ref = Generator.from_model(model, dtype=torch.bfloat16)
    assert push_like(object()) is None
    sd = full_state_dict(model, like=push_like(gen))
    params = {n for n, _ in gen.model.named_parameters()}
    assert params and all(sd[n].dtype == torch.bfloat16 for n in params if n in sd)
    biases = [k for k in sd if k.endswith("expert_bias_E")]
    assert biases and all(sd[k].dtype == torch.float32 for k in biases)
    gen.update_weights(sd, 1)
    ref.update_weights(full_state_dict(model), 1)  # float32, cast by load_state_dict
    got, want = gen.model.state_dict(), ref.model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
