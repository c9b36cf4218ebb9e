"""Sampled-token logprobs and entropy of a causal LM over the response part of a `Batch`."""

from __future__ import annotations

import torch

from rl.batch import Batch


def response_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0,
                      with_entropy: bool = False, entropy_grad: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[N, L]` logprobs of `batch.response_ids` under `model` at `temperature` (and entropy if asked).

    The entropy is a metric unless `entropy_grad` (an entropy bonus in the loss): then it keeps its graph.

    Logits are divided by the rollout temperature before the log-softmax, so that the ratio to the
    rollout engine's logprobs is 1 on-policy.
    """
    inputs = batch.model_inputs()
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    logits = model(**inputs, use_cache=False).logits
    P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logits = logits[:, P - 1:P + L - 1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logsm = torch.log_softmax(logits, -1)
    logp = logsm.gather(-1, batch.response_ids.to(device).unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy
