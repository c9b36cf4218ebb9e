"""Block-wise access to a model's decoder stack, for stages that calibrate or compare models block by block
(Decomper's drift compensation, FAIR-Calib's quantization)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class _Stop(Exception):
    """Raised by a forward hook to end a forward pass once the block it watches has run."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder block stack: `model.model.layers` (Llama-style causal LMs) or `model.model.transformer.blocks`
    (the LLaDA layout)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    transformer = getattr(inner, "transformer", None)
    if isinstance(transformer, nn.ModuleDict) and isinstance(transformer["blocks"], nn.ModuleList):
        return transformer["blocks"]
    raise TypeError(f"{type(model).__name__}: no decoder block list at model.layers or model.transformer.blocks")


# a decoder layer's modules that work on each position alone (what `compile_position_wise` compiles)
POSITION_WISE = ("mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")


def compile_position_wise(model: nn.Module) -> int:
    """Compile each decoder layer's position-wise modules (`POSITION_WISE`: its MLP and norms) and the stack's final
    norm in place with `torch.compile` (inductor, dynamic shapes, so lengths and batch sizes do not recompile), and
    the rotary embedding its attention applies (`compile_rotary`); returns how many modules.

    Why: in a bf16 CPU training step the matmuls run at the machine's rate and a fifth to a third of the time
    goes to the elementwise work around them (the norms' fp32 round trips, SwiGLU, the rotary embedding's
    multiplies, half rotation and adds), op by op, forward and backward; compiled, each module's elementwise ops
    fuse into a few loops. The rest of attention stays eager: it threads the KV cache that the shared-prompt
    forward passes through it (compiled whole, it recompiles per layer; its core compiled alone gained nothing).
    A peft model compiles its base model's layers (the adapters' layers inside the MLP included). The first step
    in a process pays the compile (seconds)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = [getattr(layer, name, None) for layer in decoder_layers(base) for name in POSITION_WISE]
    # the stack's final norm (`model.norm` in the Llama layout): eager, its fp32 round trip runs op by op over every
    # position of a micro-batch, forward and backward (its multiplies alone 0.19 s of a profiled bf16 packed step)
    modules.append(getattr(getattr(base, "model", None), "norm", None))
    compiled = 0
    for module in modules:
        if isinstance(module, nn.Module):
            module.compile(dynamic=True)
            compiled += 1
    compile_rotary(base)
    return compiled


def compile_decoder_layers(model: nn.Module) -> int:
    """Compile each decoder layer whole and the stack's final norm in place (`torch.compile`, inductor, dynamic
    shapes); the packed row's attention kernel (`models.varlen_attention`) runs eagerly between the two graphs a
    layer becomes. Returns how many modules. For the learner's packed rows with shared prompts
    (`learner.compile_position_wise` with `pack_sequences` and `share_prompts`), whose forwards pass no KV cache
    through the layers.

    Why: beyond what `compile_position_wise` fuses inside each MLP and norm, a whole layer also fuses the residual
    adds into the norms after them, the rotary embedding into the projections' outputs and the reshapes around
    attention, forward and backward. On the race's bf16 learner step (packed rows, prompts once, AMX Xeon, 2
    threads), alternated in one process: 3.59 s with the position-wise modules and rotary compiled, 3.33 s with
    the layers whole (1.08x, faster in 5 pairs of 5; 3.62 -> 3.20 s in a first run;
    `benchmarks/learner_step.py --compile-layers`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = [*decoder_layers(base), getattr(getattr(base, "model", None), "norm", None)]
    compiled = 0
    for module in modules:
        if isinstance(module, nn.Module):
            module.compile(dynamic=True)
            compiled += 1
    return compiled


def compile_rotary(model: nn.Module) -> list[str]:
    """Replace the rotary-embedding function that `model`'s attention layers call, `apply_rotary_pos_emb` of their
    modeling module (transformers' Llama, Mistral, Qwen and most decoder families look it up there at every call),
    with its `torch.compile`d self (dynamic shapes); returns the modules patched (already patched ones included).

    The replacement is process-wide: every model of that module in this process applies the compiled function (the
    same math, rounded once where eager rounds after each op). Used by the learner, whose process holds the policy
    and its reference only. Why: on the race's bf16 learner step (CPU, 2 threads, MLPs and norms compiled) the
    rotary's multiplies, half rotations and adds over the largest response bucket alone took about 0.7 s of 4.9 in a
    profile; with it compiled, alternated in one process, 5.2-5.8 -> 4.3-4.4 s (two runs); in separate processes
    and in the race the difference is within their run-to-run spread (0-12%)."""
    patched = []
    for layer in decoder_layers(model):
        attention = getattr(layer, "self_attn", None)
        module = sys.modules.get(type(attention).__module__) if attention is not None else None
        fn: Any = getattr(module, "apply_rotary_pos_emb", None)
        if module is None or not callable(fn) or module.__name__ in patched:
            continue
        if not getattr(fn, "looprl_compiled", False):
            compiled = torch.compile(fn, dynamic=True)
            compiled.looprl_compiled, compiled.looprl_original = True, fn
            module.apply_rotary_pos_emb = compiled
        patched.append(module.__name__)
    return patched


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at the dotted `name` inside `model`."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def block_outputs(model: nn.Module, batch: dict[str, torch.Tensor], upto: int | None = None) -> list[torch.Tensor]:
    """The output hidden states of decoder blocks 0..`upto` (all without it) for `batch`; a forward that only needs
    the first blocks stops after block `upto`, so the later ones never run."""
    layers = decoder_layers(model)
    last = len(layers) - 1 if upto is None else upto
    outs: list[torch.Tensor] = []

    def hook(i: int):
        def grab(_m: nn.Module, _a: tuple, out: torch.Tensor | tuple) -> None:
            outs.append(out[0] if isinstance(out, tuple) else out)
            if i == last and upto is not None:
                raise _Stop
        return grab
    handles = [layers[i].register_forward_hook(hook(i)) for i in range(last + 1)]
    try:
        model(**batch, logits_to_keep=1, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return outs


# model_types whose attention is softmax(q·kᵀ·scaling + mask)·v with grouped key/value heads and nothing else (no
# logit soft-capping, no attention sinks): the ones looprl's own attention kernels serve
TEXTBOOK_ATTENTION = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@contextmanager
def attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """While inside, `model`'s attention layers run the function registered as `name` in transformers' attention
    interface (they look their config's `_attn_implementation` up at every call); the model's own is restored on
    exit."""
    config = model.config
    own = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = own
