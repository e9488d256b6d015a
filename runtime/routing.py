"""Rollout Routing Replay's seam: record, and replay, the experts each MoE router chooses.

R3 (Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers", arXiv:2510.11370, 2025): the experts the inference engine chose for each token
during the rollout are recorded and replayed in the trainer's forward, so the policy
gradient is computed under the routing that produced the sample.

What is replayed, exactly: per token position and MoE layer, the SET of top-k expert ids
(which experts the token's hidden state is dispatched to: R3's routing mask). What is not
replayed: the gate weights. They are recomputed from the trainer's current parameters for
the replayed experts (the router's own score function -- softmax or sigmoid over all
experts, from the current gate weights -- gathered at the replayed ids, then the router's own
`route_norm` and `route_scale`), so the router still gets gradients through the replayed
experts' weights, as in R3 (mask from inference, gating from training). The load-balancing
expert bias only chooses experts (torchtitan adds it to the choice, not to the weights), so
it has no effect under replay.

The seam is a forward hook on torchtitan's `TokenChoiceTopKRouter` (models/common/moe.py):
the router's output `(topk_scores, topk_expert_ids, scores)` is replaced; `MoE.forward`
then dispatches, counts tokens per expert and combines with the replayed ids. One `Seam` per
model holds what the hooks do: `recording` appends each forward's chosen ids per MoE layer;
a replay (ids (B, L, n_moe_layers, K), `known` (B, L) bool) overrides the choice where known
(elsewhere, e.g. padding, the router's own) and counts the (token, layer) pairs whose own
top-k set already matched (`agreement`); a compare-only replay (`replay=False`) counts
without overriding. A replay stays set until the next `set_replay`: an
activation-checkpointed block recomputes its forward during backward and must see the same
routing (runtime.steps sets it before each microbatch's forward and leaves it).

Expert parallelism: the ids are global expert ids (the router runs before the all-to-all),
so replay does not depend on the layout. Tensor parallelism (router outputs as DTensors) is
refused in one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_SEAM_ATTR = "_titanscale_routing_seam"


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """torchtitan's token-choice routers in model (layer) order: the `router` of every MoE
    layer (a module with `router` and `routed_experts`)."""
    return [
        m.router
        for _, m in model.named_modules()
        if hasattr(m, "router") and hasattr(m, "routed_experts")
    ]


def gate_scores(router: Any, scores_BLE: torch.Tensor, ids_BLK: torch.Tensor) -> torch.Tensor:
    """The gate weights of experts `ids` from the router's full scores, by the router's own
    rule (torchtitan TokenChoiceTopKRouter.forward: gather, route_norm, route_scale)."""
    s = scores_BLE.gather(dim=-1, index=ids_BLK)
    if router.route_norm:
        s = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    return s * router.route_scale


class Seam:
    """The hooks' shared state for one model (see the module docstring)."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.recording: list[list[torch.Tensor]] | None = None
        self.replay_ids: torch.Tensor | None = None  # (B, L, n_layers, K)
        self.replay_known: torch.Tensor | None = None  # (B, L) bool
        self.override = True  # False: compare with the routers' choice, do not replace it
        # (token, layer) pairs replayed / whose own top-k set equalled the replayed one: kept
        # as device tensors (no host sync per MoE layer), read by `agreement`
        self.compared: Any = 0
        self.matched: Any = 0

    def start_recording(self) -> None:
        self.recording = [[] for _ in range(self.n_layers)]

    def take(self) -> torch.Tensor:
        """The ids recorded since the last take, (B, L, n_layers, K), the positions of
        every forward concatenated along L; recording goes on."""
        assert self.recording is not None, "not recording"
        ids = torch.stack([torch.cat(per, dim=1) for per in self.recording], dim=2)
        self.start_recording()
        return ids

    def set_replay(
        self, ids: torch.Tensor | None, known: torch.Tensor | None = None, replay: bool = True
    ) -> None:
        if ids is not None and ids.shape[2] != self.n_layers:
            raise ValueError(
                f"routing replay: {ids.shape[2]} MoE layers recorded, the model has {self.n_layers}"
            )
        self.replay_ids, self.replay_known, self.override = ids, known, replay

    def agreement(self) -> float | None:
        """Share of replayed (token, layer) pairs whose own top-k set matched, since reset."""
        compared, matched = int(self.compared), int(self.matched)
        return matched / compared if compared else None

    def reset_agreement(self) -> None:
        self.compared = self.matched = 0

    def on_router(self, layer: int, router: Any, output: tuple) -> tuple | None:
        """The router hook's work: record, compare, override (see the module docstring)."""
        scores_k, ids, scores = output
        if hasattr(ids, "to_local"):
            if self.replay_ids is not None:
                raise NotImplementedError(
                    "rl.routing_replay with tensor parallelism (DTensor router outputs) "
                    "is not supported; use parallel.tp = 1"
                )
            return None
        if self.recording is not None:
            self.recording[layer].append(ids.detach())
        if self.replay_ids is None:
            return None
        want = self.replay_ids[:, :, layer].to(ids.device, ids.dtype)
        if want.shape != ids.shape:
            raise ValueError(
                f"routing replay: recorded ids {tuple(want.shape)} for router output "
                f"{tuple(ids.shape)}"
            )
        k = (
            torch.ones(ids.shape[:2], dtype=torch.bool, device=ids.device)
            if self.replay_known is None
            else self.replay_known.to(ids.device)
        )
        same = (ids.sort(-1).values == want.sort(-1).values).all(-1)
        self.compared = self.compared + k.sum()
        self.matched = self.matched + (same & k).sum()
        if not self.override:
            return None
        new_ids = torch.where(k[..., None], want, ids)
        return gate_scores(router, scores, new_ids), new_ids, scores


