"""Model families: how a family loads and what its training forward returns.

The learner knows no model and no method: it asks the recipe's family (`model.family`, registry kind
`family`) for the model and, per micro-batch, for the response-token quantities the loss names.

* `causal`: decoder-only LMs loaded with `AutoModelForCausalLM`. Outputs `logp [N, L]` (sampled-token
  logprobs at the rollout temperature) and `entropy [N, L]`.
* `looped`: looped LMs such as Ouro (`models/ouro.py`). Adds `loop_logp [N, L, T]` (every loop's readout)
  and `exit_pdf [N, L, T]` (the stick-breaking exit distribution); `logp` is then the final loop's.

`forward` takes anything with `model_inputs()`, `prompt_ids` and `response_ids` (a `rl.batch.Batch`);
this module imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from models.ouro import OuroConfig, exit_pdf


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def response_logprobs(model: torch.nn.Module, batch: Any, temperature: float = 1.0,
                      with_entropy: bool = False, entropy_grad: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[N, L]` logprobs of `batch.response_ids` under a causal `model` at `temperature` (and entropy if asked).

    The entropy is a metric unless `entropy_grad` (an entropy bonus in the loss): then it keeps its graph.
    Logits are divided by the rollout temperature before the log-softmax, so that the ratio to the
    rollout engine's logprobs is 1 on-policy.
    """
    device = _device(model)
    inputs = {k: v.to(device) for k, v in batch.model_inputs().items()}
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


def response_loop_logprobs(model: torch.nn.Module, batch: Any, temperature: float = 1.0,
                           with_entropy: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For a looped model: `[N, L, T]` logprobs of the response tokens under each loop's readout at
    `temperature`, the `[N, L, T]` exit pdf at those positions, and the final loop's entropy `[N, L]` as a
    metric (no graph) if asked. The per-loop projections go chunk by chunk (`loop_token_logprobs`), so T
    full-vocabulary logit tensors never exist at once."""
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    if not hasattr(module, "loop_states"):
        raise TypeError(f"per-loop logprobs need a looped model (model_type ouro); {type(module).__name__} has none")
    device = _device(module)
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


class CausalFamily:
    """Decoder-only LMs (Llama, Qwen, the tiny model of `models/tiny.py`, ...)."""

    name = "causal"
    outputs: tuple[str, ...] = ("logp", "entropy")

    def load(self, path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
             ) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)

    def forward(self, model: torch.nn.Module, batch: Any, *, temperature: float = 1.0,
                outputs: frozenset[str] | set[str] = frozenset({"logp"}), entropy_grad: bool = False
                ) -> dict[str, torch.Tensor]:
        """The `outputs` asked for (a subset of `self.outputs`; `logp` is always returned)."""
        logp, entropy = response_logprobs(model, batch, temperature, with_entropy="entropy" in outputs,
                                          entropy_grad=entropy_grad)
        return {"logp": logp, "entropy": entropy} if entropy is not None else {"logp": logp}


class LoopedFamily(CausalFamily):
    """Looped LMs (Ouro): the shared layer stack runs T times, each loop has a readout and an exit gate."""

    name = "looped"
    outputs = ("logp", "entropy", "loop_logp", "exit_pdf")
    model_types = (OuroConfig.model_type,)

    def forward(self, model: torch.nn.Module, batch: Any, *, temperature: float = 1.0,
                outputs: frozenset[str] | set[str] = frozenset({"logp"}), entropy_grad: bool = False
                ) -> dict[str, torch.Tensor]:
        if not {"loop_logp", "exit_pdf"} & set(outputs):  # one readout: the plain forward is the final loop's
            return super().forward(model, batch, temperature=temperature, outputs=outputs, entropy_grad=entropy_grad)
        if entropy_grad:
            raise ValueError("an entropy bonus in the loss is not supported with per-loop outputs "
                             "(the final loop's entropy is a metric)")
        loop_logp, pdf, entropy = response_loop_logprobs(model, batch, temperature, "entropy" in outputs)
        out = {"logp": loop_logp[..., -1], "loop_logp": loop_logp, "exit_pdf": pdf}  # the final loop samples
        if entropy is not None:
            out["entropy"] = entropy
        return out


def family_for_model_type(model_type: str) -> str:
    """The family that `model.family: auto` picks for a transformers `model_type`."""
    return LoopedFamily.name if model_type in LoopedFamily.model_types else CausalFamily.name
