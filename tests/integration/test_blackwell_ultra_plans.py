"""Issue 29's acceptance: a GB300 NVL72 profile (gpu = "GB300", 4 GPUs per host, 72 per
NVLink domain) and an HGX B300 one plan and predict Llama 3 8B / 70B / 405B with
`kernels.linear` = fp8_tensorwise and mxfp8, priced on the torchtitan and megatron_te stacks.

In-process through each tool's `main(argv)` (what `python -m tools.X` runs). The references
are the datasheets, not the code under test: every tp x cp group fits in one NVLink domain
(72 GPUs on GB300, 8 on B300), a plan's memory fits the GPU's (the profile's HBM less the
runtime's overhead), and MFU at the precision's peak is MFU at the BF16 peak times BF16 / FP8
dense peak (2.5 / 5.0 PFLOP/s on GB300, 2.25 / 4.5 on B300: both one half).
"""

from __future__ import annotations

import json

import pytest

from tools import plan, predict

pytestmark = pytest.mark.slow

PROFILES = {"gb300_nvl72": ("GB300", 4, 72), "hgx_b300_ib": ("B300", 8, 8)}
RECIPES = {"8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"}


def _json(main, argv, capsys) -> dict:
    assert main(argv) in (None, 0)
    out = capsys.readouterr().out
    return json.loads(out)


@pytest.mark.parametrize("cluster", list(PROFILES))
@pytest.mark.parametrize("linear", ["fp8_tensorwise", "mxfp8"])
@pytest.mark.parametrize("stack", ["torchtitan", "megatron_te"])
def test_plan_and_predict_on_blackwell_ultra(cluster, linear, stack, capsys):
    from parallel.cluster import load_cluster

    gpu, gpn, domain = PROFILES[cluster]
    c = load_cluster(cluster)
    assert (c.gpu, c.gpus_per_node, c.nvlink_domain_gpus) == (gpu, gpn, domain)
    hbm = c.hbm_bytes / 2**30
    for flavor, recipe in RECIPES.items():
        common = ["--recipe", recipe, "--cluster", cluster, "--set", f"kernels.linear={linear}",
                  "--stack", stack]  # fmt: skip
        plans = _json(plan.main, [*common, "--json", "--top", "3"], capsys)["plans"]
        assert plans, (flavor, linear, stack)
        for p in plans:
            assert p["tp"] * p["cp"] <= domain and domain % (p["tp"] * p["cp"]) == 0, p
            assert p["memory_gib_per_gpu"] + 3.0 <= hbm, p
            assert p["tokens_per_sec_per_gpu"] > 0 and 0 < p["mfu_pct"] < 100, p
        pred = _json(predict.main, [*common, "--json"], capsys)
        assert pred["gpu"] == gpu and pred["stack"] == stack
        assert pred["tokens_per_sec_per_gpu"] > 0
        assert pred["mfu_pct_precision_peak"] == pytest.approx(pred["mfu_pct"] / 2, abs=0.02)
        # With parallel.auto the prediction is the planner's best plan, which fits.
        auto = _json(predict.main, [*common, "--set", "parallel.auto=true", "--json"], capsys)
        assert auto["memory_fits"] and auto["plan"]["tokens_per_sec_per_gpu"] == pytest.approx(
            plans[0]["tokens_per_sec_per_gpu"], rel=1e-3
        )
