"""The service's vLLM sampling seam (service/vllm_sampler.py): two tenants' sampler weights
(PEFT folders, as save_weights_for_sampler writes them) sampled in one engine batch, each
getting exactly the greedy tokens its adapter gives alone; unknown weights 404, oversize 413.
Uses the session engine (tests/conftest.py `vllm_engine`)."""

from __future__ import annotations

import threading

import pytest

from posttrain.lora import export_peft
from rl.generator import SamplingParams
from service.errors import ServiceError
from service.vllm_sampler import EngineSampler
from tests.helpers.vllm_models import ALPHA, RANK, random_adapter

pytestmark = [pytest.mark.vllm]

PROMPTS = [[1, 5, 7, 9], [1, 100, 200, 300, 400]]
GREEDY = SamplingParams(max_tokens=6, top_p=1e-9)


def test_two_tenants_share_an_engine_batch_and_get_their_own_tokens(vllm_engine, tmp_path):
    engine, model, view = vllm_engine
    sampler = EngineSampler(engine, view, window_s=0.5)
    try:
        for tenant, seed in (("tenant-a", 21), ("tenant-b", 22)):
            folder = tmp_path / tenant
            export_peft(str(folder), model_config=view.model_config,
                        adapter=random_adapter(model, seed), state_dict_adapter=view.state_dict_adapter,
                        rank=RANK, alpha=ALPHA)  # fmt: skip
            sampler.add_adapter(tenant, str(folder))
        # alone: one tenant's requests per engine call
        alone = {t: [sampler.sample(t, p, GREEDY)[0]["tokens"] for p in PROMPTS]
                 for t in ("tenant-a", "tenant-b")}  # fmt: skip
        assert alone["tenant-a"] != alone["tenant-b"]
        calls_before = len(sampler.batch_sizes)
        got: dict[tuple[str, int], list[int]] = {}
        start = threading.Barrier(2 * len(PROMPTS))

        def client(tenant: str, i: int) -> None:
            start.wait()
            got[tenant, i] = sampler.sample(tenant, PROMPTS[i], GREEDY)[0]["tokens"]

        threads = [threading.Thread(target=client, args=(t, i))
                   for t in ("tenant-a", "tenant-b") for i in range(len(PROMPTS))]  # fmt: skip
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        # all four requests went to the engine in one call (one batch, two adapters)
        assert sampler.batch_sizes[calls_before:] == [2 * len(PROMPTS)]
        for t in ("tenant-a", "tenant-b"):
            assert [got[t, i] for i in range(len(PROMPTS))] == alone[t]
        with pytest.raises(ServiceError) as e:
            sampler.sample("tenant-c", PROMPTS[0], GREEDY)
        assert e.value.status == 404
        with pytest.raises(ServiceError) as e:
            sampler.sample(None, PROMPTS[0], SamplingParams(max_tokens=10**7))
        assert e.value.status == 413
        for t in ("tenant-a", "tenant-b"):
            sampler.drop_adapter(t)
    finally:
        sampler.close()
