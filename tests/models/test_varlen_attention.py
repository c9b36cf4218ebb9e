"""Variable-length attention over a packed row (`models/varlen_attention.py`): its layout by hand, the kernel
against each sequence's own attention (values and gradients, shared prefixes and grouped heads included), and
packed rows with shared prompts against the padded forward on real transformers models."""

import pytest
import torch

import models.varlen_attention as varlen
from models.families import response_logprobs
from models.tiny import build_tiny_tokenizer
from models.varlen_attention import packed_layout, varlen_attention_forward


def test_packed_layout_by_hand():
    """A prompt (positions 0, 1) and a response after it (2, 3) that attends to it: the response (4 keys) and the
    prompt (2 keys) fall in two buckets (one bucket would pad 8 > 1.05 x 6)."""
    at = torch.arange
    layout = packed_layout([torch.zeros(0, dtype=torch.long), at(2)], [at(2), at(2, 4)], total=4, heads=1,
                           kv_heads=1)
    assert layout.shapes == [(1, 2, 4), (1, 2, 2)]  # the response first (longest), then the prompt
    assert layout.allowed[0].tolist() == [[[True, True, True, False], [True, True, True, True]]]
    assert layout.allowed[1].tolist() == [[[True, False], [True, True]]]
    assert layout.queries.index.tolist() == [2, 3, 0, 1]
    assert layout.keys.index.tolist() == [0, 1, 2, 3, 0, 1]
    # a key's gradient: its own sequence's slot, plus (for the prompt) the response's prefix slots
    assert layout.keys.back.tolist() == [4, 5, 2, 3]
    assert layout.keys.extra_slots.tolist() == [0, 1] and layout.keys.extra_rows.tolist() == [0, 1]
    assert layout.outputs.index.tolist() == [2, 3, 0, 1]  # row position p's output: query slot of p
    with pytest.raises(ValueError, match="cover the row's 5 positions once each"):
        packed_layout([torch.zeros(0, dtype=torch.long)], [at(4)], total=5, heads=1, kv_heads=1)
    with pytest.raises(ValueError, match="not a multiple"):
        packed_layout([torch.zeros(0, dtype=torch.long)], [at(4)], total=4, heads=3, kv_heads=2)


@pytest.mark.parametrize("offset", [0, 1])
def test_the_row_gather_equals_index_select_forward_and_backward(offset):
    """`Gather` against torch's `index_select`: rows read as 8-byte words (offset 0) or not (a bf16 view starting
    one element in), a row gathered twice (its gradients add) and one never gathered (zero gradient)."""
    from models.varlen_attention import _gather
    flat = torch.randn(offset + 5 * 4, generator=torch.Generator().manual_seed(0)).bfloat16()
    rows = flat[offset:].view(5, 4).detach().requires_grad_()
    assert rows.storage_offset() == offset
    index = torch.tensor([3, 0, 3, 1, 4])
    gather = _gather(index, 5, torch.tensor([True, True, False, True, True]), torch.ones(5, dtype=torch.bool))
    grad = torch.randn(5, 4).bfloat16()
    out = gather(rows)
    assert torch.equal(out, rows.index_select(0, index))
    mine = torch.autograd.grad(out, rows, grad)[0]
    theirs = torch.autograd.grad(rows.index_select(0, index), rows, grad)[0]
    assert torch.equal(mine, theirs) and (mine[2] == 0).all()


def _sequences(prompt_lengths, response_lengths, n):
    """Packed-row sequences: each prompt, then n responses attending to it."""
    prefixes, owns, at = [], [], 0
    for p, responses in zip(prompt_lengths, response_lengths):
        prompt = torch.arange(at, at + p)
        prefixes.append(torch.zeros(0, dtype=torch.long))
        owns.append(prompt)
        at += p
        for r in responses[:n]:
            prefixes.append(prompt)
            owns.append(torch.arange(at, at + r))
            at += r
    return prefixes, owns, at


