"""Attention over a packed row without flash-attention: the row's sequences attend within themselves (and to a
shared prefix), computed bucket by bucket of sequences of similar length, never through a `[T, T]` mask.

Why: a packed row (`learner.pack_sequences`) runs every position-wise op (the linear layers, norms, MLPs) once over
the micro-batch's real tokens — no padding, one matmul per weight (in a padded or bucketed forward every bucket is
one more forward through every layer, and each weight's gradient is summed over them). flash-attention's
variable-length kernels keep such a row's sequences apart on GPUs; transformers' eager and sdpa kernels do it with a
dense block mask, quadratic in the row's length. This kernel gathers each bucket's queries and keys from the row
(`PackedLayout`), runs the eager kernel's math on them (`q·kᵀ·scaling`, masked, softmax in fp32, `·v`) and puts
the outputs back in the row's order; any device, any dtype, gradients through the gathers.

A sequence may read a prefix that other sequences share: GRPO's n samples of a prompt are packed as the prompt's
tokens once and n responses that each attend to them (`learner.share_prompts` with `pack_sequences`), so the
prompt's tokens cost 1/n of their matmuls while the row stays unpadded.

Used by `models.families.response_logprobs(pack=True)` for the architectures in `ARCHITECTURES` (attention that is
softmax(q·kᵀ·scaling + mask)·v with grouped key/value heads, no sliding window) and kernels other than
flash-attention's, through transformers' attention interface: the model's config names `NAME` while the forward
runs and the layout comes in the forward's keyword `LAYOUT_KEY`; no mask is built (the kernel masks per bucket).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from models.blocks import TEXTBOOK_ATTENTION as ARCHITECTURES
from models.blocks import attention_implementation
from models.common import length_buckets

NAME = "looprl_varlen"
LAYOUT_KEY = "looprl_packed_layout"
# padding a bucket may carry, in keys per sequence (count x longest over the real ones). The position-wise ops run
# unpadded whatever the buckets; a bucket's scores are queries x keys, so padding costs there quadratically: on the
# race's learner step (bf16) 0.25 put 113 of 128 rows in one bucket and its softmax alone took 0.2 s, 0.05 keeps
# the buckets tight (a few more small ops each)
BUCKET_MAX_PADDING = 0.05


def _select_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`rows.index_select(0, index)`, reading rows of a whole number of 8-byte words as such: torch's row-copy loop
    runs several times faster on int64 rows than on bf16 ones (a `[75708, 64]` bf16 gather of 91,692 rows: 0.63 ms
    against 2.1 ms on 2 threads of an AMX Xeon)."""
    size = rows.element_size()
    if rows.is_contiguous() and (rows.shape[1] * size) % 8 == 0 and (rows.storage_offset() * size) % 8 == 0:
        return rows.view(torch.int64).index_select(0, index).view(rows.dtype)
    return rows.index_select(0, index)


