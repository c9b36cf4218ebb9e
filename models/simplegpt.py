"""SimpleGPT: the Llama architecture with SimpleNorm, a normalization immediately after every linear map inside the
blocks and no pre-norms (arXiv 2602.01212; placement and initialisation as in the released `Ocram7/SimpleGPT` code,
rl/methods/simplegpt/README.md).

    attention:  q = N(W_q x), k = N(W_k x), v = N(W_v x)  (each over the full projected width), RoPE on q and k,
                causal attention, out = N(W_o · attn)
    MLP:        out = N₂(W₂( SiLU(N₁(W₁ x)) ⊙ N₃(W₃ x) ))
    block:      h = x + Attn(x);  y = h + MLP(h)  (the residual stream is not normalised inside blocks)

The final norm before the LM head is kept; N is RMSNorm with a learnable gain (1 at init, eps = `rms_norm_eps`).
Every projection is a `SimpleNormLinear` (an `nn.Linear` whose output passes through its own `norm`), so parameter
names stay Llama's (`q_proj.weight`, plus `q_proj.norm.weight`) and the attention and MLP code is transformers'
own. `model_type: simplegpt`, registered with the Auto classes: `from_pretrained`, `generate` and the `hf` engine
work as for Llama. Not a drop-in for a pretrained Llama checkpoint: the function changes, so it is for training
from scratch or continued pretraining.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

NORM_PLACEMENTS = ("prenorm", "simplenorm")


class SimpleGPTConfig(LlamaConfig):
    """A Llama config whose blocks use SimpleNorm (`norm_placement: simplenorm`)."""

    model_type = "simplegpt"

    def __init__(self, norm_placement: str = "simplenorm", **kwargs):
        if norm_placement != "simplenorm":
            raise ValueError(f"SimpleGPTConfig.norm_placement must be 'simplenorm', got {norm_placement!r} "
                             "(a pre-norm model is a plain Llama)")
        self.norm_placement = norm_placement
        super().__init__(**kwargs)


class SimpleNormLinear(nn.Linear):
    """Ψ(x) = RMSNorm(W x): a linear map whose output is normalised over its full width. `init_std` is the
    released code's initialisation of W (truncated normal)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, eps: float, init_std: float):
        super().__init__(in_features, out_features, bias=bias)
        self.norm = LlamaRMSNorm(out_features, eps=eps)
        self.init_std = init_std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


class SimpleGPTDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with every projection a `SimpleNormLinear` and no pre-norms."""

    def __init__(self, config: SimpleGPTConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        del self.input_layernorm, self.post_attention_layernorm
        std, deep = 0.02, 0.02 / math.sqrt(2 * (layer_idx + 1))  # W_o, W_2 (down), W_3 (up): depth-scaled

        def swap(parent: nn.Module, name: str, init_std: float) -> None:
            old = getattr(parent, name)
            setattr(parent, name, SimpleNormLinear(old.in_features, old.out_features, old.bias is not None,
                                                   config.rms_norm_eps, init_std))
        for name, s in (("q_proj", std), ("k_proj", std), ("v_proj", std), ("o_proj", deep)):
            swap(self.self_attn, name, s)
        for name, s in (("gate_proj", std), ("up_proj", deep), ("down_proj", deep)):
            swap(self.mlp, name, s)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        attn, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(hidden_states)


def _init_simplegpt(module: nn.Module) -> bool:
    """The released initialisation: block projections trunc-normal with their `init_std`, the embedding N(0, 1),
    the LM head trunc-normal with std d^(-1/2) cut at ±3σ, every norm gain 1. False for modules it leaves to
    transformers (the rotary embedding's buffers)."""
    if isinstance(module, SimpleNormLinear):
        nn.init.trunc_normal_(module.weight, std=module.init_std, a=-3 * module.init_std, b=3 * module.init_std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, LlamaRMSNorm):
        nn.init.ones_(module.weight)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=1.0)
    elif isinstance(module, nn.Linear):  # the LM head
        s = module.in_features ** -0.5
        nn.init.trunc_normal_(module.weight, std=s, a=-3 * s, b=3 * s)
    else:
        return False
    return True


class SimpleGPTModel(LlamaModel):
    config_class = SimpleGPTConfig

    def __init__(self, config: SimpleGPTConfig):
        LlamaPreTrainedModel.__init__(self, config)  # LlamaModel's fields, without building Llama's layers first
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([SimpleGPTDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # the final norm is kept
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if not _init_simplegpt(module):
            super()._init_weights(module)


class SimpleGPTForCausalLM(LlamaForCausalLM):
    config_class = SimpleGPTConfig

    def __init__(self, config: SimpleGPTConfig):
        LlamaPreTrainedModel.__init__(self, config)  # LlamaForCausalLM's fields around a SimpleGPTModel
        self.model = SimpleGPTModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if not _init_simplegpt(module):
            super()._init_weights(module)


AutoConfig.register(SimpleGPTConfig.model_type, SimpleGPTConfig, exist_ok=True)
AutoModel.register(SimpleGPTConfig, SimpleGPTModel, exist_ok=True)
AutoModelForCausalLM.register(SimpleGPTConfig, SimpleGPTForCausalLM, exist_ok=True)
