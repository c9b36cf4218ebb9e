"""What a model takes in memory, from its `config.json` alone (no weights): its parameters, the bytes of its
activations per token in a training forward, of its KV cache per token, and of a LoRA adapter.

The parameter count is exact when transformers can build the architecture on the meta device (no memory is
allocated); otherwise (a model whose code is not installed, e.g. a folder with only the config of a
`trust_remote_code` model) it comes from the formula of a Llama-style decoder (`formula_params`: attention with
grouped KV heads, a gated MLP or a mixture of experts, norms, embeddings, tied or not).

Activations per token and layer, in elements of the compute dtype, are what a transformers decoder layer keeps for
its backward with a fused attention kernel (sdpa, flash: no [T, T] scores): 8h + 2·kv + 4·w + 512 (h the hidden
size, kv the key/value width, w the MLP width a token goes through; for a mixture of experts the experts it is
routed to): the two norms' inputs and outputs (4h), q (h) and k, v (2·kv), the attention output and the output
projection's input (2h), the residual (h), the MLP's gate, up, activation and product (4w), and a few hundred
elements of masks and positions. Measured on the CPU in float32 (widths 128-768, MLP widths 512-3072, 3-14 layers:
within 3%; the number of heads does not enter); tests/cluster/test_plan.py checks a whole training step. The
backward adds about half a layer's activations of working memory (the gradients flowing through a layer). Under
gradient checkpointing a layer keeps only its input (h) and one layer at a time holds the rest while it is
recomputed. A looped model (Ouro) runs its layers `total_ut_steps` times: activations and KV cache scale with the
loops. These are estimates of what the framework's kernels keep, checked against measured peaks in the tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The figures of a model that decide its memory (see the module docstring)."""
    model_type: str
    params: int  # every parameter, tied weights once
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int  # the MLP width one token goes through (a mixture of experts: its routed experts and shared ones)
    vocab: int
    loops: int = 1  # passes over the layers (a looped model's total_ut_steps)
    counted: str = "meta"  # meta: counted on the model built on the meta device | formula: `formula_params`
    linear_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # per-layer linear: (in, out)


def load_model_config(source: str | Path | dict[str, Any], trust_remote_code: bool = False) -> dict[str, Any]:
    """The config as a dict: given as one, a `config.json` file, a folder holding one, or a hub id whose config is
    in the local cache (nothing is downloaded)."""
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if path.is_file():
        return json.loads(path.read_text())
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(str(source), local_files_only=True,
                                          trust_remote_code=trust_remote_code).to_dict()
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"{source}: no config.json there and none cached for a hub id of that name "
                                f"(a plan needs only that file: put it in a folder)") from err


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config") or cfg


def _experts(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """(experts, experts per token, expert width, shared-expert width) of a mixture-of-experts MLP; (0, ...) if none."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if not experts:
        return 0, 0, 0, 0
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * width
    return int(experts), int(cfg.get("num_experts_per_tok") or 1), int(width), int(shared)


def formula_params(cfg: dict[str, Any]) -> int:
    """A Llama-style decoder's parameters: per layer q, k, v, o (with biases where the config says, Qwen2's q/k/v
    always), a gated MLP (or routed experts with their router and shared experts), two norms (and Qwen3's q/k norms);
    embeddings, the output head unless tied, the final norm."""
    c = _text_config(cfg)
    h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    kv, d = int(c.get("num_key_value_heads") or heads), int(c.get("head_dim") or h // heads)
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    if c.get("attention_bias") or c.get("model_type") == "qwen2":
        attn += heads * d + 2 * kv * d + (heads * d if c.get("attention_bias") else 0)
    experts, _, width, shared = _experts(c)
    mlp = (experts * 3 * h * width + h * experts + 3 * h * shared + (h if shared else 0) if experts
           else 3 * h * int(c["intermediate_size"]))
    norms = 2 * h + (2 * d if c.get("model_type", "").startswith("qwen3") else 0)
    vocab = int(c["vocab_size"])
    head = 0 if c.get("tie_word_embeddings", False) else vocab * h
    return int(c["num_hidden_layers"]) * (attn + mlp + norms) + vocab * h + head + h


def _meta_params(cfg: dict[str, Any], trust_remote_code: bool) -> int | None:
    """The parameter count of the architecture built on the meta device, or None when transformers cannot build it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        config = AutoConfig.for_model(**cfg) if "model_type" in cfg else None
        if config is None:
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, ImportError, OSError, TypeError):
        return None
    return sum(p.numel() for p in model.parameters())


def model_shape(source: str | Path | dict[str, Any], trust_remote_code: bool = False) -> ModelShape:
    """The `ModelShape` of a model from its config (see `load_model_config` for the sources)."""
    cfg = load_model_config(source, trust_remote_code)
    c = _text_config(cfg)
    h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    kv, d = int(c.get("num_key_value_heads") or heads), int(c.get("head_dim") or h // heads)
    experts, per_token, width, shared = _experts(c)
    mlp_width = per_token * width + shared if experts else int(c["intermediate_size"])
    meta = _meta_params(cfg, trust_remote_code)
    linear = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h)}
    if not experts:
        i = int(c["intermediate_size"])
        linear.update(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))
    return ModelShape(model_type=str(c.get("model_type", "")), params=meta if meta is not None else formula_params(cfg),
                      layers=int(c["num_hidden_layers"]), hidden=h, heads=heads, kv_heads=kv, head_dim=d,
                      mlp_width=mlp_width, vocab=int(c["vocab_size"]), loops=int(c.get("total_ut_steps") or 1),
                      counted="meta" if meta is not None else "formula", linear_shapes=linear)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """A token's keys and values in every layer (and every loop of a looped model)."""
    return 2 * shape.layers * shape.loops * shape.kv_heads * shape.head_dim * dtype_bytes


def layer_activation_elements(shape: ModelShape) -> int:
    """Elements one decoder layer keeps per token for its backward (fused attention; see the module docstring)."""
    return 8 * shape.hidden + 2 * shape.kv_heads * shape.head_dim + 4 * shape.mlp_width + 512


CHECKPOINTED_LAYER_ELEMENTS = 1  # per token, times the hidden size: a checkpointed layer keeps its input


def activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
    """Activations of a training forward over `tokens` tokens (one micro-batch, one rank): every layer's (and loop's)
    with all kept, or each layer's input plus one layer recomputed at a time under gradient checkpointing."""
    passes = shape.layers * shape.loops
    per_layer = layer_activation_elements(shape) * tokens * dtype_bytes
    if checkpointing:
        return passes * CHECKPOINTED_LAYER_ELEMENTS * shape.hidden * tokens * dtype_bytes + per_layer
    return passes * per_layer


def logit_bytes(shape: ModelShape, chunk_tokens: int) -> int:
    """The vocabulary projection of one chunk of tokens in float32: logits, their log-softmax and its gradient."""
    return 3 * chunk_tokens * shape.vocab * 4


def lora_params(shape: ModelShape, r: int, targets: str | list[str] = "all-linear") -> int:
    """A LoRA adapter's parameters: r·(in + out) per targeted linear layer (`all-linear`: every one of a layer's
    attention and MLP projections that `linear_shapes` knows)."""
    names = list(shape.linear_shapes) if targets == "all-linear" else [t for t in targets if t in shape.linear_shapes]
    return shape.layers * sum(r * sum(shape.linear_shapes[n]) for n in names)