class _GatherRows(torch.autograd.Function):
    """`rows.index_select(0, index)` with a backward that gathers too: row r's gradient is the gathered gradient at
    slot `back[r]` (zero for the rows `unread`, which no slot reads) plus, for rows gathered more than once, the
    slots `extra_slots` added into `extra_rows`. Exact when every other slot's gradient is zero (the layout's
    padding slots: their queries are dropped and their keys masked). torch's own backward, a zero tensor and an
    `index_add_` per gather, runs several times slower on CPU; the unread rows are zeroed in place rather than read
    from a zero row appended to the gradient (a copy of the whole gradient per gather: 55 ms of profiled op time in
    the race's bf16 learner step, within the step's run-to-run spread)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor, back: torch.Tensor, unread: torch.Tensor,
                extra_slots: torch.Tensor, extra_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back, unread, extra_slots, extra_rows)
        return _select_rows(rows, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back, unread, extra_slots, extra_rows = ctx.saved_tensors
        if len(grad) == 0:
            return grad.new_zeros(len(back), grad.shape[1]), None, None, None, None, None
        out = _select_rows(grad.contiguous(), back)
        if len(unread):
            out.index_fill_(0, unread, 0)
        if len(extra_slots):
            out.index_add_(0, extra_rows, grad.index_select(0, extra_slots))
        return out, None, None, None, None, None


@dataclass
class Gather:
    """One gather of rows (`_GatherRows`): `index [S]` the rows gathered, `back [R]` each row's slot, `unread` the
    rows that no slot reads (their `back` is 0, and their gradient zero), `extra_slots`/`extra_rows` its other
    slots."""
    index: torch.Tensor
    back: torch.Tensor
    unread: torch.Tensor
    extra_slots: torch.Tensor
    extra_rows: torch.Tensor

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return _GatherRows.apply(rows, self.index, self.back, self.unread, self.extra_slots, self.extra_rows)

    def to(self, device: torch.device | str) -> Gather:
        return Gather(*(t.to(device) for t in (self.index, self.back, self.unread, self.extra_slots, self.extra_rows)))


def _gather(index: torch.Tensor, rows: int, primary: torch.Tensor, extra: torch.Tensor | None = None) -> Gather:
    """The `Gather` of `index` from `rows` rows: a row's gradient is its slot's where `primary` is true (each row
    at most once among them) plus those of its slots where `extra` is true (here: a key read by several sequences,
    a shared prefix, or by several query heads, grouped heads); every other slot's gradient must be zero."""
    back = torch.full((rows,), -1, dtype=torch.long)
    slots = primary.nonzero().flatten()
    back[index[slots]] = slots
    unread = (back < 0).nonzero().flatten()
    extra_slots = (extra & ~primary).nonzero().flatten() if extra is not None else torch.zeros(0, dtype=torch.long)
    return Gather(index, back.clamp_(min=0), unread, extra_slots, index[extra_slots])


