"""Parameter-efficient adapters, named in the recipe (`learner.adapter: {name, params}`; registry kind `adapter`).

An adapter factory takes the loaded policy and returns it wrapped (`fn(model, **params) -> model`); only the
adapter's parameters train. LoRA comes from `peft` (the field's library: its layers, its state-dict names, its
adapter folders), so a looprl adapter loads anywhere peft does.

What the rest of looprl asks of an adapted model, in one place:
* `adapter_state_dict` — the adapter's tensors alone, under peft's saved names: what travels to the rollout
  workers each step and what a checkpoint keeps;
* `load_adapter_state` — put such tensors into an adapted copy of the base (a rollout engine's), unmerged;
* `merged_state_dict` — the full weights with each adapter's update added, under the base model's own names:
  what an export to a plain HF folder writes;
* `reference_forward` — the base model's forward (adapter disabled): the reference policy, with no second copy of
  the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

ADAPTER_MARK = ".lora_"  # in every LoRA tensor name peft saves


def lora(model: nn.Module, *, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
         target_modules: list[str] | str | None = None) -> nn.Module:
    """LoRA (peft) on `target_modules` (names of linear modules, or peft's "all-linear": every linear but the
    output head; the default), rank `r`, scaling `alpha / r`, dropout on the adapter's input. B starts at 0, so
    the adapted model starts equal to the base."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules) if isinstance(target_modules, (list, tuple))
                        else (target_modules or "all-linear"), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def make_adapter(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
    """Wrap `model` with the adapter `{name, params}` of the recipe (`learner.adapter`)."""
    from rl.registry import get
    return get("adapter", spec["name"])(model, **dict(spec.get("params") or {}))


def is_adapted(model: nn.Module) -> bool:
    from peft import PeftModel
    return isinstance(model, PeftModel)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's trainable tensors, under the names peft saves them with (no adapter name)."""
    from peft import get_peft_model_state_dict
    return get_peft_model_state_dict(model)


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (`adapter_state_dict`'s names) into an adapted model; every name must match."""
    from peft import set_peft_model_state_dict
    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise KeyError(f"adapter tensors not in the model: {unexpected[:5]}")


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of an adapted model under the base model's names, each adapted layer's weight plus its
    adapter's update (the model itself is left unmerged)."""
    from peft.tuners.lora import LoraLayer
    base = model.get_base_model()
    deltas = {f"{name}.base_layer.weight": module.get_delta_weight(module.active_adapters[0])
              for name, module in base.named_modules() if isinstance(module, LoraLayer) and module.merged is False}
    out = {}
    for key, value in base.state_dict().items():
        if ADAPTER_MARK in key:
            continue
        v = value.detach()
        if key in deltas:
            v = v + deltas[key].detach().to(v.dtype)
        out[key.replace(".base_layer.", ".")] = v
    return out


@contextlib.contextmanager
def reference_forward(model: nn.Module) -> Iterator[None]:
    """Within it, an adapted model computes the base model's outputs (the reference policy)."""
    module = getattr(model, "module", model)  # a DeepSpeed engine's module
    with module.disable_adapter():
        yield
