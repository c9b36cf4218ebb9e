"""Parameter-efficient adapters, named in the recipe (`learner.adapter: {name, params}`; registry kind `adapter`).

An adapter factory takes the loaded policy and returns it wrapped (`fn(model, **params) -> model`); only the
adapter's parameters train. LoRA comes from `peft` (the field's library: its layers, its state-dict names, its
adapter folders), so a looprl adapter loads anywhere peft does. U-LoRA (`ulora`) is a peft LoRA layer of our own,
registered with peft's custom-layer hook, whose r directions are gated per token.

What the rest of looprl asks of an adapted model, in one place:
* `adapter_state_dict` — the adapter's tensors alone, under peft's saved names: what travels to the rollout
  workers each step and what a checkpoint keeps;
* `load_adapter_state` — put such tensors into an adapted copy of the base (a rollout engine's), unmerged;
* `merged_state_dict` — the full weights with each adapter's update added, under the base model's own names:
  what an export to a plain HF folder writes (LoRA; U-LoRA's input-dependent update has none);
* `reference_forward` — the base model's forward (adapter disabled): the reference policy, with no second copy of
  the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

ADAPTER_MARK = ".lora_"  # in every LoRA tensor name peft saves


def _lora_config(r: int, alpha: float, dropout: float, target_modules: list[str] | str | None,
                 task_type: str | None):
    """peft's LoraConfig for `lora` and `ulora` (target_modules default: every linear but the output head)."""
    from peft import LoraConfig
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules=list(target_modules) if isinstance(target_modules, (list, tuple))
                      else (target_modules or "all-linear"), task_type=task_type)


def lora(model: nn.Module, *, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
         target_modules: list[str] | str | None = None, task_type: str | None = "CAUSAL_LM") -> nn.Module:
    """LoRA (peft) on `target_modules` (names of linear modules, or peft's "all-linear": every linear but the
    output head; the default), rank `r`, scaling `alpha / r`, dropout on the adapter's input. B starts at 0, so
    the adapted model starts equal to the base. `task_type` None wraps any module (not only a causal LM)."""
    from peft import get_peft_model
    config = _lora_config(r, alpha, dropout, target_modules, task_type)
    return get_peft_model(model, config)


def make_adapter(model: nn.Module, spec: dict[str, Any], factory: Any = None) -> nn.Module:
    """Wrap `model` with the adapter `{name, params}` of the recipe (`learner.adapter`): `factory` the resolved
    adapter function (callers resolve plugins through the registry), else a built-in by name."""
    if factory is None:
        if spec["name"] not in BUILTIN_ADAPTERS:
            raise ValueError(f"adapter {spec['name']!r} is not built in ({sorted(BUILTIN_ADAPTERS)}); resolve it "
                             "through the registry and pass it as `factory`")
        factory = BUILTIN_ADAPTERS[spec["name"]]
    return factory(model, **dict(spec.get("params") or {}))


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
    unmergeable = [n for n, m in base.named_modules() if isinstance(m, LoraLayer) and hasattr(m, "lora_gate_u")]
    if unmergeable:
        raise ValueError(f"the adapter's update depends on the input (U-LoRA, e.g. {unmergeable[0]}): it has no "
                         "merged weights; keep it as an adapter (trainer.save_hf false, no export stage)")
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


def is_mergeable(model: nn.Module) -> bool:
    """Whether every adapted layer's update is a fixed weight delta (LoRA), not input-dependent (U-LoRA)."""
    from peft.tuners.lora import LoraLayer
    return not any(isinstance(m, LoraLayer) and hasattr(m, "lora_gate_u") for m in model.modules())


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights of an adapted model under the base model's own names (no adapter tensors)."""
    return {k.replace(".base_layer.", "."): v.detach() for k, v in model.get_base_model().state_dict().items()
            if ADAPTER_MARK not in k}


UNMERGED_SPEC = "looprl_adapter.json"  # in `<model folder>/adapter/`: the base plus this adapter is the model


def save_unmerged(model: nn.Module, spec: dict[str, Any], folder: str | Path) -> None:
    """An adapter that cannot be merged, saved beside its base (`folder` holds the base weights): its recipe
    spec and tensors in `folder/adapter/`, which `load_unmerged` (and so the hf engine) applies on load."""
    import json

    from safetensors.torch import save_file
    out = Path(folder) / "adapter"
    out.mkdir(parents=True, exist_ok=True)
    (out / UNMERGED_SPEC).write_text(json.dumps({"name": spec["name"], "params": dict(spec.get("params") or {})}))
    save_file({k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(model).items()},
              str(out / "adapter_model.safetensors"))


def load_unmerged(model: nn.Module, folder: str | Path) -> nn.Module:
    """`model` (loaded from `folder`) with the unmerged adapter saved there by `save_unmerged`, if any."""
    import json

    from safetensors.torch import load_file
    spec_path = Path(folder) / "adapter" / UNMERGED_SPEC
    if not spec_path.is_file():
        return model
    adapted = make_adapter(model, json.loads(spec_path.read_text()))
    load_adapter_state(adapted, load_file(str(spec_path.parent / "adapter_model.safetensors")))
    return adapted


@contextlib.contextmanager
def reference_forward(model: nn.Module) -> Iterator[None]:
    """Within it, an adapted model computes the base model's outputs (the reference policy)."""
    module = getattr(model, "module", model)  # a DeepSpeed engine's module
    with module.disable_adapter():
        yield


# --------------------------------------------------------------------------------------------------- U-LoRA
def ema_prior(m: torch.Tensor, k: int, g_mean: torch.Tensor, beta: float) -> tuple[torch.Tensor, int, torch.Tensor]:
    """One step of U-LoRA's EMA prior: m_k = β m_{k−1} + (1 − β) ḡ_k from m_0 = 0, and its bias-corrected value
    m̂_k = m_k / (1 − β^k). Returns (m_k, k, m̂_k)."""
    k = k + 1
    m = beta * m + (1 - beta) * g_mean
    return m, k, m / (1 - beta ** k)


def causal_mean(z: torch.Tensor) -> torch.Tensor:
    """The running mean over the sequence (dim −2): position t averages positions ≤ t (valid for generation)."""
    t = torch.arange(1, z.shape[-2] + 1, device=z.device, dtype=z.dtype)
    return z.cumsum(-2) / t[:, None]


def _ulora_linear_class():
    """U-LoRA's layer as a peft LoRA layer (built on first use so that peft is imported only when needed)."""
    from peft.tuners._buffer_dict import BufferDict
    from peft.tuners.lora.layer import Linear as LoraLinear

    class ULoraLinear(LoraLinear):
        """A peft LoRA linear whose r directions are gated per token: z = A x, g = r·softmax(W_u z + b_u +
        W_c c + b_c) with c the causal running mean of z over the sequence, calibrated by the bias-corrected EMA
        prior of the batch-mean gate, g̃ = (1 − λ) g + λ m̂; h = W0 x + s·B(g̃ ⊙ z). The gate weights start at 0,
        so g = 1 and the layer starts as LoRA. The EMA advances on every training forward with gradients (one per
        micro-batch) and is frozen in eval. Not mergeable: the update depends on the input."""

        def __init__(self, base_layer, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
            super().__init__(base_layer, adapter_name, config, r=r, lora_alpha=lora_alpha, **kwargs)
            self.beta, self.lam, self.context = config.ulora_beta, config.ulora_lambda, config.ulora_context
            self.lora_gate_u = nn.ModuleDict({adapter_name: nn.Linear(r, r)})
            self.lora_gate_c = nn.ModuleDict({adapter_name: nn.Linear(r, r)})
            for gate in (self.lora_gate_u[adapter_name], self.lora_gate_c[adapter_name]):
                nn.init.zeros_(gate.weight)
                nn.init.zeros_(gate.bias)
            self.lora_ema = BufferDict({adapter_name: torch.zeros(r + 1)}, persistent=True)  # m, then k
            # peft's adapter bookkeeping (trainability, adapter switching) covers the gates from here on
            self.adapter_layer_names = (*LoraLinear.adapter_layer_names, "lora_gate_u", "lora_gate_c")
            self.last_gate: torch.Tensor | None = None  # the last forward's g̃ (for analysis)

        def merge(self, *args, **kwargs) -> None:
            raise NotImplementedError("U-LoRA's update depends on the input: it cannot be merged into the weight")

        def gates(self, z: torch.Tensor, adapter: str) -> torch.Tensor:
            r = z.shape[-1]
            logits = self.lora_gate_u[adapter](z)
            if self.context:
                logits = logits + self.lora_gate_c[adapter](causal_mean(z) if z.dim() >= 2 else z)
            g = r * torch.softmax(logits, dim=-1)
            state = self.lora_ema[adapter]
            m, k = state[:r], int(state[r])
            if self.training and torch.is_grad_enabled():
                m, k, m_hat = ema_prior(m, k, g.detach().reshape(-1, r).mean(0), self.beta)
                state.copy_(torch.cat([m, torch.tensor([float(k)], device=m.device, dtype=m.dtype)]))
            elif k > 0:
                m_hat = m / (1 - self.beta ** k)
            else:
                return g  # no prior yet: the plain gate
            return (1 - self.lam) * g + self.lam * m_hat.detach()

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if self.disable_adapters:
                return self.base_layer(x, *args, **kwargs)
            result = self.base_layer(x, *args, **kwargs)
            for adapter in self.active_adapters:
                if adapter not in self.lora_A:
                    continue
                z = self.lora_A[adapter](self.lora_dropout[adapter](x.to(self.lora_A[adapter].weight.dtype)))
                g = self.gates(z, adapter)
                self.last_gate = g.detach()
                result = result + self.lora_B[adapter](g * z).to(result.dtype) * self.scaling[adapter]
            return result

    return ULoraLinear


def ulora(model: nn.Module, *, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
          target_modules: list[str] | str | None = None, beta: float = 0.99, lam: float = 0.3, context: bool = True,
          task_type: str | None = "CAUSAL_LM") -> nn.Module:
    """U-LoRA ([RECONSTRUCTION], rl/methods/ulora/README.md): peft's LoRA with token-level utilization gates over
    the r directions, a sequence-context term (`context`; off: token-only gates, an ablation) and a bias-corrected
    EMA prior (`beta`, weight `lam`). 2r² + 2r parameters per module beyond LoRA's. Not mergeable: the hf engine
    serves it unmerged, vllm refuses it. `task_type` None wraps any module (not only a causal LM)."""
    from peft import get_peft_model
    config = _lora_config(r, alpha, dropout, target_modules, task_type)
    config.ulora_beta, config.ulora_lambda, config.ulora_context = beta, lam, context
    config._register_custom_module({nn.Linear: _ulora_linear_class()})
    return get_peft_model(model, config)


BUILTIN_ADAPTERS = {"lora": lora, "ulora": ulora}  # also registered by name (rl.registry's built-ins)
