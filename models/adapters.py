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


class SequenceContext:
    """What every U-LoRA layer of one model reads about the forward in progress, set by a forward pre-hook on the
    model: which tokens are real (`mask [B, T]`, from the attention mask's last T columns), where sequences start
    (`starts [B, T]`: position id 0, so packed rows keep their sequences apart), whether the forward continues the
    previous one through a KV cache (`continuing`), and whether it is the model's own forward (`recording`: false
    again by the time gradient checkpointing recomputes a layer in the backward)."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.starts: torch.Tensor | None = None
        self.continuing = False
        self.recording = False

    def before(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and not ids.is_floating_point():
            tokens = ids.shape[-1]
        else:
            tokens = embeds.shape[-2] if isinstance(embeds, torch.Tensor) else None
        mask, pos, past = kwargs.get("attention_mask"), kwargs.get("position_ids"), kwargs.get("past_key_values")
        past_len = int(past.get_seq_length()) if past is not None and hasattr(past, "get_seq_length") else 0
        self.continuing = past_len > 0
        self.mask = mask[:, -tokens:] if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tokens else None
        self.starts = (pos == 0) if isinstance(pos, torch.Tensor) and pos.dim() == 2 else None
        self.recording = True

    def after(self, *_: Any) -> None:
        self.recording = False


def context_sums(z: torch.Tensor, mask: torch.Tensor | None, starts: torch.Tensor | None,
                 carried: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position t of `z [B, T, r]`, the sum of z over the real positions ≤ t of its sequence and their count
    (`[B, T, r]`, `[B, T, 1]`): padding (`mask` 0) left out, a sequence start (`starts`) resetting both, and
    `carried` (the sums and counts a KV-cached forward's previous tokens left, `[B, r]`, `[B]`) added before the
    first start."""
    m = (mask.to(z.dtype) if mask is not None else z.new_ones(z.shape[:-1]))[..., None]
    sums, counts = (z * m).cumsum(-2), m.cumsum(-2)
    if starts is not None and bool(starts.any()):
        B, T = starts.shape
        idx = torch.arange(T, device=z.device).expand(B, T)
        first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values  # the latest start at or before t
        before_sums = torch.cat([torch.zeros_like(sums[:, :1]), sums[:, :-1]], 1)
        before_counts = torch.cat([torch.zeros_like(counts[:, :1]), counts[:, :-1]], 1)
        sums = sums - before_sums.gather(1, first[..., None].expand_as(sums))
        counts = counts - before_counts.gather(1, first[..., None])
        open_ = ~starts.cumsum(-1).bool()  # no start yet in this chunk: the carried sums still apply
    else:
        open_ = None
    if carried is not None:
        keep = open_[..., None].to(z.dtype) if open_ is not None else 1.0
        sums = sums + keep * carried[0][:, None]
        counts = counts + keep * carried[1][:, None, None]
    return sums, counts


def finish_optimizer_step(model: nn.Module) -> None:
    """Advance what modules keep once per optimizer step (U-LoRA's EMA prior, with the gates of every training
    forward since the last step, summed over data-parallel ranks): the learner calls it after each optimizer
    step, a hand-written loop after its `opt.step()`."""
    for mod in model.modules():
        if hasattr(mod, "finish_step"):
            mod.finish_step()


def sequence_state(model: nn.Module) -> list[dict]:
    """A copy of every layer's per-row KV-cached state (to put back with `restore_sequence_state`)."""
    return [dict(mod.carried) for mod in model.modules() if hasattr(mod, "lora_context")]


def restore_sequence_state(model: nn.Module, saved: list[dict]) -> None:
    for mod, carried in zip((m for m in model.modules() if hasattr(m, "lora_context")), saved):
        mod.carried = carried


def has_sequence_state(model: nn.Module) -> bool:
    """Whether layers of `model` carry per-row state from one KV-cached forward to the next (U-LoRA's context
    sums): a decode loop must then run every row in every forward, as prefilled."""
    return any(hasattr(mod, "lora_context") for mod in model.modules())


