"""The `hf` engine's decode step compiled as one graph: a static KV cache and one `torch.compile`d forward of one
token per row, so that a decode step is one launch of fused kernels instead of a Python walk over a few hundred
small ones (on a GPU, with CUDA graphs: `mode="reduce-overhead"`).

Why: the decode loop of `rollout.decoding` runs transformers' forward eagerly, every norm, rotary, activation and
residual add a kernel of its own and a cache that grows by a concatenation-free view each step; a small-row decode
step is then bound by launches and Python, not by the weights' reads (`benchmarks/gemm_bound.py`). A compiled step
needs shapes that do not change: `StaticDecodeCache` holds every row's keys and values at their final positions
(`transformers.StaticCache`, capacity rounded up to `CAPACITY_BUCKET`), the attention mask is one `[B, capacity]`
tensor whose next column is set before each step, and the rows that ended keep running (their tokens are pad and
are dropped) until the rows still decoding fit a smaller multiple of `ROW_BUCKET`: then the live rows (and enough
ended ones to fill it) move into that row count's static cache and graph. One graph serves every step of a generate
at a row count and every generate of the same (rows, capacity) bucket.

On CPU two products stay opaque calls inside the graph, because inductor's own code for them is slower than the
eager loop's: the one-query attention (`rollout.fused_attention.attend_filled`, where the fused kernel applies: its
compiled kernel over the positions filled so far, where the graph's own attention would read the whole capacity
every step) and the linear layers (`rollout.packed_linear`'s `looprl::packed_linear`, packed weights,
where the graph's `mm` multiplies plain ones; not with in-flight updates, which copy into the plain weights).
Everything between them (embedding, norms, rotary, residual adds, activations, the cache's writes) is fused by
inductor. What stays the eager loop's (`rollout.decoding.DecodeLoop`): the prompt's prefill (once per distinct
prompt, its keys and values copied into the static cache), sampling, logits processors and the repetition penalty
(they act on the step's logits, outside the graph), stop strings, in-flight weight updates (weights are copied in
place, the graph reads them). What cannot be captured falls back to the eager step for the whole call, with one warning per
reason (`compiled_decode_blocker`): residual or forward hooks, a KV policy and insertions (they change the cache or
the fed block's shape), models whose layers carry per-row state (U-LoRA) and caches of another kind (the looped
models' slot per loop), and a first compile that fails (inductor needs a C++ compiler on CPU).

Tokens and logprobs equal the eager loop's (greedy tokens equal, sampled with the same seed equal, logprobs to
float rounding: 1e-5 in fp32); `tests/rollout/test_compiled_decode.py` holds them to it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rollout.base import run_or_fall_back

# capacities are rounded up to a multiple of this, so that generates whose prompts differ by a few tokens share a graph
CAPACITY_BUCKET = 32
# the compiled step drops the rows that ended in steps of this many rows (each row count is a graph of its own, a
# compile the first time a process meets it): 128 rows run on as 96, 64, 32 once that many still decode
ROW_BUCKET = 32
# (rows, capacity) buckets one process may compile (dynamo's own default of 8 would silently fall back to eager)
RECOMPILE_LIMIT = 64
_warned: set[str] = set()
_state = {"ran": False, "failed": None}  # whether a compiled step has run in this process; why it could not


def warn_once(reason: str) -> None:
    """One warning per reason and process: why a generate decodes with the eager step."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"compiled decode: {reason}; this call decodes with the eager step", stacklevel=3)


def compiled_decode_blocker(model: torch.nn.Module, method_hooks: bool, kv_policy: bool, insert: bool,
                            sequence_state: bool) -> str | None:
    """Why the decode of `model` under a method cannot run as one compiled graph (None: it can)."""
    if _state["failed"] is not None:
        return f"the first compile failed ({_state['failed'][:200]})"
    if method_hooks:
        return "the decoding method hooks the forward (residual or forward hooks)"
    if kv_policy:
        return "the decoding method edits the KV cache between steps (a KV policy)"
    if insert:
        return "the decoding method inserts tokens (blocks of more than one token per row)"
    if sequence_state:
        return "the model's layers carry per-row state between forwards"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not declare a compileable forward with a static cache"
    return None


