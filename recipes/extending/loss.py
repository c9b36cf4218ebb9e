"""Loss plugin: `fn(logp, old_logp, advantages, response_mask, *, ref_logp=None, **params) -> (loss, metrics)`.
`num_tokens` / `num_seqs` are the global counts of the optimizer step: aggregate against them and the
loss is the same for any data-parallel size or micro-batching. Recipe: `algorithm.loss: recipes/extending/loss.py:reinforce`."""

import torch

from rl.losses import aggregate_loss


def reinforce(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
              *, agg: str = "token-mean", num_tokens: float | None = None, num_seqs: float | None = None,
              norm_len: float | None = None, **_) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE: −A · log π(token), no ratio, no clipping."""
    loss = aggregate_loss(-advantages * logp, response_mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                          norm_len=norm_len)
    return loss, {"pg_loss": float(loss.detach())}
