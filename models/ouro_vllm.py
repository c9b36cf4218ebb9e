"""Ouro looped LM for vLLM (out-of-tree model; `register_ouro_with_vllm()` registers it).

vLLM dropped its native Ouro model after 0.26. This one serves the final loop, which is what looprl's
rollout samples (the shipped `early_exit_threshold: 1.0` always exits at the last loop): the shared
stack of `num_hidden_layers` layers runs `total_ut_steps` times with the final RMSNorm after every loop.
Every (loop, layer) pair has its own attention layer, hence its own KV cache, while the projections are
shared; the attention layers are named `model.ut_layers.{loop * num_hidden_layers + layer}.attn`, the
cache slot index of the transformers model (`models/ouro.py`). Checkpoint names are the public Ouro
ones; q/k/v and gate/up are stacked into vLLM's fused projections on load. The exit gate is loaded and
kept (weight sync sends it) but not used for sampling.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix


class OuroVLLMAttention(nn.Module):
    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        quant = vllm_config.quant_config
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=False, quant_config=quant,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False,
                                        quant_config=quant, prefix=f"{prefix}.o_proj")
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=rope, is_neox_style=True)
        sliding = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        n = config.num_hidden_layers
        self.attn = nn.ModuleList(  # one KV cache per loop
            Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, num_kv_heads=self.num_kv_heads,
                      cache_config=vllm_config.cache_config, quant_config=quant, per_layer_sliding_window=sliding,
                      prefix=f"model.ut_layers.{loop * n + layer_idx}.attn")
            for loop in range(config.total_ut_steps))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, loop: int) -> torch.Tensor:
        qkv, _ = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn[loop](q, k, v))
        return out


class OuroVLLMMLP(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        quant = vllm_config.quant_config
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                                       quant_config=quant, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant, prefix=f"{prefix}.down_proj")
        if config.hidden_act != "silu":
            raise NotImplementedError(f"ouro (vllm): hidden_act {config.hidden_act!r} is not supported (silu only)")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act(gate_up))
        return out


class OuroVLLMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = OuroVLLMAttention(config, layer_idx, vllm_config, f"{prefix}.self_attn")
        self.mlp = OuroVLLMMLP(config, vllm_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps=eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, loop: int) -> torch.Tensor:
        h = h + self.input_layernorm_2(self.self_attn(positions, self.input_layernorm(h), loop))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class OuroVLLMModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OuroVLLMDecoderLayer(config, i, vllm_config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        for loop in range(self.config.total_ut_steps):
            for layer in self.layers:
                h = layer(positions, h, loop)
            h = self.norm(h)  # every loop ends normed; the normed state feeds the next loop
        return h


class OuroForCausalLM(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if config.early_exit_threshold < 1.0 or getattr(config, "early_exit_step", None):
            raise NotImplementedError("ouro (vllm) samples from the final loop only; early_exit_threshold < 1 "
                                      "and early_exit_step need the hf engine")
        self.config = config
        self.model = OuroVLLMModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ["lm_head."] if self.config.tie_word_embeddings else None
        return AutoWeightsLoader(self, ignore_unexpected_prefixes=skip).load_weights(weights,
                                                                             mapper=self.hf_to_vllm_mapper)


def register_ouro_with_vllm() -> None:
    """Make `OuroForCausalLM` checkpoints servable by vLLM in this process (and the processes it spawns,
    which import this module by name)."""
    from vllm import ModelRegistry

    import models.ouro  # noqa: F401  (transformers must know model_type ouro to read the config)
    if "OuroForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("OuroForCausalLM", "models.ouro_vllm:OuroForCausalLM")