def bucket_capacity(capacity: int) -> int:
    return -(-capacity // CAPACITY_BUCKET) * CAPACITY_BUCKET


def fewer_rows(rows: int, alive: int) -> int | None:
    """The row count a compiled decode of `rows` rows goes on with when `alive` of them still decode: the least
    multiple of `ROW_BUCKET` that holds them, when below `rows`; None: all `rows` go on."""
    target = max(ROW_BUCKET, -(-alive // ROW_BUCKET) * ROW_BUCKET)
    return target if target < rows else None


class StaticDecodeCache:
    """A generate's static KV cache, its `[B, capacity]` attention mask and the compiled one-token step."""

    def __init__(self, model: torch.nn.Module, batch_size: int, capacity: int, step_fn: Any):
        from transformers import StaticCache
        self.model, self.batch_size, self.capacity = model, batch_size, bucket_capacity(capacity)
        self.cache = StaticCache(config=model.config, max_cache_len=self.capacity)
        self.mask = torch.zeros((batch_size, self.capacity), dtype=torch.long, device=model.device)
        self.length = 0  # positions filled (every row shares the count: prompts are left-padded to one length)
        self.step_fn = step_fn

    def reset(self) -> None:
        """Ready for another generate of the bucket: nothing filled (what the buffers hold is masked out)."""
        self.mask.zero_()
        self.length = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.cache.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))

    def fill_prefix(self, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """The prefill's keys and values (`[B, Hkv, P, D]` per layer, every row's own) into positions `[0, P)`."""
        keys0, values0 = layers[0]
        B, heads, P, _ = keys0.shape
        if P >= self.capacity:
            raise ValueError(f"compiled decode: a prefill of {P} positions does not fit a cache of {self.capacity}")
        if not self.cache.layers[0].is_initialized:
            self.cache.early_initialization(B, heads, keys0.shape[-1], keys0.dtype, keys0.device)
        for layer, (keys, values) in zip(self.cache.layers, layers):
            layer.keys[:, :, :P].copy_(keys)
            layer.values[:, :, :P].copy_(values)
            layer.cumulative_length.fill_(P)
        self.mask[:, :P] = mask
        self.length = P

    def move_rows(self, keep: torch.Tensor, into: StaticDecodeCache) -> None:
        """Rows `keep` of this cache (their filled positions and mask) into `into`, a cache of `len(keep)` rows and
        the same capacity, which goes on from the same position."""
        if into.batch_size != len(keep) or into.capacity != self.capacity:
            raise ValueError(f"compiled decode: {len(keep)} rows of a {self.capacity}-position cache do not fit a "
                             f"cache of {into.batch_size} rows and {into.capacity} positions")
        filled = self.length
        if not into.cache.layers[0].is_initialized:
            keys0 = self.cache.layers[0].keys
            into.cache.early_initialization(len(keep), keys0.shape[1], keys0.shape[-1], keys0.dtype, keys0.device)
        for source, target in zip(self.cache.layers, into.cache.layers):
            target.keys[:, :, :filled].copy_(source.keys[keep, :, :filled])
            target.values[:, :, :filled].copy_(source.values[keep, :, :filled])
            target.cumulative_length.fill_(filled)
        into.mask.zero_()
        into.mask[:, :filled] = self.mask[keep, :filled]
        into.length = filled

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token a row (`tokens [B]` at `positions [B]`) into position `length`; the next-token logits
        `[B, V]` in fp32."""
        if self.length >= self.capacity:
            raise ValueError(f"compiled decode: position {self.length} is past the cache's capacity {self.capacity}")
        self.mask[:, self.length] = 1
        where = torch.tensor([self.length], device=self.mask.device)
        logits = run_or_fall_back(_state, lambda: self.step_fn(self.model, tokens[:, None], positions[:, None],
                                                               self.mask, where, self.cache),
                                  "compiled decode: the first compile failed", "decoding with the eager step")
        if logits is None:
            raise CompileFailed(_state["failed"])
        self.length += 1
        return logits


class CompileFailed(RuntimeError):
    """The first compiled step of the process failed; the caller decodes the call again with the eager step."""


def _one_token_step(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                    cache_position: torch.Tensor, cache: Any) -> torch.Tensor:
    out = model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, cache_position=cache_position)
    return out.logits[:, -1].float()


_compiled: dict[str, Any] = {}


def compiled_step(device: torch.device) -> Any:
    """The compiled one-token step for `device` (made once per process; each (rows, capacity) bucket and model
    compiles its own graph on first use: seconds on a CPU, the on-disk inductor cache warm)."""
    kind = device.type
    if kind not in _compiled:
        import torch._dynamo
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        mode = "reduce-overhead" if kind == "cuda" else None  # CUDA graphs replay the whole step on a GPU
        _compiled[kind] = torch.compile(_one_token_step, dynamic=False, fullgraph=True, mode=mode)
    return _compiled[kind]