def _reference(q, k, v, prefixes, owns, scaling):
    """Each sequence attended on its own: its queries against its prefix's and its own keys, causal."""
    H, Hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[2], H, q.shape[3], dtype=q.dtype)
    for prefix, own in zip(prefixes, owns):
        if not len(own):
            continue
        keys = torch.cat([prefix, own])
        kk = k[0][:, keys].repeat_interleave(H // Hkv, 0)
        vv = v[0][:, keys].repeat_interleave(H // Hkv, 0)
        scores = q[0][:, own] @ kk.transpose(1, 2) * scaling
        causal = torch.arange(len(keys))[None] <= (len(prefix) + torch.arange(len(own)))[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[own] = (probs @ vv).transpose(0, 1)
    return out[None]


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_the_kernel_equals_each_sequence_attended_alone_values_and_gradients(heads, kv_heads):
    """Float64, prompts shared by 3 responses of ragged lengths (one empty, one of a single token), grouped heads:
    the packed kernel's output and its gradients with respect to queries, keys and values (`gradcheck`, so the
    custom gathers' backward too) equal those of each sequence's own attention."""
    prefixes, owns, total = _sequences([3, 2], [[4, 0, 1], [2, 5, 3]], 3)
    layout = packed_layout(prefixes, owns, total, heads, kv_heads)
    g = torch.Generator().manual_seed(0)
    D = 4
    q = torch.randn(1, heads, total, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, total, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, total, D, generator=g, dtype=torch.float64, requires_grad=True)
    module = torch.nn.Module().eval()

    def packed(q, k, v):
        return varlen_attention_forward(module, q, k, v, None, 0.5, **{varlen.LAYOUT_KEY: layout})[0]

    assert torch.allclose(packed(q, k, v), _reference(q, k, v, prefixes, owns, 0.5), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(packed, (q, k, v))
    grad = torch.randn(1, total, heads, D, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(packed(q, k, v), (q, k, v), grad)
    theirs = torch.autograd.grad(_reference(q, k, v, prefixes, owns, 0.5), (q, k, v), grad)
    for a, b in zip(mine, theirs):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def _qwen3(tokenizer, sliding_window=None):
    """A tiny Qwen3 (grouped key/value heads, per-head q/k norms) or, with a sliding window, a tiny Mistral."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM
    shape = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
             "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    torch.manual_seed(0)
    if sliding_window:
        return MistralForCausalLM(MistralConfig(**shape, sliding_window=sliding_window)).eval()
    return Qwen3ForCausalLM(Qwen3Config(**shape)).eval()


@pytest.fixture(scope="module")
def qwen3_batch():
    from rollout.base import SamplingParams
    from tests.models.test_families import _engine_around
    tok = build_tiny_tokenizer()
    model = _qwen3(tok)
    batch = _engine_around(model, tok).generate(["12+3*4=", "5+6*7=", "1="],
                                                SamplingParams(n=3, max_new_tokens=10, seed=1))
    return model, batch


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_packed_row_with_shared_prompts_equals_the_padded_forward_on_qwen3(qwen3_batch, attn):
    """Logprobs, entropy and every parameter's gradient of the packed row (prompts once, responses attending to
    them) equal the padded forward's; the forward ran the variable-length kernel, with no mask built."""
    model, batch = qwen3_batch
    model.set_attn_implementation(attn)
    seen = []
    layer = model.model.layers[0].self_attn
    hook = layer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((m.config._attn_implementation, kwargs.get("attention_mask"),
                                             varlen.LAYOUT_KEY in kwargs)), with_kwargs=True)
    results = []
    try:
        for layout in [{}, {"pack": True, "share_prompts": True}, {"pack": True}]:
            model.zero_grad()
            logp, ent = response_logprobs(model, batch, with_entropy=True, entropy_grad=True, **layout)
            ((logp * batch.response_mask).sum() + 0.1 * ent.sum()).backward()
            results.append((logp.detach(), ent.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    finally:
        hook.remove()
        model.zero_grad()
    assert seen[1:] == [(varlen.NAME, None, True)] * 2  # both packed forwards, shared prompts or not
    assert seen[0][0] == attn and model.config._attn_implementation == attn  # restored after the forward
    ref = results[0]
    assert ref[2].norm() > 0
    for other in results[1:]:
        for a, b in zip(ref, other):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_shared_prompts_in_a_packed_row_need_the_variable_length_kernel(qwen3_batch):
    """A sliding-window model packs through transformers' own masks (equal to the padded forward) but cannot share
    prompts in the row: one error naming both options and why."""
    _, batch = qwen3_batch
    model = _qwen3(build_tiny_tokenizer(), sliding_window=4096)
    assert not varlen.applies(model)
    with torch.no_grad():
        ref, _ = response_logprobs(model, batch)
        packed, _ = response_logprobs(model, batch, pack=True)
        assert torch.allclose(ref, packed, atol=1e-5)
        with pytest.raises(ValueError, match=r"learner.share_prompts with learner.pack_sequences.*'mistral'"):
            response_logprobs(model, batch, pack=True, share_prompts=True)


def test_the_critic_reads_the_same_values_from_a_packed_row(qwen3_batch, tmp_path):
    """The value family (token classification on the policy's architecture) packs through the same kernel: its
    values equal the padded forward's."""
    from models.families import ValueFamily
    model, batch = qwen3_batch
    model.save_pretrained(tmp_path)
    critic = ValueFamily().load(str(tmp_path), attn_implementation="eager").eval()
    with torch.no_grad():
        padded = ValueFamily().forward(critic, batch)["values"]
        packed = ValueFamily().forward(critic, batch, pack=True)["values"]
    assert padded.abs().sum() > 0 and torch.allclose(padded, packed, atol=1e-5)


def test_decoder_layers_compiled_whole_train_as_the_eager_ones_with_the_attention_between_graphs(qwen3_batch):
    """`models.blocks.compile_decoder_layers` (the learner's compile with packed rows and shared prompts): the
    logprobs and every parameter's gradient equal the eager model's, and the packed row's attention stays out of
    the graphs, so that micro-batches of other layouts (other bucket shapes) reuse them."""
    import torch._dynamo.utils as dynamo_utils

    from models.blocks import compile_decoder_layers
    _, batch = qwen3_batch
    tok = build_tiny_tokenizer()
    results = []
    for compiled in (False, True):
        model = _qwen3(tok).train()
        if compiled:
            assert compile_decoder_layers(model) == 2 + 1  # its two layers and the final norm
        logp, _ = response_logprobs(model, batch, pack=True, share_prompts=True)
        (logp * batch.response_mask).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (eager, eager_grads), (fused, fused_grads) = results
    assert torch.allclose(eager, fused, atol=1e-5, rtol=1e-4)
    assert all(torch.allclose(eager_grads[n], fused_grads[n], atol=1e-5, rtol=1e-4) for n in eager_grads)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    for rows in (slice(0, 6), slice(3, 9)):  # two prompts of the three: other totals and buckets
        logp, _ = response_logprobs(model, batch.select(rows), pack=True, share_prompts=True)
        logp.sum().backward()
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
