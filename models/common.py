"""Pieces the model classes share."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For left-padded prompt rows `[N, P]`: a row carrying each distinct prompt (`first [G]`, the lowest index) and
    each row's prompt among those (`inverse [N]`), so that `prompt_ids[first][inverse]` equals the real tokens of
    `prompt_ids`. GRPO samples every prompt n times; what depends on the prompt alone runs G times, not N."""
    mask = prompt_mask.long()
    key = torch.cat([prompt_ids * mask, mask], 1)  # pad ids do not split a prompt
    inverse = torch.unique(key, dim=0, return_inverse=True)[1]
    return first_rows(inverse), inverse


def first_rows(groups: torch.Tensor) -> torch.Tensor:
    """For each row's group `groups [N]` (ids 0..G-1, each present): the lowest row index of each group, `[G]`."""
    first = torch.full((int(groups.max()) + 1,), len(groups), dtype=torch.long, device=groups.device)
    return first.scatter_reduce(0, groups, torch.arange(len(groups), device=groups.device), "amin")


def length_buckets(lengths: list[int], max_padding: float, min_tokens: int = 0) -> list[list[int]]:
    """Indices grouped to run at their group's longest length: longest first, a group closed when one more would
    make its padded size (count × its longest) exceed `1 + max_padding` times its real size, unless it holds fewer
    than `min_tokens` in all."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    buckets: list[list[int]] = []
    real = 0
    for i in order:
        if buckets and (real < min_tokens or
                        (len(buckets[-1]) + 1) * lengths[buckets[-1][0]] <= (1 + max_padding) * (real + lengths[i])):
            buckets[-1].append(i)
            real += lengths[i]
        else:
            buckets.append([i])
            real = lengths[i]
    return buckets


def init_weights(module: nn.Module, std: float, norm_types: tuple[type, ...]) -> None:
    """transformers' `_init_weights` for a Llama-style model: linear and embedding weights ~ N(0, std), linear biases
    0, the weights of norms of `norm_types` 1."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, norm_types):
        nn.init.ones_(module.weight)


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> float:
    """Bytes of one cached position's keys and values over all layers (and all loops of a looped model, which
    caches each loop apart), from a transformers config; 0 where it does not name its layers and heads."""
    heads, layers = getattr(config, "num_attention_heads", None), getattr(config, "num_hidden_layers", None)
    if not (heads and layers and getattr(config, "hidden_size", None)):
        return 0.0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return float(2 * layers * getattr(config, "total_ut_steps", 1) * kv_heads * head_dim * dtype_bytes)