@dataclass
class PackedLayout:
    """Where every query of a packed row of `total` positions reads its keys, for a model of `heads` query heads
    and `kv_heads` key/value heads. The row's queries, keys and values are gathered once each (`queries`, `keys`:
    the row's (position, head) pairs, position-major; padding reads position 0), bucket after bucket, every bucket
    head-major: bucket b is `heads·n` contiguous blocks of `wq` queries and `wk` keys (`shapes[b] = (n, wq, wk)`),
    with `allowed[b] [n, wq, wk]` which key each query attends; `outputs` takes each (position, head) back from the
    buckets' outputs concatenated."""
    shapes: list[tuple[int, int, int]]
    queries: Gather
    keys: Gather
    outputs: Gather
    allowed: list[torch.Tensor]
    total: int
    heads: int
    kv_heads: int

    def to(self, device: torch.device | str) -> PackedLayout:
        return PackedLayout(self.shapes, self.queries.to(device), self.keys.to(device), self.outputs.to(device),
                            [a.to(device) for a in self.allowed], self.total, self.heads, self.kv_heads)

    def bias(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """`allowed` as additive masks in `dtype` (0, or its lowest value as transformers' eager masks), made once."""
        cached = self.__dict__.setdefault("_bias", {})
        if dtype not in cached:
            low = torch.finfo(dtype).min
            cached[dtype] = [torch.zeros(a.shape, dtype=dtype, device=a.device).masked_fill_(~a, low)
                             for a in self.allowed]
        return cached[dtype]


def packed_layout(prefixes: list[torch.Tensor], owns: list[torch.Tensor], total: int, heads: int, kv_heads: int,
                  max_padding: float = BUCKET_MAX_PADDING) -> PackedLayout:
    """The layout of a packed row of `total` positions holding sequences whose own tokens are at `owns[i]` (row
    positions, in order) and who also attend to the tokens at `prefixes[i]` (another sequence's own tokens, e.g. a
    shared prompt; empty for none): own token j attends every prefix token and own tokens 0..j. Every row position
    must be the own token of exactly one sequence; `heads` must be a multiple of `kv_heads` (query head h reads key
    head h // (heads / kv_heads), as transformers' `repeat_kv`)."""
    if len(prefixes) != len(owns):
        raise ValueError(f"packed_layout: {len(prefixes)} prefixes for {len(owns)} sequences")
    if heads % kv_heads:
        raise ValueError(f"packed_layout: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    keep = [i for i, own in enumerate(owns) if len(own)]
    seen = torch.cat([owns[i] for i in keep]) if keep else torch.zeros(0, dtype=torch.long)
    if len(seen) != total or (total and not torch.equal(torch.sort(seen).values, torch.arange(total))):
        raise ValueError(f"packed_layout: the sequences' own tokens must cover the row's {total} positions once each")
    group_of = heads // kv_heads
    head = torch.arange(heads)[:, None, None]  # [H, 1, 1]
    shapes, allowed, q_index, k_index, q_real, k_primary, k_real = [], [], [], [], [], [], []
    for group in length_buckets([len(prefixes[i]) + len(owns[i]) for i in keep], max_padding):
        rows = [keep[g] for g in group]
        n_prefix = torch.tensor([len(prefixes[i]) for i in rows])
        n_own = torch.tensor([len(owns[i]) for i in rows])
        n, wq, wk = len(rows), int(n_own.max()), int((n_prefix + n_own).max())
        queries = torch.zeros(n, wq, dtype=torch.long)
        keys = torch.zeros(n, wk, dtype=torch.long)
        for r, i in enumerate(rows):
            queries[r, :len(owns[i])] = owns[i]
            keys[r, :len(prefixes[i]) + len(owns[i])] = torch.cat([prefixes[i].long(), owns[i].long()])
        # query j of a row sits at key n_prefix + j: it attends keys 0..n_prefix + j (padding queries attend the
        # same way over padding keys, which point at a real position: no row is all masked; they are dropped)
        last = n_prefix[:, None] + torch.arange(wq)[None]  # [n, wq]
        allowed.append(torch.arange(wk)[None, None] <= last[..., None])
        shapes.append((n, wq, wk))
        q_index.append((queries[None] * heads + head).flatten())  # [H, n, wq]: (position, head) in the row
        k_index.append((keys[None] * kv_heads + head // group_of).flatten())
        q_real.append((torch.arange(wq)[None] < n_own[:, None]).expand(heads, n, wq).flatten())
        # a key's gradient is read at its own sequence's slot for the first query head of its group, plus its
        # other real slots (a prefix's keys in every sequence that reads it; the group's other heads)
        at = torch.arange(wk)[None]
        own_key = (at >= n_prefix[:, None]) & (at < (n_prefix + n_own)[:, None])
        k_primary.append((own_key[None] & (head % group_of == 0)).flatten())
        k_real.append((torch.arange(wk)[None] < (n_prefix + n_own)[:, None]).expand(heads, n, wk).flatten())
    none = torch.zeros(0, dtype=torch.long)
    cat = (lambda xs: torch.cat(xs) if xs else none)  # noqa: E731
    queries = _gather(cat(q_index), total * heads, cat(q_real).bool())
    keys = _gather(cat(k_index), total * kv_heads, cat(k_primary).bool(), cat(k_real).bool())
    # the outputs come back in (position, head) order: the slots of the real queries, in the row's order
    real_slots = queries.back  # row r's slot among the gathered queries = its output's among the outputs
    outputs = _gather(real_slots, len(queries.index), torch.ones(len(real_slots), dtype=torch.bool))
    return PackedLayout(shapes, queries, keys, outputs, allowed, total, heads, kv_heads)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature for one packed row: query `[1, H, T, D]`, key/value
    `[1, Hkv, T, D]`, the layout in `kwargs[LAYOUT_KEY]`; returns `[1, T, H, D]`. Per bucket, the eager kernel's
    math: `q·kᵀ·scaling` plus the mask, softmax in fp32 (or wider), back to the query's dtype, `·v`."""
    layout: PackedLayout | None = kwargs.get(LAYOUT_KEY)
    if layout is None or query.shape[0] != 1:
        raise ValueError(f"{NAME} attention runs one packed row with its layout in the forward's {LAYOUT_KEY!r}")
    _, H, T, D = query.shape
    if (T, H, key.shape[1]) != (layout.total, layout.heads, layout.kv_heads):
        raise ValueError(f"{NAME} attention: a row of {T} positions, {H}/{key.shape[1]} heads for a layout of "
                         f"{layout.total}, {layout.heads}/{layout.kv_heads}")

    def rows(x: torch.Tensor) -> torch.Tensor:  # (position, head) rows; transformers' projections are position-major
        return x[0].transpose(0, 1).contiguous().view(-1, D)

    softmax_dtype = torch.promote_types(query.dtype, torch.float32)  # at least fp32, as the eager kernel's
    sizes = [(H * n * wq, H * n * wk) for n, wq, wk in layout.shapes]
    qs = layout.queries(rows(query)).split([a for a, _ in sizes])
    ks = layout.keys(rows(key)).split([b for _, b in sizes])
    vs = layout.keys(rows(value)).split([b for _, b in sizes])
    outs = []
    for (n, wq, wk), bias, q, k, v in zip(layout.shapes, layout.bias(query.dtype), qs, ks, vs):
        q, k, v = q.view(H * n, wq, D), k.view(H * n, wk, D), v.view(H * n, wk, D)
        scores = torch.add(bias, torch.bmm(q, k.transpose(1, 2)).view(H, n, wq, wk), alpha=scaling)
        probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(query.dtype)
        probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
        outs.append(torch.bmm(probs.view(H * n, wq, wk), v).view(-1, D))
    return layout.outputs(torch.cat(outs)).view(1, T, H, D), None


def _sliding(config: Any) -> bool:
    """Whether any layer of `config` attends a sliding window (Mistral when its window is set; Qwen2/3 when they
    use theirs: `layer_types` names it per layer)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any(t != "full_attention" for t in layer_types)
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def applies(model: torch.nn.Module) -> bool:
    """Whether `model` (a transformers causal LM, peft-wrapped or not) can attend a packed row with this kernel:
    an architecture of `ARCHITECTURES`, no sliding window, and attention that is not flash-attention's (whose
    variable-length kernels transformers uses for packed rows itself)."""
    config = getattr(model, "config", None)
    return (config is not None and getattr(config, "model_type", None) in ARCHITECTURES and not _sliding(config)
            and not str(config._attn_implementation or "").startswith(("flash", "kernels")))


def require(model: torch.nn.Module) -> None:
    """Raise the error that names `learner.share_prompts` with `learner.pack_sequences` when `model` cannot share
    prompts in a packed row (this kernel does not apply to it: `applies`)."""
    if not applies(model):
        config = model.config
        raise ValueError(f"learner.share_prompts with learner.pack_sequences: a packed row shares its prompts through "
                         f"looprl's variable-length attention, which runs the architectures {sorted(ARCHITECTURES)} "
                         f"without a sliding window and with attention other than flash-attention's (this model: "
                         f"{getattr(config, 'model_type', None)!r}, {config._attn_implementation!r}); set one of "
                         f"them false")


def _register() -> None:
    from transformers import AttentionInterface
    if NAME not in AttentionInterface._global_mapping:
        # out of any compiled graph: a decoder layer compiled whole (`models.blocks.compile_decoder_layers`) runs
        # its projections, rotary, norms and residual adds compiled around it, while the layout's Python lists
        # (bucket shapes) would make every micro-batch a new graph
        AttentionInterface.register(NAME, torch.compiler.disable(varlen_attention_forward))


@contextmanager
def varlen_attention(model: torch.nn.Module) -> Iterator[None]:
    """While inside, `model` attends with `varlen_attention_forward` (its own kernel restored on exit); its forward
    then needs the layout as keyword `LAYOUT_KEY` and builds no mask."""
    _register()
    with attention_implementation(model, NAME):
        yield