def _hook(router: Any, args: tuple, output: tuple) -> tuple | None:
    # A module-level function reading its seam from the router (not a closure): a deep copy
    # of the model (generator, reference) copies the seam once and the routers' references
    # to it together, so the copy's hooks drive the copy's seam.
    s, layer = router.__dict__[_SEAM_ATTR]
    return s.on_router(layer, router, output)


def seam(model: torch.nn.Module) -> Seam | None:
    """The model's seam, installing the hooks on first use (None for a dense model)."""
    s = getattr(model, _SEAM_ATTR, None)
    if s is not None:
        return s
    routers = moe_routers(model)
    if not routers:
        return None
    s = Seam(len(routers))
    for i, r in enumerate(routers):
        object.__setattr__(r, _SEAM_ATTR, (s, i))
        r.register_forward_hook(_hook)
    object.__setattr__(model, _SEAM_ATTR, s)  # not a submodule, not in the state dict
    return s


@contextlib.contextmanager
def recorded(model: torch.nn.Module) -> Iterator[Seam]:
    """Context: record every forward's routing (`seam.take()`); ends with recording off."""
    s = seam(model)
    if s is None:
        raise ValueError("routing record: the model has no MoE layers")
    s.start_recording()
    try:
        yield s
    finally:
        s.recording = None


def set_replay(
    model: torch.nn.Module,
    ids: torch.Tensor | None,
    known: torch.Tensor | None = None,
    *,
    replay: bool = True,
) -> None:
    """Replay `ids` (B, L, n_moe_layers, K) in the model's next forwards (None: the routers'
    own choice again; for a dense model nothing to do). `replay` False: the routers choose,
    and the seam counts how often their choice equals `ids` (router agreement)."""
    s = seam(model) if ids is not None else getattr(model, _SEAM_ATTR, None)
    if s is None:
        if ids is not None:
            raise ValueError("routing replay: the model has no MoE layers")
        return
    s.set_replay(ids, known, replay)
