"""KV-cache compression policies on the `hf` engine's decode loop (decoding methods with `forward_hooks` and
`kv_policy`): BeaconKV (`beaconkv`, rl/methods/beaconkv/README.md) and the baselines it is measured against, SnapKV
(`kv_snapkv`), H2O (`kv_h2o`), R-KV (`kv_rkv`) and Initial + Recent (`kv_streaming`). The scoring rules live in
`rl.methods.beaconkv.core`; this module reads the model's queries and evicts cache entries.

Every policy keeps, per layer, per KV head and per batch row, the first `sink` and last `recent` tokens and the
`budget` others it scores highest. Once the cache holds more than budget + sink + recent entries it is cut to that
bound minus `interval` − 1, so evictions come every `interval` tokens and the cache never holds more than the
bound between steps. Positions of new tokens keep counting every token (keys keep the RoPE of their own
positions). Each head keeps its own positions; left padding is evicted first.

Queries are read before RoPE (the output of `q_proj`, or of `q_norm` where the attention has one, as in Qwen3) and
rotated here with the model's own rotary embedding: recent queries at their own positions, BeaconKV's beacons at
the current position. `stats` after a call: the largest cache length left by the policy, the number of
evictions, and the peak bytes of the cache's keys and values (in the forward after the policy ran, which adds the
fed token).
"""

from __future__ import annotations

from typing import Any

import torch

from models.blocks import decoder_layers
from rl.methods.beaconkv.core import (
    QueryBuffer,
    attention_probs,
    key_importance,
    rkv_scores,
    rope,
    select_keep,
    snapkv_scores,
)
from rl.registry import register, register_alias


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = decoder_layers(model)
    if not all(hasattr(layer, "self_attn") for layer in layers):
        raise TypeError(f"{type(model).__name__}: KV-cache policies need decoder layers with `self_attn` "
                        f"(Llama-style models)")
    return [layer.self_attn for layer in layers]