class _UtilizationGates:
    """U-LoRA's per-token gates over a LoRA layer's r directions, mixed into `ULoraLinear` (which holds the
    gate layers `lora_gate_u`/`lora_gate_c`, the prior `lora_ema`, `beta`, `lam`, `context`, the shared
    `lora_context` and the `carried` and `step_gates` state): the context mean, the gates with the prior, the
    record of the step's gates and the once-per-step EMA update."""

    def context_mean(self, z: torch.Tensor, adapter: str) -> torch.Tensor:
        ctx = self.lora_context
        carried = self.carried.get(adapter) if ctx.continuing else None
        sums, counts = context_sums(z, ctx.mask, ctx.starts, carried)
        self.carried[adapter] = (sums[:, -1].detach(), counts[:, -1, 0].detach())
        return sums / counts.clamp(min=1)

    def gates(self, z: torch.Tensor, adapter: str) -> torch.Tensor:
        r = z.shape[-1]
        logits = self.lora_gate_u[adapter](z)
        if self.context:
            logits = logits + self.lora_gate_c[adapter](self.context_mean(z, adapter) if z.dim() >= 3 else z)
        g = r * torch.softmax(logits, dim=-1)
        if self.training and torch.is_grad_enabled() and self.lora_context.recording:
            self._record(g.detach(), adapter)
        state = self.lora_ema[adapter]
        m, k = state[:r], int(state[r])
        if k == 0:
            return g  # no prior yet: the plain gate
        return (1 - self.lam) * g + self.lam * (m / (1 - self.beta ** k)).detach()

    def _record(self, g: torch.Tensor, adapter: str) -> None:
        mask = self.lora_context.mask
        w = (mask.to(g.dtype)[..., None] if mask is not None and g.dim() == 3 and mask.shape == g.shape[:2]
             else g.new_ones(*g.shape[:-1], 1))
        total = torch.cat([(g * w).reshape(-1, g.shape[-1]).sum(0), w.sum().reshape(1)])
        acc = self.step_gates.get(adapter)
        self.step_gates[adapter] = total if acc is None else acc + total

    def finish_step(self) -> None:
        """One EMA step per adapter with the mean gate over the step's real tokens on every rank."""
        import torch.distributed as dist
        for adapter, state in self.lora_ema.items():
            r = state.shape[0] - 1
            acc = self.step_gates.pop(adapter, state.new_zeros(r + 1)).to(state.dtype)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(acc)
            if float(acc[r]) > 0:
                m, k, _ = ema_prior(state[:r], int(state[r]), acc[:r] / acc[r], self.beta)
                state.copy_(torch.cat([m, torch.tensor([float(k)], device=m.device, dtype=m.dtype)]))


def _ulora_linear_class():
    """U-LoRA's layer as a peft LoRA layer (built on first use so that peft is imported only when needed)."""
    from peft.tuners._buffer_dict import BufferDict
    from peft.tuners.lora.layer import Linear as LoraLinear

    class ULoraLinear(_UtilizationGates, LoraLinear):
        """A peft LoRA linear whose r directions are gated per token: z = A x, g = r·softmax(W_u z + b_u +
        W_c c + b_c) with c the mean of z over the sequence's real tokens so far (`context_sums`: padding left
        out, carried through the KV cache by per-row sums), calibrated by the bias-corrected EMA prior of the
        mean gate, g̃ = (1 − λ) g + λ m̂; h = W0 x + s·B(g̃ ⊙ z). The gate weights start at 0, so g = 1 and the
        layer starts as LoRA. The EMA advances once per optimizer step (`finish_step`) with the mean gate of that
        step's training forwards (a gradient-checkpointing recompute is not counted again); every forward of a
        step uses the prior of the steps before it. Not mergeable: the update depends on the input."""

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
            self.lora_context = SequenceContext()  # replaced by the model's shared one (`ulora`)
            self.carried: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per adapter: the rows' context sums
            self.step_gates: dict[str, torch.Tensor] = {}  # per adapter: [Σ g..., tokens] since the last step

        def merge(self, *args, **kwargs) -> None:
            raise NotImplementedError("U-LoRA's update depends on the input: it cannot be merged into the weight")

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
    adapted = get_peft_model(model, config)
    share_sequence_context(adapted)
    return adapted


def share_sequence_context(adapted: nn.Module) -> None:
    """One `SequenceContext` for every U-LoRA layer of the peft model `adapted`, kept current by hooks on the model
    it wraps: every peft path reaches that model by a call (the tuner's forward calls it), so its hooks see each
    forward's inputs."""
    ctx = SequenceContext()
    inner = adapted.get_base_model()
    inner.register_forward_pre_hook(ctx.before, with_kwargs=True)
    inner.register_forward_hook(ctx.after)
    for mod in adapted.modules():
        if hasattr(mod, "lora_context"):
            mod.lora_context = ctx


BUILTIN_ADAPTERS = {"lora": lora, "ulora": ulora}  # also registered by name (rl.registry's built-ins)
