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


def response_loop_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0,
                           with_entropy: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For a looped model (`models/ouro.py`): `[N, L, T]` logprobs of the response tokens under each
    loop's readout at `temperature`, the `[N, L, T]` exit pdf at those positions, and the final loop's
    entropy `[N, L]` as a metric (no graph) if asked. The per-loop projections go chunk by chunk
    (`loop_token_logprobs`), so T full-vocabulary logit tensors never exist at once."""
    from models.ouro import exit_pdf
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    if not hasattr(module, "loop_states"):
        raise TypeError(f"this loss needs per-loop logprobs from a looped model (model_type ouro); "
                        f"{type(module).__name__} has none")
    device = next(module.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.model_inputs().items()}
    states, gate_logits = module.loop_states(**inputs)
    P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    states = [h[:, P - 1:P + L - 1] for h in states]
    temp = temperature if temperature > 0 else 1.0
    loop_logp = module.loop_token_logprobs(states, batch.response_ids.to(device), temp)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            logsm = torch.log_softmax(module.lm_head(states[-1]).float() / temp, -1)
            entropy = -(logsm.exp() * logsm).sum(-1)
    return loop_logp, exit_pdf(gate_logits[:, P - 1:P + L - 1]), entropy
