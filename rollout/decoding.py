"""Decoding methods (registry kind `decoding`): hooks on the `hf` engine's own decode loop.

A decoding method is a class, built as `Cls(**params)` once per engine and per choice of params, whose
optional methods the loop calls (each receives the `DecodeState` of the batch being decoded):

* `process_logits(logits [B, V], state) -> logits`: before temperature / top-k / top-p, so that the
  sampled token's logprob is that of the fully processed distribution (as the engines report it).
* `residual_hooks(model) -> {layer_index: fn(hidden [B, T, H], state) -> hidden}`: forward hooks on the
  output of decoder layers (the residual stream), for the prefill and every decode step.
* `forward_hooks(model, state) -> list[handle]`: any other hooks on the model's modules (e.g. reading each
  attention layer's queries), registered before the prefill and removed when the call ends.
* `kv_policy(cache, state) -> None`: between steps, may evict or compress cache entries; it changes the
  cache's key/value tensors along the sequence dimension and `state.attention_mask` to match (see
  `keep_cache_positions`). Positions of new tokens keep counting real tokens, whatever was evicted.
* `insert(state) -> list[list[int]] | None`: after a token is sampled, token ids to append to some rows'
  responses (one list per row, empty for none). They are fed to the model together with the next step's
  input (re-prefill of the inserted span), are marked in the batch's `observation_mask` (never trained on)
  and have logprob 0. It is also called once after the prefill, before the first token (`state.step` 0), where
  what it returns is fed at once.
* `state.lookahead(n) -> [B][n]`: available to the hooks, the greedy continuation of `n` tokens of every row
  from the current state (after the token just sampled), the cache and mask restored afterwards: a peek at what
  the model is about to write; it costs `n` forward tokens per row.

`plain` is the loop with no hooks: greedy tokens and logprobs equal to transformers' `generate`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from models.adapters import has_sequence_state, restore_sequence_state, sequence_state
from models.blocks import decoder_layers
from models.common import distinct_prompts
from models.sampling import penalize_repeats, warp_logits  # noqa: F401  (the sampling distribution, shared with the learner)
from rl.batch import pad_token_rows
from rl.registry import register
from rollout.compiled_decode import (
    CompileFailed,
    StaticDecodeCache,
    bucket_capacity,
    compiled_decode_blocker,
    compiled_step,
    fewer_rows,
    warn_once,
)
from rollout.fused_attention import applies as fused_attention_applies
from rollout.fused_attention import fused_decode_attention, share_prompt_reads
from rollout.packed_linear import packed_linear_weights


@dataclass
class DecodeState:
    """What the hooks see: the prompt, the response so far, which rows are done, the step index."""
    prompt_ids: torch.Tensor  # [B, P] left-padded
    attention_mask: torch.Tensor  # [B, S] over the cache's entries plus the tokens being fed
    responses: list[list[int]]  # per row, the response ids so far (inserted ones included)
    inserted: list[list[bool]]  # per row, whether each response token was inserted
    finished: torch.Tensor  # [B] bool
    step: int = 0  # decode steps done
    tokenizer: Any = None
    positions: torch.Tensor | None = None  # [B, k] the position ids of the tokens being fed (their index in the sequence)
    lookahead: Any = None  # fn(n) -> per row, the greedy next n tokens from here (nothing committed); set by `decode`
    scratch: dict = field(default_factory=dict)  # per-call state a method may keep


@register("decoding", "plain")
class Plain:
    """No hooks: the project's decode loop as it is."""


def install_residual_hooks(model: torch.nn.Module, method: Any, state: DecodeState) -> list[Any]:
    """Register the `method`'s residual-stream hooks (if it has any) as forward hooks on the model's decoder layers;
    returns the handles (`.remove()` each when done)."""
    residual = getattr(method, "residual_hooks", None)
    if residual is None:
        return []
    layers, hooks = decoder_layers(model), []
    for index, fn in residual(model).items():
        def hook(_module, _inputs, output, fn: Callable = fn):
            if isinstance(output, tuple):
                return (fn(output[0], state), *output[1:])
            return fn(output, state)
        hooks.append(layers[index].register_forward_hook(hook))
    return hooks


def _truncate_cache(cache: Any, length: int) -> None:
    """Drop every cache entry after the first `length` (the write position moves back with it)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


def keep_cache_positions(cache: Any, state: DecodeState, keep: torch.Tensor) -> None:
    """Keep only the cache entries at sequence positions `keep` (1-D indices, shared by the batch) in every
    layer, and the attention mask with them: the building block of eviction policies."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(-2, keep.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, keep.to(layer.values.device))
    state.attention_mask = state.attention_mask.index_select(1, keep.to(state.attention_mask.device))


