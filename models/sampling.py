"""The sampling distribution shared by the rollout engines' decode loop and the learner.

`warp_logits` turns a model's logits into the distribution a token is sampled from (temperature, then
top-k, then top-p, as transformers' warpers do). The learner evaluates the sampled tokens under the same
processed distribution when the rollout truncated it (`top_k > 0` or `top_p < 1`), so that its logprobs,
the rollout engine's and the importance weights between them refer to one distribution.
"""

from __future__ import annotations

import torch


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty of transformers and vLLM (CTRL's rule): the logit of every token already in the row
    (`seen [B, V]`, prompt and response) is divided by `penalty` when positive and multiplied by it when negative,
    so `penalty > 1` makes repeats less likely; 1 leaves the logits as they are."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering over the last dimension; removed tokens get
    `-inf`. `temperature <= 0` leaves the scale alone (greedy decoding takes the argmax of any scale)."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k > 0:
        k = min(top_k, logits.shape[-1])
        logits = logits.masked_fill(logits < torch.topk(logits, k)[0][..., -1, None], float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def truncates(top_k: int, top_p: float) -> bool:
    """Whether sampling with these settings draws from a truncated (renormalised) distribution."""
    return bool(top_k and top_k > 0) or top_p < 1.0
