"""Decode attention for the `hf` engine's loop on CPU: each decode step's one query per row against the KV cache,
as one compiled kernel (torch.compile, inductor's C++ backend) that reads every cached key and value once, converts
half-precision ones to fp32 in registers and keeps the scores in fp32.

Why: transformers' eager attention runs a decode step as two batched matmuls of a single query row per (row, head),
B·H matrix-vector products of a few thousand FLOPs each, which the CPU batched matmul runs far below the memory's
speed (bf16, at the race's 128 rows x 12 heads x 95 positions: 4-5 ms a layer, against under 2 ms fused; a profile
of one 128-row generate put a third of its time in those `bmm` calls; fp32, on the race's short prompts: 2.9 s of
`bmm` a generate against 2.0 s fused). `benchmarks/decode_step.py` measures it.

Used by `rollout.decoding.decode(fused_attention=True)` (the `hf` engine's `fused_decode_attention`, on by default)
while it runs, for the plain loop on CPU, batches of at least `MIN_ROW_HEADS` (row, head) pairs and the
architectures in `ARCHITECTURES`, whose attention is the textbook one (no logit soft-capping, no attention sinks;
sliding windows come through the mask). The model's config names `looprl_fused_decode|<its own kernel>` for the
duration; blocks of more than one query (the prompt's prefill, inserted spans) and any module in training mode
run the model's own kernel (eager or sdpa) with the same additive mask. The first call in a process compiles
(seconds; `dynamic=True`, so batch and cache lengths do not recompile). Should the first call fail (inductor
needs a C++ compiler), the loop warns once and decodes with the model's own kernel.

Inside the compiled decode step on CPU (`rollout.compiled_decode`: `fused_decode_attention(static_cache=True)`) the
keys and values are a static cache's whole capacity; there the graph calls `looprl::attend_filled`, a custom op that
runs the same kernel over the positions filled so far (`cache_position`'s last + 1), so that a step reads what it
attends to and not the whole capacity (a CUDA graph, which fixes its reads at capture, attends the whole capacity
with the model's own kernel and the mask).

The rows of a group (GRPO's n samples of one prompt, prefilled once and copied: `rollout.decoding._prefill_shared`)
hold equal keys and values at the prompt's positions. Set by the loop (`share_prompt_reads`), the kernel reads those
positions from one row of each group (`attend_shared_prompt`), so that a group's prompt comes from memory once and
its other rows read it from the CPU's cache: the same numbers, bit for bit, with less memory traffic. The gathered
reads cost some work, so it runs where the rows' copies of the prompt hold at least `MIN_SHARED_PROMPT_BYTES` a
layer (by element size; in the race's decode loop on 2 cores, 128 rows x 12 heads: bf16 from the race's 7-9-position
prompts, 1.02-1.17x a generate at 8-64; fp32 from about 27, 1.02x at 32; `benchmarks/decode_attention.py --loop`; the
kernel alone, 1.8x in bf16 at 128-position prompts, 1.6x in fp32 at 48-64; `benchmarks/decode_step.py
--prompt-tokens`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from models.blocks import TEXTBOOK_ATTENTION as ARCHITECTURES
from models.blocks import attention_implementation
from models.common import first_rows
from rollout.base import run_or_fall_back

PREFIX = "looprl_fused_decode|"
STATIC_PREFIX = "looprl_fused_static_decode|"  # the same kernel over a static cache's filled positions
# the fewest (row, head) pairs a decode step must attend for the kernel to pay: its compile costs 3-4 s in every
# process (the on-disk cache warm), which a small batch never wins back (the race's 128 rows x 12 heads: 1,536)
MIN_ROW_HEADS = 256
# the least bytes of prompt keys and values a layer (all rows' copies, keys and values) for the kernel to read a
# group's prompt once, by the cache's element size: under it one copy saves less than the gathered reads cost.
# Measured in the decode loop, where a layer's cache has left the CPU's caches by its next step (`python
# benchmarks/decode_attention.py --loop`: the race's ~85M model, 14 layers, 128 rows = 16 groups of 8, 2 threads of
# an AMX Xeon; a generate's speed-up by prompt copies a layer): bf16 1.02x at 3 MiB (8-position prompts), 1.04x at
# 6, 1.10x at 12, 1.17x at 24; fp32 0.975x at 6 MiB, 0.99x at 12, 1.02x at 24, 1.10x at 48. (The kernel alone, one
# layer's cache hot, pays only from 25-38 MB in both dtypes: the threshold was 32 MB from that measurement.)
MIN_SHARED_PROMPT_BYTES = {2: 2 << 20, 4: 20 << 20}
_compiled: Any = None
_compiled_shared: Any = None
_state = {"ran": False, "failed": None}  # whether the compiled kernel has run once; why it could not
# set by `share_prompt_reads` while a loop runs, per thread (loops in two threads keep their own): for each row, the
# row whose copy of its prompt the kernel reads, and the prompt's length in cache positions
_local = threading.local()


def attend_one_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """softmax(q·kᵀ·scaling + mask)·v for one query per row, in fp32, grouped-query heads included.

    query `[B, H, 1, D]`, key/value `[B, Hkv, C, D]` (H a multiple of Hkv), mask additive `[B or 1, 1, 1, ≥C]` or None.
    Returns `[B, 1, H, D]` in the query's dtype (the layout transformers' attention functions return)."""
    B, H, _, D = query.shape
    Hkv, C = key.shape[1], key.shape[2]
    q = query.reshape(B, Hkv, H // Hkv, 1, D).float()
    scores = (q * key[:, :, None].float()).sum(-1) * scaling  # [B, Hkv, G, C]
    if mask is not None:
        scores = scores + mask[..., :C].float().reshape(mask.shape[0], 1, 1, C)  # [B or 1, 1, 1, C]
    probs = scores.softmax(-1)
    out = (probs[..., None] * value[:, :, None].float()).sum(-2)  # [B, Hkv, G, D]
    return out.reshape(B, 1, H, D).to(query.dtype)


def attend_shared_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                         scaling: float, prompt_rows: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """`attend_one_query` where row b's first `prompt_length` positions are read from row `prompt_rows[b]` (a row
    holding the same keys and values there). Compiled, the gather is the kernel's own indexed load (no copy): the
    rows of a group read one copy of their prompt."""
    B, Hkv, C = key.shape[0], key.shape[1], key.shape[2]
    positions = torch.arange(C, device=key.device)
    own = torch.arange(B, device=key.device)
    rows = torch.where(positions[None] < prompt_length, prompt_rows[:, None], own[:, None])  # [B, C]
    index = (rows[:, None, :], torch.arange(Hkv, device=key.device)[None, :, None], positions[None, None, :])
    return attend_one_query(query, key[index], value[index], mask, scaling)


def share_prompt_reads(groups: torch.Tensor | None, prompt_length: int = 0) -> None:
    """From the next decode step on, rows with equal `groups [B]` (each row's prompt, as the loop's rows stand) read
    the prompt's `prompt_length` cache positions from the group's first row (when some group has more than one row
    and the rows' prompt copies hold `MIN_SHARED_PROMPT_BYTES` a layer for their element size); None: every row reads
    its own."""
    if groups is None or prompt_length == 0 or len(groups.unique()) == len(groups):
        shared_prompt().update(rows=None, length=0)
        return
    shared_prompt().update(rows=first_rows(groups)[groups], length=int(prompt_length))


def shared_prompt() -> dict[str, Any]:
    """This thread's `share_prompt_reads` setting: `rows` (each row's prompt row, or None) and `length`."""
    if not hasattr(_local, "shared"):
        _local.shared = {"rows": None, "length": 0}
    return _local.shared


def _prompt_bytes(key: torch.Tensor, length: int) -> int:
    """The bytes of the rows' keys and values at the first `length` positions of a layer's cache `[B, Hkv, C, D]`."""
    B, Hkv, _, D = key.shape
    return 2 * B * Hkv * length * D * key.element_size()


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
            scaling: float) -> torch.Tensor:
    """The compiled kernel, reading the prompt once per group while `share_prompt_reads` says so."""
    shared = shared_prompt()
    rows, length = shared["rows"], shared["length"]
    least = MIN_SHARED_PROMPT_BYTES.get(key.element_size(), MIN_SHARED_PROMPT_BYTES[4])
    if rows is not None and len(rows) == key.shape[0] and _prompt_bytes(key, length) >= least:
        return _shared_kernel()(query, key, value, mask, scaling, rows, length)
    return _kernel()(query, key, value, mask, scaling)


@torch.library.custom_op("looprl::attend_filled", mutates_args=())
def attend_filled(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  cache_position: torch.Tensor, scaling: float) -> torch.Tensor:
    """`attend_one_query` (compiled) over a static cache's positions up to `cache_position`'s last one: key/value
    `[B, Hkv, capacity, D]`, the query's own keys and values already written at that position."""
    filled = int(cache_position[-1]) + 1
    return _attend(query, key[:, :, :filled], value[:, :, :filled], None if mask is None else mask[..., :filled],
                   scaling)


