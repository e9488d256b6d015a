"""One adapter format (PEFT) from an [[adapters]] job through the service and back to peft.

An [[adapters]] job trains adapter "b" (3 steps) and exports it (PEFT); the folder is
imported into a tenant's storage (`CheckpointStore.import_peft`); the unmodified `tinker` SDK
starts a training client from it (`create_training_client_from_state`), and the service's
saved weights load with `peft.PeftModel.from_pretrained` on transformers' Llama holding the
service's base weights: its log-probabilities equal the service's own forward within 1e-4
(float32). The job's alpha (32) differs from the service's, so the import also proves the
alpha rescaling (same alpha/r * B A).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.helpers.adapter_recipe import write_adapter_recipe
from tests.helpers.service_server import BASE_MODEL, KEY, TINY, start_server

tinker = pytest.importorskip("tinker")
peft = pytest.importorskip("peft")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow  # a 3-step adapter job, a server: ~1 min on 2 shared cores

SEQ = [7, 300, 41, 1200, 55, 9, 801, 23, 64, 1999, 5, 77]
TOL = 1e-4  # float32: the measured difference is ~1e-6 (reduction order)


@pytest.fixture(scope="module")
def job_export(tmp_path_factory):
    """The PEFT folder of adapter "b" trained by an [[adapters]] job (3 steps)."""
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from posttrain.adapters import AdapterJob
    from runtime import session

    d = tmp_path_factory.mktemp("job")
    job = session.prepare(write_adapter_recipe(d), [f"job.output_dir={d}/out"])
    r = copy.deepcopy(job.recipe)
    r.adapters = [a for a in r.adapters if a.name == "b"]
    r.finetune.export_merged = False
    cfg = job.config.model_spec.model
    aj = AdapterJob(r, cfg, tokenizer_path=job.tokenizer_path, schedule="turns",
                    state_dict_adapter=Llama3StateDictAdapter(cfg, None))  # fmt: skip
    summary = aj.train(export=True)
    return summary["adapters"]["b"]["export"], r.lora.alpha


def _hf_base():
    """transformers' Llama holding the service's base (the same recipe, seed and build)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.lora import base_state
    from recipe.loader import load_recipe
    from runtime.build import recipe_model_spec
    from runtime.hf import hf_config
    from service.titan_backend import build_lora_model

    recipe = load_recipe("recipes/debug.toml", TINY)
    model, _ = build_lora_model(recipe, torch.device("cpu"))
    spec = recipe_model_spec(recipe)
    sda = spec.state_dict_adapter(spec.model, None)
    hf_cfg = LlamaConfig(**hf_config(spec.model, "llama3", "float32"))
    hf_cfg.attn_implementation = "eager"
    hf = LlamaForCausalLM(hf_cfg).float().eval()
    missing, unexpected = hf.load_state_dict(sda.to_hf(base_state(model)), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf, recipe.lora.alpha


def test_job_adapter_serves_and_service_weights_load_in_peft(job_export, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from service.storage import CheckpointRef, Storage
    from service.tenants import fingerprint

    export, job_alpha = job_export
    srv = start_server(tmp_path / "svc")
    try:
        ref = CheckpointRef("from-job", "weights", "b")
        path = (
            Storage(srv.storage)
            .tenant(fingerprint(KEY))
            .import_peft(ref, export, base_model=BASE_MODEL)
        )
        sc = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
        tc = sc.create_training_client_from_state(path).result()
        saved = tc.save_state("round-trip").result().path
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(SEQ[:-1]),
            loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)},
        )
        out = tc.forward([datum], "cross_entropy").result()
        served = torch.tensor(np.asarray(out.loss_fn_outputs[0]["logprobs"].data))
        folder = srv.tenant_dir() / saved.split("/")[2] / "weights" / "round-trip"

        # The job's tensors came through the service unchanged (B rescaled by the alphas).
        hf, svc_alpha = _hf_base()
        job_t, svc_t = (
            load_file(f"{export}/adapter_model.safetensors"),
            load_file(str(folder / "adapter_model.safetensors")),
        )
        assert job_t.keys() == svc_t.keys() and job_t
        for k, v in job_t.items():
            want = v * (job_alpha / svc_alpha) if ".lora_B." in k else v
            torch.testing.assert_close(svc_t[k], want, rtol=1e-6, atol=0), k

        x = torch.tensor([SEQ[:-1]])
        with torch.no_grad():  # control: the adapter changes the log-probabilities
            base_lp = torch.log_softmax(hf(x).logits.float(), -1)[0]
        pm = PeftModel.from_pretrained(hf, str(folder)).eval()
        with torch.no_grad():
            lp = torch.log_softmax(pm(x).logits.float(), -1)[0]
        tgt = torch.tensor(SEQ[1:])
        got = lp[torch.arange(len(tgt)), tgt].double()
        base = base_lp[torch.arange(len(tgt)), tgt].double()
        assert (base - served).abs().max().item() > 1e-3
        assert (got - served).abs().max().item() < TOL
        sc.close("success").result()
    finally:
        assert srv.stop() == 0, srv.log_text()[-3000:]
