"""Expert-load figures of the MoE run report against their definitions (docs/moe.md)."""

from __future__ import annotations

import torch

from runtime.moe_metrics import expert_load_figures


def test_balanced_and_collapsed_routing():
    balanced = torch.full((2, 8), 10.0)
    f = expert_load_figures(balanced)
    assert f["moe_expert_load_max_over_mean"] == 1.0 and f["moe_load_balance_loss"] == 1.0
    assert f["moe_expert_load_mean_tokens"] == [10.0, 10.0] and f["moe_dropped_tokens"] == 0
    collapsed = torch.zeros(1, 8)
    collapsed[0, 3] = 80.0  # every token to one expert: max/mean = E, E x sum f^2 = E
    f = expert_load_figures(collapsed)
    assert f["moe_expert_load_max_over_mean"] == 8.0 and f["moe_load_balance_loss"] == 8.0


def test_figures_follow_the_switch_formula():
    load = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    share = [v / 12 for v in (1, 2, 3, 6)]
    f = expert_load_figures(load)
    assert abs(f["moe_load_balance_loss"] - 4 * sum(s * s for s in share)) < 1e-12
    assert f["moe_expert_load_max_tokens"] == [6.0]
    assert f["moe_expert_load_max_over_mean"] == 6.0 / 3.0