class KVBuffers:
    """Storage for the decode loop's KV cache kept from one generate to the next (the `hf` engine holds one, on CPU).

    Why: on CPU every generate otherwise allocates its cache anew, and a fresh buffer's first writes fault its
    pages in: a 128-row bf16 generate of the race's 85M model touched about 120,000 fresh pages, 0.5-0.8 s of a
    4.5 s generate on an AVX-512/AMX machine; with the storage reused, about 5,000 (`benchmarks/decode_step.py`).
    (CUDA's caching allocator already reuses its memory: the engine keeps none there.)

    Each cache layer (its index in the cache: `slot`) has two flat buffers for its keys and two for its values,
    each as large as the largest the layer has asked for; a layer that selects its rows or grows its room reads
    from the side it holds and writes into the other. What a buffer held before is stale but finite (the unfilled
    columns are masked). One decode at a time uses them: `claim`. The compiled decode step's static caches
    (`rollout.compiled_decode.StaticDecodeCache`, one per (model, rows, capacity, dtype)) are kept here too: reused,
    their addresses stay those the graph (on a GPU, the CUDA graph) was captured with."""

    def __init__(self) -> None:
        self._flat: dict[tuple[int, str, int], torch.Tensor] = {}
        self.static: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def take(self, slot: int, role: str, side: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A `shape` view of the (`slot`, `role`, `side`) buffer, grown (zeros) when too small or of another dtype."""
        n = math.prod(shape)
        key = (slot, role, side)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < n or flat.dtype != like.dtype or flat.device != like.device:
            flat = self._flat[key] = torch.zeros(n, dtype=like.dtype, device=like.device)
        return flat[:n].view(shape)

    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self._flat.values())
                + sum(cache.nbytes() for cache in self.static.values()))

    def clear(self) -> None:
        self._flat.clear()
        self.static.clear()

    @contextmanager
    def claim(self) -> Iterator[KVBuffers]:
        """These buffers for one decode; while another decode holds them, a fresh `KVBuffers` (kept by no one)."""
        if not self._lock.acquire(blocking=False):
            yield KVBuffers()
            return
        try:
            yield self
        finally:
            self._lock.release()


class ReservedLayer(DynamicLayer):
    """A KV-cache layer that writes into buffers with room for `capacity` positions and exposes the filled part
    as views (`keys`, `values`), so a decode step appends in place instead of copying the whole cache
    (transformers' `DynamicLayer` concatenates every step: a quadratic copy over a response). A policy that
    replaces `keys`/`values` (`keep_cache_positions`) is picked up on the next write.

    With `full_view`, attention reads the whole buffers (zeros past the filled part, which the attention mask
    masks: transformers pads the 2-D mask to the length `get_mask_sizes` reports, as for its static cache).
    The filled part is a strided view of the buffers, and a CPU batched matmul in bf16/fp16 copies a strided
    operand before multiplying: at 128 rows that copy cost about twice the attention itself, more than the
    unfilled columns that the whole buffers add (`benchmarks/decode_step.py`). The plain loop turns it on for
    half precision on CPU only, where no hook reads attention shapes, and not under the fused kernel
    (`rollout.fused_attention`): fp32 kernels on CPU, CUDA's and the fused kernel read the strided view as it is,
    and the extra columns would cost (the fused kernel is bound by the cache's reads: on an AVX-512/AMX CPU the
    strided views made a 128-row bf16 generate 5.5 -> 4.9 s)."""

    def __init__(self, capacity: int, full_view: bool = False, buffers: KVBuffers | None = None, slot: int = 0
                 ) -> None:
        super().__init__()
        self.capacity = capacity
        self.full_view = full_view
        self.buffers, self.slot = buffers, slot  # storage reused across generates (`KVBuffers`), this layer's index
        self._side: int | None = None  # which of its two sides of `buffers` the layer holds
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def _new_buffers(self, shape: tuple[int, ...], like_k: torch.Tensor, like_v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value buffers of `shape`: fresh zeros, or the side of `buffers` this layer does not hold."""
        if self.buffers is None:
            # zeros, not empty: unfilled columns are read (and masked) under `full_view`; they must be finite
            return like_k.new_zeros(shape), like_v.new_zeros(shape)
        self._side = 0 if self._side is None else 1 - self._side
        return (self.buffers.take(self.slot, "k", self._side, shape, like_k),
                self.buffers.take(self.slot, "v", self._side, shape, like_v))

    def _owns(self) -> bool:
        """The filled part is a view of this layer's own buffers (not one a policy replaced)."""
        n = self.keys.shape[-2] if self.is_initialized and self.keys.numel() else 0
        return (self._k is not None and n > 0 and self.keys.data_ptr() == self._k.data_ptr()
                and self.keys.shape[:2] == self._k.shape[:2])

    def _owns_room(self, new: int) -> bool:
        """`_owns`, with room for `new` more positions."""
        return self._owns() and self.keys.shape[-2] + new <= self._k.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.full_view and self._owns_room(query_length):
            return self._k.shape[-2], 0
        return super().get_mask_sizes(query_length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.numel() else 0
        need = n + key_states.shape[-2]
        fits = self._owns_room(key_states.shape[-2])  # as `get_mask_sizes` saw it before this forward
        if not fits:  # first write, a replaced cache, or out of room
            self.capacity = max(self.capacity, 2 * need if self._owns() else need)
            shape = (*key_states.shape[:2], self.capacity, key_states.shape[-1])
            k_buf, v_buf = self._new_buffers(shape, key_states, value_states)
            if n:
                k_buf[:, :, :n], v_buf[:, :, :n] = self.keys, self.values
            self._k, self._v = k_buf, v_buf
        self._k[:, :, n:need] = key_states
        self._v[:, :, n:need] = value_states
        self.keys, self.values = self._k[:, :, :need], self._v[:, :, :need]
        if self.full_view and fits:
            return self._k, self._v
        return self.keys, self.values

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows `index` (repeats allowed) of the cache, with the same room. Only the filled positions
        are copied (the prompt's few after a shared prefill, about half the room when ended rows are dropped: the
        rest was never written); past them the new buffers hold finite values (zeros, or a reused buffer's stale
        ones), as `_new_buffers` gives them, which the attention mask masks."""
        n = self.keys.shape[-2]
        k_buf, v_buf = self._new_buffers((len(index), *self._k.shape[1:]), self._k, self._v)
        torch.index_select(self._k[:, :, :n], 0, index, out=k_buf[:, :, :n])
        torch.index_select(self._v[:, :, :n], 0, index, out=v_buf[:, :, :n])
        self._k, self._v = k_buf, v_buf
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]


# cache layers whose per-row state is their keys and values alone (`_prefill_shared` copies rows of these)
COPYABLE_LAYERS = (ReservedLayer, DynamicLayer, DynamicSlidingWindowLayer)


def reserved_cache(capacity: int, full_view: bool = False, buffers: KVBuffers | None = None) -> Any:
    """A `DynamicCache` whose layers are `ReservedLayer`s with room for `capacity` positions (`full_view`: attention
    reads their whole buffers; `buffers`: their storage, reused across generates)."""
    cache = DynamicCache()
    made = iter(range(1 << 30))  # the layers' slots, in the order the model creates them
    cache.layer_class_to_replicate = lambda: ReservedLayer(capacity, full_view, buffers, next(made))
    return cache


def _feed(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, next_pos: torch.Tensor, state: DecodeState,
          cache: Any, forward_kwargs: dict) -> torch.Tensor:
    """Feed a block `ids [B, k]` (left-padded by `mask [B, k]`) after the cache; returns the last column's
    logits `[B, V]`. Positions continue each row's count of real tokens."""
    state.attention_mask = torch.cat([state.attention_mask, mask], 1)
    pos = (next_pos[:, None] + mask.cumsum(-1) - 1).clamp(min=0)
    state.positions = pos
    out = model(input_ids=ids, attention_mask=state.attention_mask, position_ids=pos, past_key_values=cache,
                use_cache=True, **forward_kwargs)
    next_pos += mask.sum(-1)
    return out.logits[:, -1].float()


def _prefill_shared(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, next_pos: torch.Tensor,
                    state: DecodeState, cache: Any, forward_kwargs: dict, new_cache: Callable[[], Any]
                    ) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """`_feed` of the prompts into the empty `cache` when rows repeat a prompt (GRPO's n samples per prompt): the
    forward runs once per distinct (left-padded) prompt and its cache rows and last logits are copied to the rows
    that repeat it. Each row's numbers are those of its own forward (a row's result does not depend on the other
    rows of the batch). Returns the logits, the cache (a `new_cache()` if the fallback below ran) and each row's
    prompt (`distinct_prompts`' inverse) when rows were copied from one forward, else None."""
    first, inverse = distinct_prompts(prompt_ids, prompt_mask)
    if len(first) == len(prompt_ids):
        return _feed(model, prompt_ids, prompt_mask, next_pos, state, cache, forward_kwargs), cache, None
    mask = prompt_mask.long()
    attention_mask = torch.cat([state.attention_mask, mask], 1)
    positions = (next_pos[:, None] + mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompt_ids[first], attention_mask=attention_mask[first], position_ids=positions[first],
                past_key_values=cache, use_cache=True, **forward_kwargs)
    if not all(type(layer) in COPYABLE_LAYERS for layer in cache.layers):
        # a cache layer of another kind may hold more than keys and values per row: prefill every row instead
        cache = new_cache()
        return _feed(model, prompt_ids, prompt_mask, next_pos, state, cache, forward_kwargs), cache, None
    for layer in cache.layers:  # ReservedLayers (`reserved_cache`), or a model's own (Ouro's slot per loop)
        if isinstance(layer, ReservedLayer):
            layer.select_rows(inverse)
        elif layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse)
    state.attention_mask, state.positions = attention_mask, positions
    next_pos += mask.sum(-1)
    return out.logits[:, -1].float()[inverse], cache, inverse


def sample_rows(probs: torch.Tensor, live: torch.Tensor, batch_size: int) -> torch.Tensor:
    """One token per row of `probs [len(live), V]`, the rows `live` of a batch of `batch_size`: what
    `torch.multinomial(probs, 1)` draws (the argmax of the probabilities over exponential noise, its own
    one-sample path), with the noise drawn for every row of the batch and the live rows' taken, so that a row's
    token does not depend on which other rows are still decoding (with every row live: the same tokens as
    `torch.multinomial` from the same generator state)."""
    noise = torch.empty((batch_size, probs.shape[-1]), dtype=probs.dtype, device=probs.device).exponential_()
    if len(live) < batch_size:
        noise = noise.index_select(0, live)
    return (probs / noise).argmax(-1)


# the plain loop drops the rows that have ended once they are at least this share of the rows it runs
COMPACT_SHARE = 1 / 8


def compaction(alive: torch.Tensor, cache: Any) -> torch.Tensor | None:
    """The rows to keep (`alive [b]`: which of the loop's `b` rows still decode), with the cache's rows kept in
    place, when the ended ones are at least `COMPACT_SHARE` of them and every cache layer is a `ReservedLayer`
    (whose rows it can select); None, and nothing changed, otherwise."""
    ended = len(alive) - int(alive.sum())
    if ended == 0 or ended < COMPACT_SHARE * len(alive):
        return None
    if not all(isinstance(layer, ReservedLayer) and layer.is_initialized for layer in cache.layers):
        return None
    keep = alive.nonzero().flatten()
    for layer in cache.layers:
        layer.select_rows(keep)
    return keep


@torch.no_grad()
def decode(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
           temperature: float, top_k: int, top_p: float, eos_token_id: int, pad_token_id: int,
           method: Any = None, tokenizer: Any = None, stop: list[str] | None = None,
           forward_kwargs: dict | None = None, fused_attention: bool = False, packed_weights: bool = False,
           kv_buffers: KVBuffers | None = None, repetition_penalty: float = 1.0,
           between_steps: Any = None, compiled: bool = False, fp32_packing: str = "auto"
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample until each row ends (EOS, a stop string) or its response, inserted tokens included, holds
    `max_new_tokens` tokens, with a KV cache and the `method`'s hooks.

    Returns `(response_ids [B, L], logp [B, L], lengths [B], inserted [B, L], ended [B])`, right-padded
    with `pad_token_id`; `lengths` count up to and including EOS (or the end of a stop string); `ended`
    is true for rows that ended by EOS or a stop string (not by the length cap).

    `fused_attention`: the plain loop on CPU runs its one-query attention steps with the compiled kernel of
    `rollout.fused_attention` (architectures and the smallest batch listed there; others decode as they are).
    `packed_weights`: on CPU, the model's linear layers multiply with their weights packed once for the whole loop
    (`rollout.packed_linear`; fp32 and bf16; `fp32_packing`: fp32 weights' layout, `auto`, `mkl` or `onednn`,
    `rollout.packed_linear.resolve_fp32_packing`). The plain loop drops the rows that ended from the batch it runs
    (`compaction`); they sample the same tokens as if they had stayed (`sample_rows`). `kv_buffers`: the KV
    cache's storage, reused from the caller's earlier generates (`KVBuffers`, claimed by the caller).
    `repetition_penalty`: `models.sampling.penalize_repeats` over each row's prompt and response tokens, before
    temperature and truncation (as transformers and vLLM order them); the recorded logprobs are the penalised
    distribution's, the one the tokens were drawn from. `between_steps(s)`: called after the tokens of step `s`
    (0: the prefill's) are sampled and before the next forward, which may change the model's weights in place
    (in-flight weight updates): the tokens of steps `s + 1` on are the new weights', the KV cache of the earlier
    ones stays the old weights'. `compiled`: one-token steps run as one compiled graph over a static KV cache
    (`rollout.compiled_decode`; a method or model it cannot capture decodes eagerly, with one warning); rows that
    ended then leave the batch by row buckets (`rollout.compiled_decode.ROW_BUCKET`), packed weights run as the
    graph's `looprl::packed_linear` and the fused one-query attention, where it applies, over the static cache's
    filled positions (`looprl::attend_filled`). Weights are not packed when `between_steps` is given (an in-flight
    update would leave the packed copies behind)."""
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   eos_token_id=eos_token_id, pad_token_id=pad_token_id, method=method, tokenizer=tokenizer, stop=stop,
                   forward_kwargs=forward_kwargs, fused_attention=fused_attention, packed_weights=packed_weights,
                   kv_buffers=kv_buffers, repetition_penalty=repetition_penalty, between_steps=between_steps,
                   fp32_packing=fp32_packing)
    try:
        return _decode(model, prompt_ids, prompt_mask, compiled=compiled, **options)
    except CompileFailed:  # the process's first compile failed (warned): this call again, eagerly
        return _decode(model, prompt_ids, prompt_mask, compiled=False, **options)


def _decode(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
            temperature: float, top_k: int, top_p: float, eos_token_id: int, pad_token_id: int, method: Any,
            tokenizer: Any, stop: list[str] | None, forward_kwargs: dict | None, fused_attention: bool,
            packed_weights: bool, kv_buffers: KVBuffers | None, repetition_penalty: float, between_steps: Any,
            compiled: bool, fp32_packing: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    loop = DecodeLoop(model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                      pad_token_id=pad_token_id, method=method, tokenizer=tokenizer, stop=stop,
                      forward_kwargs=forward_kwargs, fused_attention=fused_attention, kv_buffers=kv_buffers,
                      repetition_penalty=repetition_penalty, compiled=compiled)
    try:
        # packed copies would keep the old weights after an in-flight update: weights that may change are read as
        # they are
        graph = loop.static is not None
        with (fused_decode_attention(model, enabled=loop.fused, rows=loop.batch_size, static_cache=graph),
              packed_linear_weights(model, enabled=packed_weights and between_steps is None, rows=loop.batch_size,
                                    graph=graph, fp32_packing=fp32_packing)):
            logits = loop.insert_first(loop.prefill())
            step = 0
            while not loop.done():
                tokens, blocks = loop.step(logits, temperature, top_k, top_p)
                if loop.done():
                    break
                if between_steps is not None:
                    between_steps(step)
                step += 1
                logits = loop.feed_next(tokens, blocks)
    finally:
        for h in loop.hooks:
            h.remove()
    return loop.outputs()


class DecodeLoop:
    """One call of `decode`: the batch's `DecodeState`, its KV cache, the method's hooks and the rows the forward
    runs. Its methods are the loop's phases: prefill, the method's first insertion, a step (sample, record, stop
    strings, insertions), and feeding the next tokens (cache policy, compaction)."""

    def __init__(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                 max_new_tokens: int, eos_token_id: int, pad_token_id: int, method: Any, tokenizer: Any,
                 stop: list[str] | None, forward_kwargs: dict | None, fused_attention: bool,
                 kv_buffers: KVBuffers | None, repetition_penalty: float = 1.0, compiled: bool = False):
        method = method if method is not None else Plain()
        self.repetition_penalty = float(repetition_penalty)
        self.seen: torch.Tensor | None = None  # [B, V] tokens in each row so far, made at the first step
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask.long()
        self.max_new_tokens, self.eos, self.pad, self.stop = max_new_tokens, eos_token_id, pad_token_id, stop
        self.tokenizer, self.forward_kwargs = tokenizer, forward_kwargs or {}
        self.device, B = prompt_ids.device, prompt_ids.shape[0]
        self.batch_size = B
        self.state = DecodeState(prompt_ids, prompt_mask[:, :0].long(), [[] for _ in range(B)],
                                 [[] for _ in range(B)], torch.zeros(B, dtype=torch.bool, device=self.device),
                                 tokenizer=tokenizer)
        self.logps: list[list[float]] = [[] for _ in range(B)]
        self.hooks = install_residual_hooks(model, method, self.state)
        if getattr(method, "forward_hooks", None) is not None:
            self.hooks += list(method.forward_hooks(model, self.state))
        self.process = getattr(method, "process_logits", None)
        self.kv_policy = getattr(method, "kv_policy", None)
        self.insert = getattr(method, "insert", None)
        # a method that hooks the forward sees every row of the batch: the prompts then run row by row as given
        # a model whose layers carry per-row state between cached forwards (U-LoRA's context sums) runs every row
        # in every forward too: row compaction and shared prefills would leave that state behind
        self.plain = (self.hooks == [] and self.process is None and self.kv_policy is None and self.insert is None
                      and getattr(method, "forward_hooks", None) is None and not has_sequence_state(model))
        # room for the prompt and every new token (inserted spans may ask for more: the layer then grows)
        self.capacity = prompt_ids.shape[1] + max_new_tokens + 1
        self.kv_buffers = kv_buffers
        self.static = self._static_cache(method) if compiled else None
        self.fused = (fused_attention and self.plain and self.device.type == "cpu"
                      and fused_attention_applies(model, rows=B))
        # CPU half-precision batched matmuls copy a strided operand first; fp32 ones, CUDA's and the fused kernel
        # read it as it is, and the fused kernel is bound by the cache's reads: it attends the filled part alone
        dtype = next(model.parameters()).dtype
        self.full_view = (self.plain and not self.fused and self.device.type == "cpu"
                          and dtype in (torch.bfloat16, torch.float16))
        self.kv_buffers = kv_buffers
        self.cache = reserved_cache(self.capacity, full_view=self.full_view, buffers=kv_buffers)
        self.next_pos = torch.zeros(B, dtype=torch.long, device=self.device)
        self.capped = torch.zeros(B, dtype=torch.bool, device=self.device)  # rows at max_new_tokens
        self.current: dict[str, Any] = {"logits": None, "pending": None}  # what the lookahead starts from
        # The rows the forward runs (`live`: their indices in the batch): all of them, except in the plain loop,
        # which drops the rows that have ended once they are an eighth of it (`compaction`), as a server's
        # continuous batching does; a method's hooks (and `state.lookahead`, which only methods call) see
        # every row.
        self.live, self.rows = torch.arange(B, device=self.device), list(range(B))
        self.groups: torch.Tensor | None = None  # each live row's prompt, while the fused kernel shares its reads
        self.state.lookahead = self.lookahead if self.static is None else self._no_lookahead

    def _static_cache(self, method: Any) -> Any:
        """The compiled step's static cache (`rollout.compiled_decode`), or None with one warning saying why this
        method or model decodes eagerly."""
        blocker = compiled_decode_blocker(
            self.model, method_hooks=bool(self.hooks) or getattr(method, "forward_hooks", None) is not None,
            kv_policy=self.kv_policy is not None, insert=self.insert is not None,
            sequence_state=has_sequence_state(self.model))
        if blocker is None and self.forward_kwargs:
            blocker = f"the forward takes per-call arguments ({sorted(self.forward_kwargs)})"
        if blocker is not None:
            warn_once(blocker)
            return None
        self.static_kept = self.kv_buffers.static if self.kv_buffers is not None else {}
        return self._kept_static(self.batch_size)

    def _kept_static(self, rows: int) -> Any:
        """The static cache of `rows` rows for this generate (the caller's kept one, or a new one), reset."""
        dtype = next(self.model.parameters()).dtype
        key = (id(self.model), rows, bucket_capacity(self.capacity), dtype)
        if key not in self.static_kept:
            self.static_kept[key] = StaticDecodeCache(self.model, rows, self.capacity, compiled_step(self.device))
        self.static_kept[key].reset()
        return self.static_kept[key]

    def _drop_ended_static(self, tokens: torch.Tensor) -> torch.Tensor:
        """In the compiled step, once the rows still decoding fit a smaller row bucket (`fewer_rows`), the live
        ones and enough ended ones to fill it move into that bucket's static cache (the ended ones run on, their
        tokens dropped, as in the full batch); returns the step's tokens of the rows kept."""
        alive = ~(self.state.finished | self.capped)[self.live]
        rows = fewer_rows(len(self.live), int(alive.sum()))
        if rows is None:
            return tokens
        keep = torch.cat([alive.nonzero().flatten(), (~alive).nonzero().flatten()])[:rows].sort().values
        smaller = self._kept_static(rows)
        self.static.move_rows(keep, smaller)
        self.static = smaller
        return self._keep_rows(keep, tokens)

    def _keep_rows(self, keep: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Go on with the rows `keep` (indices into the rows the forward runs); returns the step's tokens of those."""
        self.live, self.next_pos = self.live[keep], self.next_pos[keep]
        self.rows = [self.rows[k] for k in keep.tolist()]
        self.state.attention_mask = self.state.attention_mask[keep]
        if self.groups is not None:
            self.groups = self.groups[keep]
            share_prompt_reads(self.groups, self.prompt_ids.shape[1])
        return tokens[keep]

    @staticmethod
    def _no_lookahead(n: int) -> list[list[int]]:
        raise RuntimeError("state.lookahead is not available in the compiled decode step (its cache is static): "
                           "decode this method with the engine's compiled_decode off")

    def _feed(self, ids: torch.Tensor, mask: torch.Tensor, next_pos: torch.Tensor | None = None) -> torch.Tensor:
        if self.static is not None and self.static.length:  # a one-token step of the compiled graph
            self.state.positions = self.next_pos[:, None].clone()
            logits = self.static.step(ids[:, 0], self.next_pos)
            self.next_pos += 1
            return logits
        return _feed(self.model, ids, mask, self.next_pos if next_pos is None else next_pos, self.state, self.cache,
                     self.forward_kwargs)

    def lookahead(self, n: int) -> list[list[int]]:
        """Per row, the greedy next `n` tokens from here; the cache and the state are restored after."""
        state, cache, B = self.state, self.cache, self.batch_size
        saved_len, saved_mask, saved_positions = cache.get_seq_length(), state.attention_mask, state.positions
        saved_layers = sequence_state(self.model)
        pos = self.next_pos.clone()
        ones = torch.ones((B, 1), dtype=torch.long, device=self.device)
        out: list[torch.Tensor] = []
        try:
            pending = self.current["pending"]
            cur = self.current["logits"] if pending is None else self._feed(pending[:, None], ones, pos)
            for k in range(n):
                out.append(cur.argmax(-1))
                if k < n - 1:
                    cur = self._feed(out[-1][:, None], ones, pos)
        finally:
            _truncate_cache(cache, saved_len)
            state.attention_mask, state.positions = saved_mask, saved_positions
            restore_sequence_state(self.model, saved_layers)
        return torch.stack(out, 1).tolist() if out else [[] for _ in range(B)]

    def prefill(self) -> torch.Tensor:
        """The prompts into the cache (once per distinct prompt in the plain loop); the next-token logits. For the
        compiled step the prefill runs eagerly and its keys and values are copied into the static cache."""
        if self.static is not None:
            return self._prefill_static()
        if not self.plain:
            return self._feed(self.prompt_ids, self.prompt_mask)
        logits, self.cache, groups = _prefill_shared(
            self.model, self.prompt_ids, self.prompt_mask, self.next_pos, self.state, self.cache,
            self.forward_kwargs, lambda: reserved_cache(self.capacity, self.full_view, self.kv_buffers))
        self._share_prompt_reads(groups)
        return logits

    def _share_prompt_reads(self, groups: torch.Tensor | None) -> None:
        """After a shared prefill that copied each prompt's rows from one forward (`groups`: each row's prompt; None
        when it did not), the fused kernel reads each prompt's cache positions once per group of rows
        (`rollout.fused_attention.share_prompt_reads`; the rows' copies are equal)."""
        self.groups = groups if self.fused else None
        share_prompt_reads(self.groups, self.prompt_ids.shape[1])

    def _prefill_static(self) -> torch.Tensor:
        cache = DynamicCache()
        if self.plain:
            logits, cache, groups = _prefill_shared(self.model, self.prompt_ids, self.prompt_mask, self.next_pos,
                                                    self.state, cache, self.forward_kwargs, DynamicCache)
            self._share_prompt_reads(groups)
        else:
            logits = _feed(self.model, self.prompt_ids, self.prompt_mask, self.next_pos, self.state, cache,
                           self.forward_kwargs)
        self.static.fill_prefix([(layer.keys, layer.values) for layer in cache.layers], self.prompt_mask)
        return logits

    def insert_first(self, logits: torch.Tensor) -> torch.Tensor:
        """What the method inserts before the first token, fed at once; a row with nothing fed keeps its logits."""
        if self.insert is None:
            return logits
        self.current["logits"] = logits
        first = self.insert(self.state)
        if first is None or not any(first):
            return logits
        first = [list(x)[:self.max_new_tokens] for x in first]
        for i, x in enumerate(first):
            self._append(i, x, inserted=True)
            self.capped[i] = len(self.state.responses[i]) >= self.max_new_tokens
        ids, mask = pad_token_rows(first, self.pad, "left")
        fed = self._feed(ids.to(self.device), mask.to(self.device))
        has = torch.tensor([bool(x) for x in first], device=self.device)
        return torch.where(has[:, None], fed, logits)

    def _seen(self, vocab: int) -> torch.Tensor:
        """`[B, V]`: which tokens each row holds (its prompt's, then each appended one: `_append` marks them)."""
        if self.seen is None:
            self.seen = torch.zeros(self.batch_size, vocab, dtype=torch.bool, device=self.device)
            rows, cols = self.prompt_mask.bool().nonzero(as_tuple=True)
            self.seen[rows, self.prompt_ids[rows, cols]] = True
            for i, resp in enumerate(self.state.responses):  # inserted before the first step
                self.seen[i, resp] = True
        return self.seen

    def _append(self, i: int, tokens: list[int], inserted: bool, logps: list[float] | None = None) -> None:
        if self.seen is not None and tokens:
            self.seen[i, tokens] = True
        self.state.responses[i].extend(tokens)
        self.state.inserted[i].extend([inserted] * len(tokens))
        self.logps[i].extend(logps if logps is not None else [0.0] * len(tokens))

    def done(self) -> bool:
        return bool((self.state.finished | self.capped).all())

    def step(self, logits: torch.Tensor, temperature: float, top_k: int, top_p: float
             ) -> tuple[torch.Tensor, list[list[int]] | None]:
        """Sample a token for every live row (pad for the rows that ended), record it, end rows at EOS or a stop
        string, and add what the method inserts; returns the tokens and, when the method inserts, each row's block
        to feed."""
        state, live = self.state, self.live
        if self.process is not None:
            logits = self.process(logits, state).float()
        if self.repetition_penalty != 1.0:
            logits = penalize_repeats(logits, self._seen(logits.shape[-1])[live], self.repetition_penalty)
        greedy = temperature <= 0
        scores = logits if greedy else warp_logits(logits, temperature, top_k, top_p)
        tokens = scores.argmax(-1) if greedy else sample_rows(scores.softmax(-1), live, self.batch_size)
        logp = torch.log_softmax(scores, -1).gather(-1, tokens[:, None]).squeeze(-1)
        active = ~(state.finished | self.capped)[live]
        tokens = torch.where(active, tokens, torch.full_like(tokens, self.pad))
        # one conversion per step: indexing a tensor row by row costs more than the step's small ops
        active_rows, token_list, logp_list = active.tolist(), tokens.tolist(), logp.tolist()
        for j, i in enumerate(self.rows):
            if active_rows[j]:
                self._append(i, [token_list[j]], inserted=False, logps=[logp_list[j]])
        state.step += 1
        state.finished[live] |= active & (tokens == self.eos)
        self._end_at_stop_strings(active_rows)
        self.current["pending"] = tokens
        return tokens, self._insert_after(active_rows, token_list)

    def _end_at_stop_strings(self, active_rows: list[bool]) -> None:
        if not (self.stop and self.tokenizer is not None):
            return
        for j, i in enumerate(self.rows):
            if active_rows[j] and not self.state.finished[i]:
                text = self.tokenizer.decode(self.state.responses[i], skip_special_tokens=True)
                if text.endswith(tuple(self.stop)):
                    self.state.finished[i] = True

    def _insert_after(self, active_rows: list[bool], token_list: list[int]) -> list[list[int]] | None:
        """What the method inserts after this step's token (within each row's room); caps the rows that reached
        `max_new_tokens`. Returns each row's block to feed (None when the method inserts nothing: the plain
        loop feeds the tokens as they are)."""
        state = self.state
        extra = self.insert(state) if self.insert is not None else None
        finished_rows = state.finished.tolist()
        blocks, reached = [], []
        for j, i in enumerate(self.rows):
            room = self.max_new_tokens - len(state.responses[i])
            add = (list(extra[i])[:max(0, room)] if extra is not None and active_rows[j]
                   and not finished_rows[i] else [])
            self._append(i, add, inserted=True)
            if extra is not None:
                blocks.append([token_list[j]] + add)
            if len(state.responses[i]) >= self.max_new_tokens:
                reached.append(i)
        self.capped[reached] = True
        return blocks if extra is not None else None

    def feed_next(self, tokens: torch.Tensor, blocks: list[list[int]] | None) -> torch.Tensor:
        """Apply the method's cache policy, drop ended rows in the plain loop, and feed the step's tokens (or
        the blocks with insertions); the next-token logits."""
        if self.kv_policy is not None:
            self.kv_policy(self.cache, self.state)
        if self.plain and self.static is not None:  # the compiled graph's rows go by row buckets
            tokens = self._drop_ended_static(tokens)
        elif self.plain:
            keep = compaction(~(self.state.finished | self.capped)[self.live], self.cache)
            if keep is not None:
                tokens = self._keep_rows(keep, tokens)
        if blocks is None:  # one token a row
            ids, mask = tokens[:, None], torch.ones((len(self.rows), 1), dtype=torch.long, device=self.device)
        else:
            ids, mask = pad_token_rows(blocks, self.pad, "left")  # every row's last column is real
        return self._feed(ids.to(self.device), mask.to(self.device))

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(response_ids, logp, lengths, inserted, ended)`, right-padded with the pad id."""
        state, B = self.state, self.batch_size
        L = max(1, max(len(r) for r in state.responses))
        resp = torch.full((B, L), self.pad, dtype=torch.long)
        out_logp = torch.zeros((B, L))
        inserted = torch.zeros((B, L), dtype=torch.long)
        lengths = torch.zeros(B, dtype=torch.long)
        for i in range(B):
            r = state.responses[i]
            resp[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            out_logp[i, :len(r)] = torch.tensor(self.logps[i])
            inserted[i, :len(r)] = torch.tensor(state.inserted[i], dtype=torch.long)
            lengths[i] = len(r)
        return resp, out_logp, lengths, inserted, state.finished.cpu()


@register("decoding", "diffusion")
class DiffusionDecoding:
    """Masked-diffusion sampling (`models.diffusion.diffusion_generate`, LLaDA's semi-autoregressive blocks): the
    `hf` engine's decoding for `model_type: llada` (the default there; causal decoding methods are refused for such
    a model, and this one for a causal model).

    `block_length`: tokens per block (none: the whole response is one block); `steps`: denoising steps over the
    whole response, split equally among blocks (none: one token per step); `remasking`: low_confidence (commit
    the most confident predictions) | random; `commit_log`: keep each row's per-step commits in the batch (extra
    `diffusion_commits`: per row [[step, position, token, confidence], ...]). `revise` with `probes`, `candidates`,
    `m`, `perturb_frac`, `score`: send committed tokens back to the mask during sampling
    (`models.diffusion.Remasking`: core, or the controls random and low_margin; none by default; `score`: state,
    the spec's current-state support, or commit)."""

    diffusion = True

    def __init__(self, block_length: int | None = None, steps: int | None = None, remasking: str = "low_confidence",
                 commit_log: bool = False, revise: str = "none", probes: int = 0, candidates: int = 16, m: int = 2,
                 perturb_frac: float = 0.0, score: str = "state"):
        from models.diffusion import Remasking
        self.block_length, self.steps, self.remasking, self.commit_log = block_length, steps, remasking, commit_log
        self.revise = Remasking(revise, probes, candidates, m, perturb_frac, score)

    def sample(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
               max_new_tokens: int, temperature: float, mask_id: int) -> Any:
        from models.diffusion import diffusion_generate
        return diffusion_generate(model, prompt_ids, prompt_mask, gen_length=max_new_tokens,
                                  block_length=self.block_length or max_new_tokens,
                                  steps=self.steps or max_new_tokens, mask_id=mask_id, temperature=temperature,
                                  remasking=self.remasking, commit_log=self.commit_log, revise=self.revise)


@register("decoding", "remask_core")
class CoreRemaskDecoding(DiffusionDecoding):
    """CORE (context-robust remasking, rl/methods/core/README.md) on the diffusion sampler: at `probes` steps one
    extra forward with the committed candidates jointly masked, and the `m` tokens whose support drops most go back
    to the mask. The same as `diffusion` with `revise: core`; forward passes = steps + probes."""

    def __init__(self, block_length: int | None = None, steps: int | None = None, remasking: str = "low_confidence",
                 commit_log: bool = False, probes: int = 2, candidates: int = 16, m: int = 2,
                 perturb_frac: float = 0.0, score: str = "state"):
        super().__init__(block_length, steps, remasking, commit_log, "core", probes, candidates, m, perturb_frac,
                         score)