class KVPolicy:
    """Shared machinery: query capture, rotation, per-row and per-head eviction. A subclass defines `scores`."""

    def __init__(self, budget: int = 256, sink: int = 4, recent: int = 16, interval: int = 1, window: int = 32):
        if budget < 1 or sink < 0 or recent < 1 or interval < 1 or window < 1:
            raise ValueError(f"{type(self).__name__}: need budget >= 1, sink >= 0, recent >= 1, interval >= 1, "
                             f"window >= 1 (got {budget}, {sink}, {recent}, {interval}, {window})")
        if interval > budget:
            raise ValueError(f"{type(self).__name__}: interval {interval} is larger than the budget {budget}")
        self.budget, self.sink, self.recent, self.interval, self.window = budget, sink, recent, interval, window
        self.stats: dict[str, Any] = {}

    @property
    def bound(self) -> int:
        return self.budget + self.sink + self.recent

    # -- queries ---------------------------------------------------------------------------------------------
    def forward_hooks(self, model: torch.nn.Module, state: Any) -> list[Any]:
        attns = _attention_modules(model)
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads = cfg.num_attention_heads
        self.rotary = model.model.rotary_emb
        state.scratch["kv"] = {"layers": [self.new_layer_state() for _ in attns], "max_cache": 0, "evictions": 0,
                               "peak_bytes": 0}
        handles = []
        for index, attn in enumerate(attns):
            source = attn.q_norm if getattr(attn, "q_norm", None) is not None else attn.q_proj

            def hook(_m: torch.nn.Module, _a: tuple, out: torch.Tensor, index: int = index) -> None:
                B, T = out.shape[0], out.shape[1]
                q = out.detach().float().reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
                fed = state.attention_mask[:, -T:].bool()
                self.observe(state.scratch["kv"]["layers"][index], q, state.positions, fed)
            handles.append(source.register_forward_hook(hook))
        return handles

    def new_layer_state(self) -> dict[str, Any]:
        return {"q": None, "pos": None}

    def observe(self, layer: dict[str, Any], q: torch.Tensor, positions: torch.Tensor, fed: torch.Tensor) -> None:
        """Keep the last `window` fed queries of each row (pre-RoPE) and their positions."""
        keep_q, keep_p = [], []
        for b in range(q.shape[0]):
            old_q = layer["q"][b] if layer["q"] is not None else q.new_zeros(self.n_heads, 0, self.head_dim)
            old_p = layer["pos"][b] if layer["pos"] is not None else positions.new_zeros(0)
            keep_q.append(torch.cat([old_q, q[b][:, fed[b]]], 1)[:, -self.window:])
            keep_p.append(torch.cat([old_p, positions[b][fed[b]]])[-self.window:])
        layer["q"], layer["pos"] = keep_q, keep_p

    def rotate(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE of `q [H, n, D]` at `positions [n]` with the model's rotary embedding."""
        cos, sin = self.rotary(q.new_zeros(1, 1, self.head_dim), positions[None].long())
        return rope(q, cos[0].float(), sin[0].float())

    def recent_queries(self, layer: dict[str, Any], b: int, n: int) -> torch.Tensor:
        return self.rotate(layer["q"][b][:, -n:], layer["pos"][b][-n:])

    # -- eviction --------------------------------------------------------------------------------------------
    def scores(self, layer: dict[str, Any], b: int, keys: torch.Tensor, valid: torch.Tensor, state: Any) -> torch.Tensor:
        raise NotImplementedError

    def after_step(self, layer: dict[str, Any], b_keys: list[torch.Tensor], valid: torch.Tensor, state: Any) -> None:
        """Per-step bookkeeping before eviction (H2O accumulates attention here)."""

    def kv_policy(self, cache: Any, state: Any) -> None:
        kv = state.scratch["kv"]
        S = cache.get_seq_length()
        valid = state.attention_mask[:, :S].bool()
        for index, cl in enumerate(cache.layers):
            self.after_step(kv["layers"][index], [cl.keys[b] for b in range(cl.keys.shape[0])], valid, state)
        if S > self.bound:
            keep = self.bound - (self.interval - 1)
            new_mask = None
            for index, cl in enumerate(cache.layers):
                layer = kv["layers"][index]
                idx = torch.stack([select_keep(self.scores(layer, b, cl.keys[b], valid[b], state),
                                               keep - self.sink - self.recent, self.sink, self.recent, valid[b])
                                   for b in range(cl.keys.shape[0])])  # [B, Hkv, K]
                gather = idx[..., None].expand(-1, -1, -1, cl.keys.shape[-1]).to(cl.keys.device)
                cl.keys, cl.values = cl.keys.gather(2, gather), cl.values.gather(2, gather)
                self.evicted(layer, idx)
                if new_mask is None:  # kept padding is the same leftmost entries in every head and layer
                    new_mask = state.attention_mask.gather(1, idx[:, 0].to(state.attention_mask.device))
            state.attention_mask = new_mask
            kv["evictions"] += 1
        length = cache.get_seq_length()
        kv["max_cache"] = max(kv["max_cache"], length)
        # the peak comes in the next forward, which appends the token it feeds to what is left here
        kv["peak_bytes"] = max(kv["peak_bytes"], sum(cl.keys.numel() * cl.keys.element_size() * 2
                                                     for cl in cache.layers) * (length + 1) // length)
        self.stats = {k: kv[k] for k in ("max_cache", "evictions", "peak_bytes")}

    def evicted(self, layer: dict[str, Any], idx: torch.Tensor) -> None:
        """Per-key state to cut along with the cache (`idx [B, Hkv, K]`)."""


@register("decoding", "kv_streaming")
class StreamingKV(KVPolicy):
    """Initial + Recent (StreamingLLM): the first `sink` tokens and the newest others."""

    def scores(self, layer, b, keys, valid, state):
        return torch.arange(keys.shape[1], dtype=torch.float32)[None].expand(keys.shape[0], -1)


@register("decoding", "kv_snapkv")
class SnapKV(KVPolicy):
    """SnapKV: attention of the last `window` queries, summed, max-pooled along the sequence (`kernel`)."""

    def __init__(self, budget: int = 256, sink: int = 4, recent: int = 16, interval: int = 1, window: int = 32,
                 kernel: int = 7):
        super().__init__(budget, sink, recent, interval, window)
        self.kernel = kernel

    def scores(self, layer, b, keys, valid, state):
        return snapkv_scores(self.recent_queries(layer, b, self.window), keys, valid, self.kernel)


@register("decoding", "kv_rkv")
class RKV(KVPolicy):
    """R-KV: λ · attention of the recent queries − (1 − λ) · redundancy (mean cosine similarity to other keys)."""

    def __init__(self, budget: int = 256, sink: int = 4, recent: int = 16, interval: int = 1, window: int = 32,
                 lam: float = 0.1):
        super().__init__(budget, sink, recent, interval, window)
        self.lam = lam

    def scores(self, layer, b, keys, valid, state):
        return rkv_scores(self.recent_queries(layer, b, self.window), keys, valid, self.lam)


@register("decoding", "kv_h2o")
class H2O(KVPolicy):
    """H2O: heavy hitters by the attention every query so far gave each key (accumulated over the GQA group)."""

    def new_layer_state(self):
        return {"q": None, "pos": None, "acc": None, "seen": 0}

    def after_step(self, layer, b_keys, valid, state):
        n_new = state.positions.shape[1]  # the queries of the last forward (the prefill, then one per step)
        S = b_keys[0].shape[1]
        acc = layer["acc"]
        if acc is None:
            acc = torch.zeros(len(b_keys), b_keys[0].shape[0], S)
        elif acc.shape[-1] < S:
            acc = torch.cat([acc, acc.new_zeros(*acc.shape[:2], S - acc.shape[-1])], -1)
        for b, keys in enumerate(b_keys):
            n = min(n_new, layer["q"][b].shape[1])
            q = self.recent_queries(layer, b, n)  # the last n fed queries: those of cache columns S - n .. S - 1
            # causal: query i (column S - n + i) saw the keys up to its own column
            seen = valid[b][None, :] & (torch.arange(S)[None, :] <= torch.arange(S - n, S)[:, None])
            probs = torch.stack([attention_probs(q[:, i:i + 1], keys, seen[i])[:, 0] for i in range(n)], 1)
            hkv = keys.shape[0]
            acc[b] += probs.sum(1).view(hkv, -1, S).sum(1)
        layer["acc"] = acc

    def scores(self, layer, b, keys, valid, state):
        return layer["acc"][b]

    def evicted(self, layer, idx):
        layer["acc"] = layer["acc"].gather(2, idx)


@register("decoding", "beaconkv")
class BeaconKV(KVPolicy):
    """BeaconKV: importance = max over the last `n_recent_queries` queries (their own positions) and `n_beacon`
    beacons (FPS picks from each head's bounded pre-RoPE query buffer, `buffer_upper` → `buffer_lower`, rotated at
    the current position) and over the GQA group of the attention probability on each key."""

    def __init__(self, budget: int = 256, sink: int = 4, recent: int = 16, interval: int = 1,
                 n_recent_queries: int = 16, n_beacon: int = 16, buffer_upper: int = 256, buffer_lower: int = 64):
        super().__init__(budget, sink, recent, interval, window=n_recent_queries)
        self.n_recent_queries, self.n_beacon = n_recent_queries, n_beacon
        self.buffer_upper, self.buffer_lower = buffer_upper, buffer_lower

    def new_layer_state(self):
        return {"q": None, "pos": None, "buffers": None}

    def observe(self, layer, q, positions, fed):
        super().observe(layer, q, positions, fed)
        if layer["buffers"] is None:
            layer["buffers"] = [QueryBuffer(self.buffer_upper, self.buffer_lower) for _ in range(q.shape[0])]
        for b, buf in enumerate(layer["buffers"]):
            if fed[b].any():
                buf.add(q[b][:, fed[b]])

    def scores(self, layer, b, keys, valid, state):
        current = state.positions[b, -1:].expand(self.n_beacon)
        beacons = layer["buffers"][b].beacons(self.n_beacon)
        beacons = self.rotate(beacons, current[:beacons.shape[1]])
        obs = torch.cat([self.recent_queries(layer, b, self.n_recent_queries), beacons], 1)
        return key_importance(obs, keys, valid)

register_alias("decoding", "kv_beacon", "beaconkv")