@attend_filled.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
      cache_position: torch.Tensor, scaling: float) -> torch.Tensor:
    B, H, _, D = query.shape
    return query.new_empty((B, 1, H, D))


def compile_kernel(fn: Any) -> Any:
    """`fn` compiled with dynamic sizes, its first call (the one that compiles) traced without duck sizing.

    Why: with duck sizing, sizes that happen to be equal when the kernel compiles become one symbol, and the graph
    is guarded on their equality: a decode loop at the race's shapes whose first compiled call had as many rows as
    cached positions (72 and 72) compiled again in its fifth generate, at the first step where the two differed
    (that generate 4.15-4.36 s against 3.8-4.0, bf16, 2 threads). Without it every size is a symbol of its own and one
    graph serves every batch and cache length (tests/rollout/test_fused_attention.py). Only the first call is
    traced under the setting: a process-wide one (`torch.fx.experimental._config`), so the later calls pay nothing
    for it."""
    from torch.fx.experimental import _config as shapes_config
    compiled = torch.compile(fn, dynamic=True)
    first = True

    def kernel(*args: Any) -> Any:
        nonlocal first
        if first:
            first = False
            with shapes_config.patch(use_duck_shape=False):
                return compiled(*args)
        return compiled(*args)
    return kernel


def _kernel() -> Any:
    global _compiled
    if _compiled is None:
        _compiled = compile_kernel(attend_one_query)
    return _compiled


