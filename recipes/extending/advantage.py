"""Advantage plugin: `fn(rewards [N], group_id [N], response_mask [N, L], **params) -> [N, L]`.
Recipe: `algorithm.advantage: recipes/extending/advantage.py:group_rank`."""

import torch


def group_rank(rewards: torch.Tensor, group_id: torch.Tensor, response_mask: torch.Tensor, *,
               scale: float = 1.0) -> torch.Tensor:
    """Centred rank of each sample's reward within its group, in [-scale, scale] (ties share their mean
    rank), broadcast over the response tokens."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_id):
        idx = (group_id == g).nonzero(as_tuple=True)[0]
        r = rewards[idx].float()
        ranks = (r[:, None] > r[None, :]).float().sum(1) + 0.5 * ((r[:, None] == r[None, :]).float().sum(1) - 1)
        adv[idx] = scale * (2 * ranks / max(1, len(idx) - 1) - 1) if len(idx) > 1 else 0.0
    return adv[:, None] * response_mask
