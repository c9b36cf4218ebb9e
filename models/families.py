"""Model families: how a family loads and what its training forward returns.

The learner knows no model and no method: it asks the recipe's family (`model.family`, registry kind
`family`) for the model and, per micro-batch, for the response-token quantities the loss names.

* `causal`: decoder-only LMs loaded with `AutoModelForCausalLM`. Outputs `logp [N, L]` (sampled-token
  logprobs at the rollout temperature) and `entropy [N, L]`.
* `looped`: looped LMs such as Ouro (`models/ouro.py`). Adds `loop_logp [N, L, T]` (every loop's readout)
  and `exit_pdf [N, L, T]` (the stick-breaking exit distribution); `logp` is then the final loop's.
* `masked_diffusion`: masked-diffusion LMs in the LLaDA layout (`models/diffusion.py`). `logp [N, L]` is the
  MDLM term of each response token: log p(token | noised sequence) / p at the positions the row's noise masked,
  0 elsewhere, so the token-mean NLL the SFT step takes is the MDLM loss.

`forward` takes anything with `model_inputs()`, `prompt_ids` and `response_ids` (a `rl.batch.Batch`);
this module imports only torch and transformers (and DeepSpeed, lazily, to gather a partitioned frozen head).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

import models.varlen_attention as varlen
from models.common import distinct_prompts
from models.common import length_buckets as common_length_buckets
from models.diffusion import LLaDAConfig, mask_for_training
from models.ouro import OuroConfig, exit_pdf
from models.sampling import truncates, warp_logits


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # a DeepSpeed engine wraps the model


class OutputHead:
    """`hidden -> logits` as the model's own forward computes them from its last hidden state: the output
    embedding, then the output scalings some families apply (Cohere's `logit_scale`, Granite's
    `logits_scaling`, Gemma's `final_logit_softcapping`). Calling it calls the module (not its weight) so that
    ZeRO-3 gathers a partitioned weight, also when activation checkpointing recomputes it."""

    def __init__(self, module: torch.nn.Module):
        self.linear = module.get_output_embeddings()
        cfg = getattr(module, "config", None)
        self.scale = getattr(cfg, "logit_scale", None)
        self.divide = getattr(cfg, "logits_scaling", None)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale:
            x = x * self.scale
        if self.divide:
            x = x / self.divide
        if self.softcap:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.scaled(self.linear(h))

    @property
    def frozen_partitioned(self) -> bool:
        """A frozen `nn.Linear` whose weight ZeRO-3 partitions (the base's head under an adapter). Recomputing
        its projection in backward through the module does not work there: DeepSpeed releases the frozen weight
        after the recomputed forward, before the backward reads it; `chunked_token_stats` then gathers it itself."""
        params = list(self.linear.parameters())
        return (type(self.linear) is torch.nn.Linear and all(hasattr(p, "ds_id") for p in params)
                and not any(p.requires_grad for p in params))


def output_head(module: torch.nn.Module) -> OutputHead:
    """The model's `hidden -> logits` map (`OutputHead`)."""
    return OutputHead(module)


def _token_stats(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, labels: torch.Tensor,
                 temperature: float, top_k: int, top_p: float, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of `labels [C]` and entropy `[C]` (zeros unless asked) of the distribution tokens are sampled
    from at `temperature`, truncated by `top_k`/`top_p` as the rollout did, from hidden states `h [C, H]`."""
    logits = head(h).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if truncates(top_k, top_p):
        kept = warp_logits(logits, 1.0, top_k, top_p)
        # The sampled token is in the rollout's support by construction; keep it in ours when a rounding
        # difference at the nucleus boundary would drop it (its logprob would otherwise be -inf).
        logits = kept.scatter(-1, labels[:, None], logits.gather(-1, labels[:, None]))
    log_z = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, labels[:, None]).squeeze(-1) - log_z
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    probs = (logits - log_z[:, None]).exp()
    entropy = log_z - (probs * logits.masked_fill(~torch.isfinite(logits), 0.0)).sum(-1)
    return logp, entropy


def chunked_token_stats(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, labels: torch.Tensor, *,
                        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, with_entropy: bool = False,
                        entropy_grad: bool = False, chunk_tokens: int = 512
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_token_stats` over `h [M, H]` in chunks of `chunk_tokens` tokens, recomputing the vocabulary
    projection in backward (activation checkpointing): at most one chunk's `[chunk, V]` logits exist,
    never `[N, L, V]`. The entropy keeps its graph only with `entropy_grad` (an entropy bonus)."""
    if isinstance(head, OutputHead) and head.frozen_partitioned:
        opts = (temperature, top_k, top_p, with_entropy, entropy_grad, max(1, chunk_tokens))
        logp, entropy = _PartitionedHeadStats.apply(h, labels, head, opts)
        return logp, (entropy if with_entropy else None)
    grad = torch.is_grad_enabled() and h.requires_grad
    logps, entropies = [], []
    # `split`, not a slice per chunk: a slice's backward writes its chunk's gradient into zeros of `h`'s full
    # shape and autograd then sums one such tensor per chunk; `split`'s backward concatenates the chunks' gradients
    # once (on the race's bf16 learner step: 11 chunks, a [5626, 768] zero fill and add each)
    for h_chunk, label_chunk in zip(h.split(max(1, chunk_tokens)), labels.split(max(1, chunk_tokens))):
        args = (head, h_chunk, label_chunk, temperature, top_k, top_p, with_entropy)
        lp, ent = checkpoint(_token_stats, *args, use_reentrant=False) if grad else _token_stats(*args)
        logps.append(lp)
        entropies.append(ent if entropy_grad else ent.detach())
    if not logps:
        empty = h.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


@contextmanager
def _gathered_logits(head: OutputHead) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """`hidden -> logits` of a ZeRO-3-partitioned frozen head with its weight gathered (one all-gather on every
    rank) for the duration of the block."""
    import deepspeed
    linear = head.linear
    with deepspeed.zero.GatheredParameters(list(linear.parameters()), modifier_rank=None):
        weight = linear.weight.detach()
        bias = linear.bias.detach() if linear.bias is not None else None
        yield lambda x: head.scaled(torch.nn.functional.linear(x, weight, bias))


class _PartitionedHeadStats(torch.autograd.Function):
    """`chunked_token_stats` through a frozen output head that ZeRO-3 partitions: the weight is gathered once for
    the forward's chunks and once for the backward's recomputation (one all-gather each per call, so ranks with
    different numbers of chunks stay in step), and backward recomputes each chunk's logits from the saved hidden
    states, as the checkpointed path does. Gradients flow to `h` only (the head is frozen)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, labels: torch.Tensor, head: OutputHead, opts: tuple
                ) -> tuple[torch.Tensor, torch.Tensor]:
        temperature, top_k, top_p, with_entropy, entropy_grad, chunk = opts
        ctx.save_for_backward(h, labels)
        ctx.head, ctx.opts = head, opts
        with _gathered_logits(head) as logits:
            parts = [_token_stats(logits, h[s:s + chunk], labels[s:s + chunk], temperature, top_k, top_p,
                                  with_entropy) for s in range(0, h.shape[0], chunk)]
        empty = h.new_zeros(0, dtype=torch.float32)
        logp = torch.cat([p[0] for p in parts]) if parts else empty
        entropy = torch.cat([p[1] for p in parts]) if parts else empty.clone()
        if not (with_entropy and entropy_grad):  # the entropy is a metric unless it is an entropy bonus
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple:
        h, labels = ctx.saved_tensors
        temperature, top_k, top_p, with_entropy, entropy_grad, chunk = ctx.opts
        grad_h = torch.zeros_like(h)
        with _gathered_logits(ctx.head) as logits:
            for s in range(0, h.shape[0], chunk):
                with torch.enable_grad():
                    x = h[s:s + chunk].detach().requires_grad_(True)
                    lp, ent = _token_stats(logits, x, labels[s:s + chunk], temperature, top_k, top_p, with_entropy)
                    outs, grads = [], []
                    if g_logp is not None:
                        outs.append(lp)
                        grads.append(g_logp[s:s + chunk])
                    if with_entropy and entropy_grad and g_ent is not None:
                        outs.append(ent)
                        grads.append(g_ent[s:s + chunk])
                    if outs:
                        grad_h[s:s + chunk] = torch.autograd.grad(outs, x, grads)[0]
        return grad_h, None, None, None


def response_positions(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every generated response token (`response_attn`), row-major."""
    attn = batch.response_attn if batch.response_attn is not None else batch.response_mask
    rows, cols = attn.bool().nonzero(as_tuple=True)
    return rows, cols


def packed_inputs(batch: Any, share_prompts: bool = False
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The micro-batch's real tokens in one row `[1, T]`, no padding: each row's prompt then its response (without
    the last token, whose hidden state predicts nothing), positions from 0 per sequence; with `share_prompts`, each
    distinct prompt once (`models.common.distinct_prompts`), then every row's response with positions continuing
    its prompt's. Returns the inputs; for every generated response token (row-major, as `response_positions`) the
    index in `[0, T)` of the token that predicts it; and per sequence the row positions it attends beyond its own
    (its shared prompt's, else none) and its own positions (`models.varlen_attention.packed_layout`'s arguments).
    Without shared prompts transformers' own kernels also keep the sequences apart (a new causal block where the
    positions restart); shared prompts need `models.varlen_attention`."""
    attn = batch.response_attn if batch.response_attn is not None else batch.response_mask
    n_resp = attn.long().sum(-1).tolist()
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    prefixes: list[torch.Tensor] = []
    owns: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    none = torch.zeros(0, dtype=torch.long)

    def add(tokens: torch.Tensor, start: int, prefix: torch.Tensor) -> torch.Tensor:
        offset = sum(len(x) for x in ids)
        own = torch.arange(offset, offset + len(tokens))
        ids.append(tokens)
        pos.append(torch.arange(start, start + len(tokens)))
        prefixes.append(prefix)
        owns.append(own)
        return own

    def prompt(i: int) -> torch.Tensor:
        return batch.prompt_ids[i][batch.prompt_mask[i].bool()]

    if share_prompts:
        first, inverse = distinct_prompts(batch.prompt_ids, batch.prompt_mask)
        prompt_at = [add(prompt(int(g)), 0, none) for g in first]
        for i in range(len(batch)):
            at = prompt_at[int(inverse[i])]
            own = add(batch.response_ids[i, :max(n_resp[i] - 1, 0)], len(at), at)
            src.append(torch.cat([at[-1:], own])[:n_resp[i]])
    else:
        for i in range(len(batch)):
            p = prompt(i)
            own = add(torch.cat([p, batch.response_ids[i, :max(n_resp[i] - 1, 0)]]), 0, none)
            src.append(own[len(p) - 1:len(p) - 1 + n_resp[i]])
    inputs = {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat(pos)[None]}
    return inputs, torch.cat(src), (prefixes, owns)


@contextmanager
def _packed_attention(module: torch.nn.Module, total: int, sequences: tuple[list[torch.Tensor], list[torch.Tensor]],
                      shared: bool) -> Iterator[dict[str, Any]]:
    """The forward keywords (none, or the packed layout) under which `module` attends a packed row of `total`
    positions: `models.varlen_attention`'s bucketed kernel where it applies (no `[T, T]` mask), else transformers'
    own handling of restarting positions (flash-attention's variable-length kernels; sdpa/eager through a dense
    block mask), which cannot share prompts."""
    if varlen.applies(module):
        config = module.config
        heads = config.num_attention_heads
        layout = varlen.packed_layout(*sequences, total, heads, getattr(config, "num_key_value_heads", None) or heads)
        layout = layout.to(_device(module))
        with varlen.varlen_attention(module):
            yield {varlen.LAYOUT_KEY: layout}
    else:
        if shared:
            varlen.require(module)  # raises: the kernel does not apply to this model
        yield {}


def _last_hidden(model: torch.nn.Module, inputs: dict[str, torch.Tensor], cache: Any = None, **kwargs: Any
                 ) -> torch.Tensor:
    """The hidden state the model's output head reads: the decoder's last (normed) hidden state, or for a
    looped model the readout loop's (`early_exit_step`, else the final loop).

    The model is called as a whole (a DeepSpeed engine's forward keeps ZeRO-3's micro-step bookkeeping,
    which gradient accumulation relies on), with its logits kept at no position; the decoder's output is
    read by a forward hook. With a `cache` (a transformers `DynamicCache`) the forward reads and extends it."""
    module = _unwrap(model)
    if hasattr(module, "loop_states"):
        states, _ = model(**inputs, use_cache=False, return_loop_states=True)
        step = getattr(module.config, "early_exit_step", None)
        return states[step - 1] if step else states[-1]
    captured: dict[str, torch.Tensor] = {}

    def grab(_module: torch.nn.Module, _args: Any, out: Any) -> None:
        captured["h"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    handle = module.get_decoder().register_forward_hook(grab)
    try:
        none = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        cached = {"use_cache": True, "past_key_values": cache} if cache is not None else {"use_cache": False}
        model(**inputs, **cached, logits_to_keep=none, **kwargs)
    finally:
        handle.remove()
    return captured["h"]


# Padding a response bucket may carry. Measured on the race's learner step (85M, bf16, 128 rows of sampled lengths,
# `benchmarks/learner_step.py --lengths race --max-padding 0.25 0.05`): at 0.25 the longest bucket took rows down
# to half its width (7,114 positions run for 5,593 predicted tokens) and the step ran 16.1 s; at 0.05 five buckets
# ran 6,138 positions in 12.7 s (the matmuls already run at the machine's rate, so every padded position costs).
BUCKET_MAX_PADDING = 0.05


def length_buckets(lengths: list[int], max_padding: float = BUCKET_MAX_PADDING, min_tokens: int = 256
                   ) -> list[list[int]]:
    """Row indices grouped for forwards at their own width (`models.common.length_buckets`), unless a bucket holds
    fewer than `min_tokens` real tokens (a matmul of a few rows runs below the machine's rate, and each bucket is
    one more forward through every layer)."""
    return common_length_buckets(lengths, max_padding, min_tokens)


def shared_prompt_hidden(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The decoder's last hidden state at every position that predicts a response token, `[N, L, H]` (column j
    predicts response token j; zeros where no token is predicted), computing each distinct prompt once: the prompts
    run as G distinct rows (`models.common.distinct_prompts`) into a KV cache, whose rows are repeated for the rows
    that share them (with their graph: the repeats' gradients add up in the prompt's forward); the responses then
    run after it in buckets of similar length (`length_buckets`), each at its own width, without their last token
    (its hidden state predicts nothing). Equal to the padded forward up to float rounding (the same masks and
    positions). With n samples per prompt the prompt's tokens cost 1/n of their matmuls, forward and backward, and
    the responses' padding mostly goes. Without repeated prompts: the padded forward."""
    from transformers import DynamicCache
    module = _unwrap(model)
    device = _device(module)
    first, inverse = distinct_prompts(batch.prompt_ids, batch.prompt_mask)
    inputs = batch.model_inputs()
    P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    if len(first) == len(inverse):  # no prompt repeats: one forward over the padded rows
        return _last_hidden(model, {k: v.to(device) for k, v in inputs.items()})[:, P - 1:P - 1 + L]
    cache = DynamicCache(config=module.config)
    prompt = {"input_ids": batch.prompt_ids[first], "attention_mask": inputs["attention_mask"][first, :P],
              "position_ids": inputs["position_ids"][first, :P]}
    h_last = _last_hidden(model, {k: v.to(device) for k, v in prompt.items()}, cache)[:, -1]
    prompt_state = [dict(vars(layer)) for layer in cache.layers]  # each layer as the prompts left it
    resp = batch.response_attn if batch.response_attn is not None else batch.response_mask
    lengths = resp.long().sum(-1).tolist()
    parts, order = [], []
    for rows in length_buckets(lengths):
        width = max(1, lengths[rows[0]])  # tokens predicted; the forward runs the first width - 1
        index = torch.tensor(rows)
        at = inverse[index].to(device)
        h = h_last.index_select(0, at)[:, None]
        if width > 1:
            for layer, state in zip(cache.layers, prompt_state):
                vars(layer).update(state)
                layer.keys, layer.values = state["keys"].index_select(0, at), state["values"].index_select(0, at)
            run = {"input_ids": batch.response_ids[index, :width - 1],
                   "attention_mask": inputs["attention_mask"][index, :P + width - 1],
                   "position_ids": inputs["position_ids"][index, P:P + width - 1]}
            h = torch.cat([h, _last_hidden(model, {k: v.to(device) for k, v in run.items()}, cache)], 1)
        parts.append(torch.nn.functional.pad(h, (0, 0, 0, L - width)))
        order.extend(rows)
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(parts).index_select(0, back.to(device))


def response_logprobs(model: torch.nn.Module, batch: Any, temperature: float = 1.0,
                      with_entropy: bool = False, entropy_grad: bool = False, *, top_k: int = 0, top_p: float = 1.0,
                      pack: bool = False, share_prompts: bool = False, chunk_tokens: int = 512,
                      sequence_parallel: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[N, L]` logprobs of `batch.response_ids` under a causal `model` (and entropy `[N, L]` if asked),
    of the distribution the rollout sampled from: logits at `temperature`, truncated by `top_k`/`top_p`.

    The decoder runs once on the padded batch, or with `pack` on its real tokens in one row, or with
    `share_prompts` once per distinct prompt and then on the responses (`shared_prompt_hidden`); the vocabulary
    projection then runs only at generated response positions, chunk by chunk (`chunked_token_stats`).
    The entropy is a metric unless `entropy_grad` (an entropy bonus in the loss): then it keeps its graph.
    Positions past a response's end get 0. With `sequence_parallel` (`models.sequence_parallel.SequenceParallel`)
    each rank of the group runs its share of every sequence and all get the whole result.
    """
    stats = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "with_entropy": with_entropy,
             "entropy_grad": entropy_grad, "chunk_tokens": chunk_tokens}
    if sequence_parallel is not None:
        return _sequence_parallel_logprobs(model, batch, sequence_parallel, stats)
    module = _unwrap(model)
    device = _device(module)
    rows, cols = response_positions(batch)
    if pack:
        inputs, src, sequences = packed_inputs(batch, share_prompts=share_prompts)
        with _packed_attention(module, inputs["input_ids"].shape[1], sequences, share_prompts) as kwargs:
            h = _last_hidden(model, {k: v.to(device) for k, v in inputs.items()}, **kwargs)[0, src.to(device)]
    elif share_prompts:
        h = shared_prompt_hidden(model, batch)[rows.to(device), cols.to(device)]
    else:
        inputs = {k: v.to(device) for k, v in batch.model_inputs().items()}
        P = batch.prompt_ids.shape[1]
        h = _last_hidden(model, inputs)[rows.to(device), (P - 1 + cols).to(device)]
    labels = batch.response_ids[rows, cols].to(device)
    logp, entropy = chunked_token_stats(output_head(module), h, labels, **stats)
    return _scatter(logp, rows, cols, batch), (_scatter(entropy, rows, cols, batch) if entropy is not None else None)


def _sequence_parallel_logprobs(model: torch.nn.Module, batch: Any, sp: Any, stats: dict[str, Any]
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` with each row's columns split over the sequence-parallel group
    (`models.sequence_parallel`): this rank projects the response tokens its columns predict, and a sum over
    the group gives every rank all of them."""
    from models.sequence_parallel import gather_over_group, local_columns, right_padded_rows
    module = _unwrap(model)
    device = _device(module)
    rows, cols = response_positions(batch)
    ids, positions, src = right_padded_rows(batch, sp.size)
    part = local_columns(ids.shape[1], sp)
    h = _last_hidden(model, {"input_ids": ids[:, part].to(device), "position_ids": positions[:, part].to(device)})
    mine = ((src >= part.start) & (src < part.stop)).nonzero(as_tuple=True)[0]
    rows, cols, src = rows[mine], cols[mine], src[mine] - part.start
    # a rank whose columns predict no response token still projects one position (its result unused): under
    # ZeRO-3 the head's gathers are collectives that every rank joins, forward and backward
    picked = h[rows.to(device), src.to(device)] if len(mine) else h[:1, 0]
    labels = batch.response_ids[rows, cols].to(device) if len(mine) else torch.zeros(1, dtype=torch.long,
                                                                                       device=device)
    logp, entropy = chunked_token_stats(output_head(module), picked, labels, **stats)
    keep = len(mine)
    local = _scatter(logp[:keep], rows, cols, batch) + 0.0 * logp.sum()  # the graph reaches the head on every rank
    full = gather_over_group(local, sp)
    if entropy is None:
        return full, None
    return full, gather_over_group(_scatter(entropy[:keep], rows, cols, batch) + 0.0 * entropy.sum(), sp)


@torch.no_grad()
def sequence_embeddings(model: torch.nn.Module, batch: Any, tokens: str = "response"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the mean of the decoder's last hidden state over its trained response tokens
    (`response_mask`; `tokens="all"`: over every real token) `[N, d]`, and the `[N, L]` logprobs of its response
    tokens (from the same forward, projected chunk by chunk)."""
    module = _unwrap(model)
    device = _device(module)
    inputs = {k: v.to(device) for k, v in batch.model_inputs().items()}
    h = _last_hidden(model, inputs).float()
    P = batch.prompt_ids.shape[1]
    mask = batch.response_mask.to(device)
    if tokens == "all":
        attn = batch.response_attn if batch.response_attn is not None else batch.response_mask
        mask = torch.cat([batch.prompt_mask, attn], dim=1).to(device).float()
        pooled = (h * mask[..., None]).sum(1)
    else:
        pooled = (h[:, P:] * mask[..., None]).sum(1)
    emb = pooled / mask.sum(1, keepdim=True).clamp(min=1)
    rows, cols = response_positions(batch)
    logp, _ = chunked_token_stats(output_head(module), h[rows.to(device), (P - 1 + cols).to(device)],
                                  batch.response_ids[rows, cols].to(device))
    return emb.cpu(), _scatter(logp, rows, cols, batch).cpu()


def _scatter(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, batch: Any) -> torch.Tensor:
    out = values.new_zeros(batch.response_ids.shape)
    return out.index_put((rows.to(values.device), cols.to(values.device)), values)


def response_loop_logprobs(model: torch.nn.Module, batch: Any, temperature: float = 1.0,
                           with_entropy: bool = False, chunk_tokens: int = 512, sequence_parallel: Any = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For a looped model: `[N, L, T]` logprobs of the response tokens under each loop's readout at
    `temperature`, the `[N, L, T]` exit pdf at those positions, and the final loop's entropy `[N, L]` as a
    metric (no graph) if asked. Every loop's readout is projected at the generated positions only, `chunk_tokens`
    at a time and recomputed in backward (`chunked_token_stats`), so no `[N, L, V]` logits exist for any loop,
    nor for the entropy. With `sequence_parallel` each rank of the group runs its share of every sequence."""
    module = _unwrap(model)
    if not hasattr(module, "loop_states"):
        raise TypeError(f"per-loop logprobs need a looped model (model_type ouro); {type(module).__name__} has none")
    if sequence_parallel is not None:
        return _sequence_parallel_loop_logprobs(model, batch, sequence_parallel, temperature, with_entropy,
                                                chunk_tokens)
    device = _device(module)
    inputs = {k: v.to(device) for k, v in batch.model_inputs().items()}
    states, gate_logits = model(**inputs, use_cache=False, return_loop_states=True)  # through a DeepSpeed engine
    P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    states = [h[:, P - 1:P + L - 1] for h in states]
    temp = temperature if temperature > 0 else 1.0
    rows, cols = response_positions(batch)
    at, labels = (rows.to(device), cols.to(device)), batch.response_ids[rows, cols].to(device)
    head = output_head(module)
    loop_logp = torch.stack([_scatter(chunked_token_stats(head, h[at], labels, temperature=temp,
                                                          chunk_tokens=chunk_tokens)[0], rows, cols, batch)
                             for h in states], dim=-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            _, ent = chunked_token_stats(head, states[-1][at], labels, temperature=temp, with_entropy=True,
                                         chunk_tokens=chunk_tokens)
        entropy = _scatter(ent, rows, cols, batch)
    return loop_logp, exit_pdf(gate_logits[:, P - 1:P + L - 1]), entropy


def _sequence_parallel_loop_logprobs(model: torch.nn.Module, batch: Any, sp: Any, temperature: float,
                                     with_entropy: bool, chunk_tokens: int
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`response_loop_logprobs` with each row's columns split over the sequence-parallel group: this rank reads
    out every loop and the exit gates at the response tokens its columns predict; sums over the group give every
    rank all of them (`models.sequence_parallel`)."""
    from models.sequence_parallel import gather_over_group, local_columns, right_padded_rows
    module = _unwrap(model)
    device = _device(module)
    rows, cols = response_positions(batch)
    ids, positions, src = right_padded_rows(batch, sp.size)
    part = local_columns(ids.shape[1], sp)
    states, gate_logits = model(input_ids=ids[:, part].to(device), position_ids=positions[:, part].to(device),
                                use_cache=False, return_loop_states=True)
    mine = ((src >= part.start) & (src < part.stop)).nonzero(as_tuple=True)[0]
    rows, cols, src = rows[mine], cols[mine], src[mine] - part.start
    # a rank whose columns predict no response token still projects one position (see _sequence_parallel_logprobs)
    at = (rows.to(device), src.to(device)) if len(mine) else (torch.zeros(1, dtype=torch.long, device=device),) * 2
    labels = batch.response_ids[rows, cols].to(device) if len(mine) else torch.zeros(1, dtype=torch.long,
                                                                                       device=device)
    head, keep, temp = output_head(module), len(mine), temperature if temperature > 0 else 1.0

    def gathered(values: torch.Tensor) -> torch.Tensor:  # `[M, ...]` at this rank's tokens -> `[N, L, ...]`
        local = values.new_zeros((*batch.response_ids.shape, *values.shape[1:]))
        local = local.index_put((rows.to(device), cols.to(device)), values[:keep]) + 0.0 * values.sum()
        return gather_over_group(local, sp)

    loop_logp = gathered(torch.stack([chunked_token_stats(head, h[at], labels, temperature=temp,
                                                          chunk_tokens=chunk_tokens)[0] for h in states], dim=-1))
    pdf = gathered(exit_pdf(gate_logits[at]))
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = gathered(chunked_token_stats(head, states[-1][at], labels, temperature=temp, with_entropy=True,
                                                   chunk_tokens=chunk_tokens)[1])
    return loop_logp, pdf, entropy


def _attn_kwargs(attn_implementation: str | None) -> dict[str, str]:
    """`from_pretrained` keywords choosing transformers' attention kernel (none: the model's own). On CPU at
    short lengths `eager` trains faster than `sdpa`, whose fused CPU kernel has a slow backward."""
    return {"attn_implementation": attn_implementation} if attn_implementation else {}


class CausalFamily:
    """Decoder-only LMs (Llama, Qwen, the tiny model of `models/tiny.py`, ...).

    `chunk_tokens`: response tokens per vocabulary-projection chunk. `supports_packing`: transformers'
    attention (sdpa, eager, flash-attention) starts a new causal block where position ids restart, so a
    micro-batch may run as one packed row (tested against the padded forward). `share_prompts`
    (`supports_shared_prompts`): the rows of a micro-batch that repeat a prompt share its forward
    (`shared_prompt_hidden`; padded batches only).
    """

    name = "causal"
    outputs: tuple[str, ...] = ("logp", "entropy")
    supports_packing = True
    supports_shared_prompts = True

    supports_sequence_parallel = True

    def __init__(self, chunk_tokens: int = 512, share_prompts: bool = False):
        self.chunk_tokens = chunk_tokens
        self.share_prompts = share_prompts
        # set by the learner with learner.sequence_parallel_size > 1 (`models.sequence_parallel.SequenceParallel`)
        self.sequence_parallel: Any = None

    def prepare_sequence_parallel(self, model: torch.nn.Module, sp: Any) -> None:
        """What a loaded model needs for sequence parallelism beyond transformers' attention (nothing here)."""

    def load(self, path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
             attn_implementation: str | None = None) -> torch.nn.Module:
        """`attn_implementation`: transformers' attention kernel (None: the model's own). A folder whose projections
        are stored as low-rank factors (`models.lowrank`, the decomper stage's output) loads with them."""
        from models.lowrank import load_causal_lm
        return load_causal_lm(path, dtype=dtype, trust_remote_code=trust_remote_code,
                              **_attn_kwargs(attn_implementation))

    def forward(self, model: torch.nn.Module, batch: Any, *, temperature: float = 1.0,
                outputs: frozenset[str] | set[str] = frozenset({"logp"}), entropy_grad: bool = False,
                top_k: int = 0, top_p: float = 1.0, pack: bool = False) -> dict[str, torch.Tensor]:
        """The `outputs` asked for (a subset of `self.outputs`; `logp` is always returned), under the
        distribution the rollout sampled from (`temperature`, `top_k`, `top_p`)."""
        if pack and not self.supports_packing:
            raise ValueError(f"model family {self.name!r} cannot run packed sequences (learner.pack_sequences)")
        logp, entropy = response_logprobs(model, batch, temperature, with_entropy="entropy" in outputs,
                                          entropy_grad=entropy_grad, top_k=top_k, top_p=top_p, pack=pack,
                                          share_prompts=self.share_prompts, chunk_tokens=self.chunk_tokens,
                                          sequence_parallel=self.sequence_parallel)
        return {"logp": logp, "entropy": entropy} if entropy is not None else {"logp": logp}


class LoopedFamily(CausalFamily):
    """Looped LMs (Ouro): the shared layer stack runs T times, each loop has a readout and an exit gate.

    The plain forward reads out the final loop (`early_exit_threshold: 1.0`, the shipped setting), or the
    loop `early_exit_step` names; a per-token early exit (threshold < 1) is not trained on. Its attention
    builds its own masks, so it runs padded batches only.
    """

    name = "looped"
    outputs = ("logp", "entropy", "loop_logp", "exit_pdf")
    model_types = (OuroConfig.model_type,)
    supports_packing = False
    supports_shared_prompts = False  # a loop's cache is its own kind

    def prepare_sequence_parallel(self, model: torch.nn.Module, sp: Any) -> None:
        """Ouro's attention is its own module: DeepSpeed's exchange goes around each layer's sdpa call."""
        from models.sequence_parallel import attach_looped
        attach_looped(model, sp)

    def load(self, path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
             attn_implementation: str | None = None) -> torch.nn.Module:
        if attn_implementation not in (None, "sdpa"):
            raise ValueError(f"learner.attn_implementation {attn_implementation!r}: the looped family's attention is "
                             f"Ouro's own sdpa call; leave it null")
        return super().load(path, dtype=dtype, trust_remote_code=trust_remote_code)

    def forward(self, model: torch.nn.Module, batch: Any, *, temperature: float = 1.0,
                outputs: frozenset[str] | set[str] = frozenset({"logp"}), entropy_grad: bool = False,
                top_k: int = 0, top_p: float = 1.0, pack: bool = False) -> dict[str, torch.Tensor]:
        cfg = _unwrap(model).config
        if getattr(cfg, "early_exit_threshold", 1.0) < 1.0 and not getattr(cfg, "early_exit_step", None):
            raise ValueError("looped family: a per-token early exit (early_exit_threshold < 1) samples each token "
                             "from a different loop; train with early_exit_threshold 1.0 (the shipped value) or "
                             "a fixed early_exit_step")
        if not {"loop_logp", "exit_pdf"} & set(outputs):  # one readout: the decoder's last hidden state
            return super().forward(model, batch, temperature=temperature, outputs=outputs,
                                   entropy_grad=entropy_grad, top_k=top_k, top_p=top_p, pack=pack)
        if entropy_grad:
            raise ValueError("an entropy bonus in the loss is not supported with per-loop outputs "
                             "(the final loop's entropy is a metric)")
        if truncates(top_k, top_p):
            raise ValueError("per-loop outputs are logprobs of each loop's full distribution; rollout.top_k/top_p "
                             "truncation is not supported with them")
        loop_logp, pdf, entropy = response_loop_logprobs(model, batch, temperature, "entropy" in outputs,
                                                         chunk_tokens=self.chunk_tokens,
                                                         sequence_parallel=self.sequence_parallel)
        out = {"logp": loop_logp[..., -1], "loop_logp": loop_logp, "exit_pdf": pdf}  # the final loop samples
        if entropy is not None:
            out["entropy"] = entropy
        return out


class ValueFamily:
    """Value models for PPO's critic: the policy's architecture with a scalar head per token (transformers'
    `AutoModelForTokenClassification` with one label; a causal-LM checkpoint gets a new head). Outputs
    `values [N, L]`: V of the state before each response token, read where that token is predicted."""

    name = "value"
    outputs: tuple[str, ...] = ("values",)
    supports_packing = True

    def __init__(self, chunk_tokens: int = 512):
        self.chunk_tokens = chunk_tokens  # unused: the head is one column wide

    def load(self, path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
             attn_implementation: str | None = None) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForTokenClassification
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        config.num_labels, config.classifier_dropout = 1, 0.0  # a deterministic regression head
        return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype,
                                                               trust_remote_code=trust_remote_code,
                                                               **_attn_kwargs(attn_implementation))

    def forward(self, model: torch.nn.Module, batch: Any, *, outputs: frozenset[str] | set[str] = frozenset(),
                pack: bool = False, **_sampling: Any) -> dict[str, torch.Tensor]:
        """`{"values": [N, L]}` (0 past each response's end); sampling settings do not apply."""
        device = _device(_unwrap(model))
        rows, cols = response_positions(batch)
        if pack:
            inputs, src, sequences = packed_inputs(batch)
            with _packed_attention(_unwrap(model), inputs["input_ids"].shape[1], sequences, False) as kwargs:
                scores = model(**{k: v.to(device) for k, v in inputs.items()}, use_cache=False, **kwargs).logits
            v = scores[0, src.to(device), 0]
        else:
            scores = model(**{k: v.to(device) for k, v in batch.model_inputs().items()}, use_cache=False).logits
            v = scores[rows.to(device), (batch.prompt_ids.shape[1] - 1 + cols).to(device), 0]
        return {"values": _scatter(v.float(), rows, cols, batch)}


class SequenceScoreFamily:
    """Reward models: the policy's architecture with a scalar head read at each sequence's last real token
    (transformers' `AutoModelForSequenceClassification` with one label, which pools at the rightmost
    non-pad token: the EOS after the response). Outputs `scores [N]`."""

    name = "sequence_score"
    outputs: tuple[str, ...] = ("scores",)
    supports_packing = False  # the classification head pools one position per row of the padded batch

    def __init__(self, chunk_tokens: int = 512):
        self.chunk_tokens = chunk_tokens  # unused: the head is one column wide

    def load(self, path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
             attn_implementation: str | None = None) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForSequenceClassification
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        config.num_labels, config.classifier_dropout = 1, 0.0
        return AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype,
                                                                  trust_remote_code=trust_remote_code,
                                                                  **_attn_kwargs(attn_implementation))

    def forward(self, model: torch.nn.Module, batch: Any, *, outputs: frozenset[str] | set[str] = frozenset(),
                pack: bool = False, **_sampling: Any) -> dict[str, torch.Tensor]:
        if pack:
            raise ValueError("model family 'sequence_score' cannot run packed sequences")
        device = _device(_unwrap(model))
        logits = model(**{k: v.to(device) for k, v in batch.model_inputs().items()}, use_cache=False).logits
        return {"scores": logits[:, 0].float()}


def masked_token_logp(model: torch.nn.Module, batch: Any, *, eps: float = 1e-3, chunk_tokens: int = 512
                      ) -> torch.Tensor:
    """`[N, L]` MDLM terms of a masked-diffusion `model` on `batch`: each row's response is noised
    (`models.diffusion.mask_for_training`, seeded per row by the batch extra `noise_seed`, which the caller must
    set: seeds that repeat from step to step would train on one noise pattern), the prompt stays clean, and at
    every masked position the term is log p(clean token) / p; unmasked positions get 0. −Σ terms / (response
    tokens) is the MDLM (LLaDA SFT) loss; its expectation over the noise bounds the response's NLL from above."""
    module = _unwrap(model)
    device = _device(module)
    attn = batch.response_attn if batch.response_attn is not None else batch.response_mask
    if "noise_seed" not in batch.extras:
        raise ValueError("a masked-diffusion batch needs its per-row noise seeds: set the batch extra `noise_seed` "
                         "(rl.sft.noise_seeds gives a training step's); without them every step would draw the same "
                         "masks")
    seeds = batch.extras["noise_seed"].value
    masked, rate = mask_for_training(attn, seeds, eps)
    noisy = batch.response_ids.masked_fill(masked, module.config.mask_token_id)
    inputs = {"input_ids": torch.cat([batch.prompt_ids, noisy], 1).to(device),
              "attention_mask": torch.cat([batch.prompt_mask.long(), attn.long()], 1).to(device)}
    h = _last_hidden(model, inputs)
    rows, cols = masked.nonzero(as_tuple=True)
    P = batch.prompt_ids.shape[1]
    logp, _ = chunked_token_stats(output_head(module), h[rows.to(device), (P + cols).to(device)],
                                  batch.response_ids[rows, cols].to(device), chunk_tokens=chunk_tokens)
    return _scatter(logp / rate.to(logp.device)[rows.to(logp.device)], rows, cols, batch)


class MaskedDiffusionFamily:
    """Masked-diffusion LMs (`model_type: llada`, `models/diffusion.py`): trained by SFT with the MDLM loss through
    the same learner (`logp` holds the per-token MDLM terms, `masked_token_logp`); sampled by the `hf` engine's
    diffusion decoding. Their `logp` is not a sampling log-probability, so RL losses do not apply.

    `eps`: the smallest mask rate (p = (1 − eps)·t + eps), LLaDA's 1e-3."""

    name = "masked_diffusion"
    outputs: tuple[str, ...] = ("logp",)
    model_types = (LLaDAConfig.model_type,)
    supports_packing = False

    def __init__(self, chunk_tokens: int = 512, eps: float = 1e-3):
        self.chunk_tokens, self.eps = chunk_tokens, eps

    def load(self, path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
             attn_implementation: str | None = None) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModel
        config = AutoConfig.from_pretrained(path)
        if config.model_type not in self.model_types:
            raise ValueError(f"model family 'masked_diffusion' loads model_type llada, {path} is "
                             f"{config.model_type!r}")
        return AutoModel.from_pretrained(path, dtype=dtype)  # looprl's own LLaDA class: no remote code

    def forward(self, model: torch.nn.Module, batch: Any, *, outputs: frozenset[str] | set[str] = frozenset({"logp"}),
                pack: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                entropy_grad: bool = False) -> dict[str, torch.Tensor]:
        if pack:
            raise ValueError("model family 'masked_diffusion' cannot run packed sequences")
        if set(outputs) - {"logp"} or entropy_grad:
            raise ValueError(f"model family 'masked_diffusion' provides only its MDLM terms (logp), not "
                             f"{sorted(set(outputs) - {'logp'}) or ['an entropy bonus']}")
        return {"logp": masked_token_logp(model, batch, eps=self.eps, chunk_tokens=self.chunk_tokens)}


def family_for_model_type(model_type: str) -> str:
    """The family that `model.family: auto` picks for a transformers `model_type`."""
    if model_type in MaskedDiffusionFamily.model_types:
        return MaskedDiffusionFamily.name
    return LoopedFamily.name if model_type in LoopedFamily.model_types else CausalFamily.name
