"""Ulysses sequence parallelism for the learner's forward (`learner.sequence_parallel_size`), on DeepSpeed's
ALST integration (`deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF`).

The `s` ranks of a sequence-parallel group hold the same micro-batch. Each row is laid out as one sequence,
right-padded (prompt, then response), and every rank runs the decoder on its `1/s` of the columns; in each
attention layer DeepSpeed's all-to-all exchanges heads for sequence, so attention sees the whole sequence
(heads divisible by `s`). Causal attention never looks right, so right padding needs no mask: DeepSpeed's
wrapper drops the mask and attends causally by the gathered positions. Each rank projects the response tokens
its columns predict; a sum over the group (`all_reduce` with autograd) gives every rank the full `[N, L]`
logprobs, so any loss (token, sequence or group level) is computed as without sequence parallelism.

Gradients: the all-reduce's backward sums the `s` identical losses' gradients, so each rank backpropagates
`s x` its tokens' share; the learner scales the loss by the data-parallel size (world / s) instead of the
world size, and DeepSpeed's average over all ranks then gives the full-batch gradient (tested against one
rank). Packed rows need flash-attention's variable-length kernels (positions restarting inside a row), so
they are refused here; so are shared prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group."""

    group: Any  # the torch process group of the `size` ranks that share a micro-batch
    rank: int
    size: int


def register(model_path: str, attn_implementation: str, size: int, micro_batch_size: int) -> SequenceParallel:
    """Route transformers' `attn_implementation` through DeepSpeed's Ulysses attention (process-wide: the policy
    and the reference both) and form the groups: ranks `[k*size, (k+1)*size)` share a micro-batch.

    As DeepSpeed's `UlyssesSPAttentionHF.register_with_transformers` does, except that the attention takes each
    call's batch size (micro-batches of a token budget, logprob passes and the last micro-batch differ in rows);
    DeepSpeed's fixes it at registration. `micro_batch_size` only sizes the first call."""
    import deepspeed.comm as dist
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if attn_implementation in ("eager", "paged|eager") or attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"learner.sequence_parallel_size: attention {attn_implementation!r} cannot run Ulysses "
                         f"sequence parallelism (sdpa or a flash-attention kernel can)")
    mpu.initialize_sequence_parallel(sequence_parallel_size=size)
    arch = AutoConfig.from_pretrained(model_path).get_text_config()
    heads = arch.num_attention_heads
    uattn = UlyssesSPAttentionHF(
        attn=ALL_ATTENTION_FUNCTIONS[attn_implementation], batch_size=micro_batch_size, attn_head_count=heads,
        attn_head_size=getattr(arch, "head_dim", None) or arch.hidden_size // heads,
        kv_head_count=getattr(arch, "num_key_value_heads", None) or heads, num_hidden_layers=arch.num_hidden_layers,
        process_group=mpu.get_sequence_parallel_group(), seq_length_is_variable=True)
    uattn.core_attn_implementation = attn_implementation

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        rows = query.shape[0]
        if rows != uattn.batch_size:  # the shapes DeepSpeed checks and reshapes to, at this call's batch size
            uattn.batch_size = rows
            uattn.required_query_shape = _with_rows(uattn.required_query_shape, rows)
            uattn.required_key_value_shape = _with_rows(uattn.required_key_value_shape, rows)
            uattn.required_context_shape = _with_rows(uattn.required_context_shape, rows)
        # positions, not the mask, make attention causal across the gathered sequence (right padding needs none)
        return uattn(module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[attn_implementation] = attention
    group = mpu.get_sequence_parallel_group()
    return SequenceParallel(group, dist.get_rank(group=group), size)


def _causal_core(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention over the gathered sequence (`[bs, hc, sl, hs]` in, `[bs, sl, hc, hs]` out), key and value
    heads repeated to the query's: the looped model's own sdpa call, without its mask (rows are right-padded)."""
    import torch.nn.functional as F
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                         dropout_p=module.dropout if module.training else 0.0)
    return out.transpose(1, 2), None


def attach_looped(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """Give every attention layer of a looped model (`models.ouro`: its own attention, not transformers') DeepSpeed's
    Ulysses exchange around its causal sdpa call. Sliding-window layers are refused (their mask is not causal
    alone)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    config = getattr(model, "config", None) or model.module.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("learner.sequence_parallel_size: this looped model has sliding-window layers, whose mask "
                         "sequence parallelism does not build; set it to 1")
    heads = config.num_attention_heads
    uattn = UlyssesSPAttentionHF(
        attn=_causal_core, batch_size=1, attn_head_count=heads, attn_head_size=config.head_dim,
        kv_head_count=config.num_key_value_heads, num_hidden_layers=config.num_hidden_layers,
        process_group=sp.group, seq_length_is_variable=True)

    def attention(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows, local = q.shape[0], q.shape[2]
        if rows != uattn.batch_size:
            uattn.batch_size = rows
            uattn.required_query_shape = _with_rows(uattn.required_query_shape, rows)
            uattn.required_key_value_shape = _with_rows(uattn.required_key_value_shape, rows)
            uattn.required_context_shape = _with_rows(uattn.required_context_shape, rows)
        # DeepSpeed gathers position ids for transformers' kernels; the causal core needs none but the shape
        positions = torch.zeros((rows, local), dtype=torch.long, device=q.device)
        out, _ = uattn(module, q, k, v, None, position_ids=positions)
        return out

    for layer in model.modules():
        if hasattr(layer, "sequence_parallel") and hasattr(layer, "o_proj"):
            layer.sequence_parallel = attention


def _with_rows(shape: torch.Size, rows: int) -> torch.Size:
    """`[sl, bs, ...]` with `bs = rows`."""
    return torch.Size([shape[0], rows, *shape[2:]])


def right_padded_rows(batch: Any, multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row as one sequence from column 0 (its prompt's real tokens, then its response without the last
    token), right-padded to a width that `multiple` divides. Returns `input_ids`, `position_ids` `[N, T]` and,
    for every response token (row-major, as `models.families.response_positions`), the column of the token
    that predicts it."""
    attn = batch.response_attn if batch.response_attn is not None else batch.response_mask
    n_resp = attn.long().sum(-1).tolist()
    rows, cols = attn.bool().nonzero(as_tuple=True)
    seqs, prompt_len = [], []
    for i in range(len(batch)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        prompt_len.append(len(prompt))
        seqs.append(torch.cat([prompt, batch.response_ids[i, :max(n_resp[i] - 1, 0)]]))
    width = max(len(s) for s in seqs)
    width = -(-max(width, 1) // multiple) * multiple
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    positions = torch.arange(width).expand(len(seqs), width).contiguous()
    src = torch.tensor(prompt_len, dtype=torch.long)[rows] - 1 + cols
    return ids, positions, src


def local_columns(width: int, sp: SequenceParallel) -> slice:
    """This rank's columns of a row `width` wide."""
    local = width // sp.size
    return slice(sp.rank * local, (sp.rank + 1) * local)


class _SumOverGroup(torch.autograd.Function):
    """Sum over a process group, forward and backward (each rank's input gets the summed output gradient)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist
        ctx.group = group
        out = local.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def gather_over_group(local: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The sum over the group of tensors that are zero outside each rank's own entries (so: every rank's
    entries), with autograd (its backward sums the ranks' gradients)."""
    return _SumOverGroup.apply(local, sp.group)
