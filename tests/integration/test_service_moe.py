"""The unmodified `tinker` SDK against `python -m tools.serve --recipe recipes/sft_moe_debug.toml`
(a one-layer qwen3 debug MoE, CPU) on a Hugging Face MoE base: a Qwen3-MoE of that shape built
with `transformers` (random weights, the independent reference) and saved the way
`huggingface-cli download` leaves it, in a hub cache (`models--Qwen--Qwen3-30B-A3B/snapshots/
<rev>/`), served through `checkpoint.load_hf`. The capabilities list it under the hub name;
its prompt logprobs equal transformers' on the folder; a LoRA training client's
cross-entropy loss falls over 10 forward_backward + optim_step steps, the RL loss
(importance_sampling) runs on its own samples with the trainer's logprobs equal to the
sampler's, and sampling from the trained adapter works.

The same server serves a second base beside it (`tools.serve --recipe A --recipe B`: several
bases in one process): recipes/sft_debug.toml's dense debug Llama (2 layers, seeded), named
`titanscale/sft_debug`. The capabilities list both; a training client on the dense base
trains (loss falls) and samples while the MoE one does; a checkpoint of one base is refused
(4xx naming both bases) when loaded onto the other, and the client's next request runs; an
unknown base is a 4xx naming the served ones."""

from __future__ import annotations

import warnings

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


DENSE = "titanscale/sft_debug"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers.service_server import ROOT

    tmp = tmp_path_factory.mktemp("svc_moe")
    snap = _hub_folder(tmp / "hub")
    # One recipe per base: --set applies to every --recipe, so each base's own keys live in
    # a recipe of its own that inherits the shipped one (`base = ...`).
    moe = tmp / "moe.toml"
    moe.write_text(f'base = "{ROOT}/recipes/sft_moe_debug.toml"\n'
                   f'[checkpoint]\nload_hf = "{snap}"\n')  # fmt: skip
    dense = tmp / "dense.toml"
    dense.write_text(f'base = "{ROOT}/recipes/sft_debug.toml"\n[model]\nlayers = 2\n'
                     '[checkpoint]\nload_from = ""\n')  # fmt: skip
    srv = start_server(tmp / "svc", "--recipe", str(dense), recipe=str(moe),
                       sets=["training.seq_len=64"])  # fmt: skip
    yield srv, snap
    assert srv.stop() == 0, srv.log_text()[-3000:]


def test_moe_base_sft_rl_and_sampling(server):
    from tests.helpers.hf_reference import assert_served_logprobs_are_the_folders

    server, snap = server
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [NAME, DENSE]  # the hub name first
    assert [m.max_context_length for m in caps.supported_models] == [64, 64]
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


def test_a_second_base_trains_samples_and_keeps_its_checkpoints(server):
    server, _ = server
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    with pytest.raises(tinker.APIStatusError) as e:  # unknown base: 400 naming the served
        sc.create_lora_training_client(base_model="org/nope", rank=8).result()
    assert e.value.status_code == 400 and NAME in str(e.value) and DENSE in str(e.value)

    moe = sc.create_lora_training_client(base_model=NAME, rank=8, seed=0).result()
    dense = sc.create_lora_training_client(base_model=DENSE, rank=8, seed=0).result()
    assert dense.get_info().model_data.model_name == DENSE
    seq = [7, 300, 41, 1200, 55, 9, 801, 23, 64, 1999, 5, 77]
    d = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    losses: dict[str, list[float]] = {NAME: [], DENSE: []}
    for _ in range(8):  # the two bases' steps interleave on the one worker
        for name, tc in ((NAME, moe), (DENSE, dense)):
            fb = tc.forward_backward([d], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses[name].append(fb.result().metrics["loss:sum"])
    for name, ls in losses.items():
        assert ls[-1] < ls[0] / 2, (name, ls)
    assert losses[NAME][0] != losses[DENSE][0]  # two different models answered

    smp = dense.save_weights_and_get_sampling_client().result()
    res = smp.sample(
        types.ModelInput.from_ints(seq[:4]), 2, types.SamplingParams(max_tokens=5, seed=1)
    ).result()
    assert len(res.sequences) == 2 and all(len(s.tokens) == 5 for s in res.sequences)
    # sampled on the dense base with its adapter: the dense trainer's logprobs are the sampler's
    data = importance_sampling_datums(seq[:4], res.sequences, [1.0, -1.0])
    out = dense.forward(data, "importance_sampling").result()
    for o, s in zip(out.loss_fn_outputs, res.sequences, strict=True):
        np.testing.assert_allclose(o["logprobs"].data[3:], s.logprobs, atol=1e-4)

    # A checkpoint remembers its base: the MoE adapter's state refused on the dense base
    # (same rank, so only the base tells them apart), and the client's next request runs.
    path = moe.save_state("moe-ckpt").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    assert rest.get_weights_info_by_tinker_path(path).result().base_model == NAME
    with (
        warnings.catch_warnings(),  # the SDK deprecates TrainingClient.load_state (FutureWarning)
        pytest.raises((tinker.APIStatusError, tinker.RequestFailedError)) as e,
    ):
        warnings.simplefilter("ignore", FutureWarning)
        dense.load_state(path).result()
    assert "belongs to base model" in str(e.value) and NAME in str(e.value), str(e.value)
    assert dense.forward([d], "cross_entropy").result().metrics["loss:sum"] > 0
    with pytest.raises(tinker.APIStatusError) as e:  # nor as a new client of the other base
        sc.create_training_client_from_state(path, base_model=DENSE).result()
    assert e.value.status_code == 400 and "belongs to base model" in str(e.value)
    back = sc.create_training_client_from_state(path).result()  # its own base loads it
    assert back.get_info().model_data.model_name == NAME
    sc.close("success").result()