def _shared_kernel() -> Any:
    global _compiled_shared
    if _compiled_shared is None:
        _compiled_shared = compile_kernel(attend_shared_prompt)
    return _compiled_shared


def _model_kernel(name: str) -> Any:
    if name == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward
    return eager_attention_forward


def _one_query_step(module: torch.nn.Module, query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a call is a decode step the kernel computes: one query per row, on CPU, in inference, with textbook
    attention (no logit soft-capping, no attention sinks)."""
    return (query.shape[2] == 1 and not module.training and query.device.type == "cpu"
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None)


def _attention(own: str) -> Any:
    fallback = _model_kernel(own)

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        if _one_query_step(module, query, kwargs) and _state["failed"] is None:
            # the first call compiles: no C++ compiler or an inductor bug leaves the model's kernel
            out = run_or_fall_back(_state, lambda: _attend(query, key, value, attention_mask, scaling),
                                   "rollout.fused_attention: the kernel did not compile",
                                   "decoding with the model's own attention")
            if out is not None:
                return out, None
        return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return attention


def _static_attention(own: str) -> Any:
    fallback = _model_kernel(own)

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        position = kwargs.get("cache_position")
        if _one_query_step(module, query, kwargs) and position is not None:
            return torch.ops.looprl.attend_filled(query, key, value, attention_mask, position, scaling), None
        return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return attention


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
    for own in ("eager", "sdpa"):
        for prefix, make in ((PREFIX, _attention), (STATIC_PREFIX, _static_attention)):
            if prefix + own not in AttentionInterface._global_mapping:
                AttentionInterface.register(prefix + own, make(own))
                # an additive mask: the fused kernel adds it, and both model kernels take it as it is
                ALL_MASK_ATTENTION_FUNCTIONS.register(prefix + own, eager_mask)


def applies(model: torch.nn.Module, rows: int | None = None) -> bool:
    """Whether `model` (a transformers causal LM, peft-wrapped or not) can decode with the fused kernel; with
    `rows`, also whether a batch of that many rows is large enough to pay for it (`MIN_ROW_HEADS`)."""
    config = getattr(model, "config", None)
    return (config is not None and getattr(config, "model_type", None) in ARCHITECTURES
            and config._attn_implementation in ("eager", "sdpa")
            and (rows is None or rows * getattr(config, "num_attention_heads", 0) >= MIN_ROW_HEADS))


@contextmanager
def fused_decode_attention(model: torch.nn.Module, enabled: bool = True, rows: int | None = None,
                           static_cache: bool = False) -> Iterator[bool]:
    """While inside, `model`'s one-query attention runs the fused kernel (when `enabled` and `applies(model, rows)`;
    with `static_cache`, over the filled positions of a static cache: `attend_filled`); yields whether it does. The
    model's own kernel is restored on exit."""
    if not (enabled and applies(model, rows)):
        yield False
        return
    _register()
    prefix = STATIC_PREFIX if static_cache else PREFIX
    share_prompt_reads(None)  # until the loop says which rows share a prompt
    try:
        with attention_implementation(model, prefix + model.config._attn_implementation):
            yield True
    finally:
        share_prompt_reads(None)
