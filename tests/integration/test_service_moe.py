"""The unmodified `tinker` SDK against `python -m tools.serve --recipe recipes/sft_moe_debug.toml`
(a one-layer qwen3 debug MoE, CPU) on a Hugging Face MoE base: a Qwen3-MoE of that shape built
with `transformers` (random weights, the independent reference) and saved the way
`huggingface-cli download` leaves it, in a hub cache (`models--Qwen--Qwen3-30B-A3B/snapshots/
<rev>/`), served through `checkpoint.load_hf`. The capabilities list it under the hub name;
its prompt logprobs equal transformers' on the folder; a LoRA training client's
cross-entropy loss falls over 10 forward_backward + optim_step steps, the RL loss
(importance_sampling) runs on its own samples with the trainer's logprobs equal to the
sampler's, and sampling from the trained adapter works."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.helpers.service_server import KEY, importance_sampling_datums, start_server  # noqa: E402

NAME = "Qwen/Qwen3-30B-A3B"
REV = "0123456789abcdef0123456789abcdef01234567"


def _hub_folder(hub):
    """transformers' Qwen3MoeForCausalLM of sft_moe_debug's shape (torchtitan's qwen3
    debugmodel_moe, one layer) in a hub-cache layout."""
    import torch
    import transformers

    from tests.helpers.hf_reference import QWEN3_MOE_DEBUG, hub_snapshot

    snap = hub_snapshot(hub, NAME, REV)
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**{**QWEN3_MOE_DEBUG, "num_hidden_layers": 1})
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(snap)
    return snap


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc_moe")
    snap = _hub_folder(tmp / "hub")
    srv = start_server(tmp / "svc", recipe="recipes/sft_moe_debug.toml",
                       sets=["training.seq_len=64", f"checkpoint.load_hf={snap}"])  # fmt: skip
    yield srv, snap
    assert srv.stop() == 0, srv.log_text()[-3000:]


def test_moe_base_sft_rl_and_sampling(server):
    from tests.helpers.hf_reference import assert_served_logprobs_are_the_folders

    server, snap = server
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [NAME]  # the hub name
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    # The served weights are the folder's: prompt logprobs equal transformers' on it.
    ids = [7, 300, 41, 1200, 55, 9, 801, 23]
    base = sc.create_sampling_client(base_model=NAME).result()
    assert_served_logprobs_are_the_folders(base, snap, ids)
    tc = sc.create_lora_training_client(base_model=NAME, rank=8, seed=0).result()
    seq = [7, 300, 41, 1200, 55, 9, 801, 23, 64, 1999, 5, 77]
    n = len(seq) - 1
    d = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * 3 + [1.0] * (n - 3)},
    )
    losses = []
    for _ in range(10):
        fb = tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0] / 2, losses

    smp = tc.save_weights_and_get_sampling_client().result()
    prompt = seq[:4]
    res = smp.sample(
        types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=5, seed=1)
    ).result()
    assert len(res.sequences) == 4 and all(len(s.tokens) == 5 for s in res.sequences)
    data = importance_sampling_datums(prompt, res.sequences, [1.0, -1.0, 0.5, -0.5])
    out = tc.forward_backward(data, "importance_sampling").result()
    # same weights: the trainer's logprobs of the sampled tokens are the sampler's
    np.testing.assert_allclose(
        out.loss_fn_outputs[0]["logprobs"].data[len(prompt) - 1 :],
        res.sequences[0].logprobs,
        atol=1e-4,
    )
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sc.close("success").result()
