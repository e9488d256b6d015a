"""A user loss and user-sent gradients give the same update as the built-in GRPO loss."""

from __future__ import annotations

import copy

import torch

from rl.generator import Generator, SamplingParams
from rl.losses import LossBatch, get_loss, group_advantages
from rl.trainer import PolicyTrainer, Rollout
from tests.helpers.tiny_llama import tiny_llama


def user_grpo(logprobs: torch.Tensor, batch: LossBatch) -> torch.Tensor:
    """GRPO written the way a user would, from the paper (eps 0.2, token mean, no KL)."""
    ratio = (logprobs - batch.sampling_logprobs).exp()
    adv = batch.advantages[:, None]
    obj = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return -(obj * batch.mask).sum() / batch.mask.sum()


def user_grads(logprobs: torch.Tensor, batch: LossBatch) -> torch.Tensor:
    """What a client computes locally: d loss / d logprobs, from the logprobs it was sent."""
    lp = logprobs.requires_grad_(True)
    (g,) = torch.autograd.grad(user_grpo(lp, batch), lp)
    return g


def test_custom_loss_and_outside_grads_match_builtin():
    base = tiny_llama(seed=1)
    gen = Generator.from_model(base)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    samples = gen.generate(prompts, SamplingParams(max_tokens=6, n=4, seed=2))
    rewards = torch.tensor([float(len(s.tokens) % 3) + 0.1 * i for i, s in enumerate(samples)])
    adv = group_advantages(rewards, 4)
    rollouts = [
        Rollout(prompts[s.prompt_index], s.tokens, s.logprobs, float(a))
        for s, a in zip(samples, adv, strict=True)
    ]
    after = []
    for how in ("builtin", "custom", "grads"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        pt = PolicyTrainer(model, opt)
        c, _ = pt.score(rollouts)
        batch = pt.loss_batch(c, None)
        if how == "builtin":
            pt.forward_backward(c, batch, get_loss("grpo"))
        elif how == "custom":
            pt.forward_backward(c, batch, user_grpo)
        else:
            pt.forward_backward_grads(c, batch, user_grads)
        pt.optim_step()
        after.append({k: v.clone() for k, v in model.state_dict().items()})
    moved = max((after[0][k] - base.state_dict()[k]).abs().max().item() for k in after[0])
    assert moved > 1e-4  # the update is real
    for other in after[1:]:
        diff = max((after[0][k] - other[k]).abs().max().item() for k in after[0])
        assert diff <= 1e-6, diff
