"""Advantage estimators, registered under kind "advantage".

Contract: `fn(rewards [N], group_id [N] int64, response_mask [N, L], **params) -> [N, L]`.
Outcome advantages are broadcast to every response token and zeroed on masked tokens.
"""

from __future__ import annotations

import torch

from rl.registry import register


def group_stats(rewards: torch.Tensor, group_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased (n-1) group std and group size.

    A group of one has std 0 (not NaN): its advantage is then 0 under every estimator here.
    """
    uniq, inverse = torch.unique(group_id, return_inverse=True)
    r = rewards.to(torch.float64)
    count = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / count
    sq = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
    return mean[inverse], var.sqrt()[inverse], count[inverse]


@register("advantage", "grpo")
def compute_grpo_advantages(rewards: torch.Tensor, group_id: torch.Tensor, response_mask: torch.Tensor,
                            eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO outcome advantage `(R - mean_g R) / (std_g R + eps)`, broadcast over response tokens.

    Conventions (as verl's `grpo` estimator): std is the unbiased (n-1) group std, `eps` is added
    to the std (not under the square root), a group of one and an all-equal group get advantage 0.
    `norm_by_std=False` gives Dr.GRPO's mean-only centring.
    """
    mean, std, _ = group_stats(rewards, group_id)
    adv = rewards.to(torch.float64) - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return (adv.to(torch.float32).unsqueeze(-1) * response_mask).to(torch.float32)
