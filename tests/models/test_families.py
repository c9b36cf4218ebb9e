"""The learner's forward (`models/families.py`): response logprobs and entropy from the decoder's hidden
states with the vocabulary projection in chunks, packed sequences, and the rollout's truncated distribution,
each against a direct computation from the model's full logits."""

import pytest
import torch

from models.families import CausalFamily, LoopedFamily, output_head, response_logprobs
from models.ouro import build_tiny_ouro
from models.sampling import warp_logits
from models.tiny import build_tiny_tokenizer, save_tiny
from rollout.base import SamplingParams
from rollout.decoding import KVBuffers
from rollout.hf_engine import HFEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(str(save_tiny(tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=2, num_heads=2,
                                  intermediate_size=64)))


@pytest.fixture(scope="module")
def batch(engine):
    # three prompt lengths, sampled lengths vary (EOS) so that padding differs per row
    return engine.generate(["12+3*4=", "5+6*7=", "1="], SamplingParams(n=3, max_new_tokens=12, seed=3))


def _engine_around(model, tokenizer):
    """An hf engine serving a model built in memory (to sample batches from it)."""
    engine = HFEngine.__new__(HFEngine)
    engine.model, engine.tokenizer, engine.device = model, tokenizer, torch.device("cpu")
    engine.batch_size, engine._methods, engine.fused_decode_attention = 64, {}, True
    engine.packed_linear_weights, engine.kv_buffers, engine.compiled_decode = True, KVBuffers(), False
    engine.fp32_packing = "auto"
    return engine


def full_logits_reference(model, batch, temperature=1.0, top_k=0, top_p=1.0):
    """What the learner computed before: the whole `[N, L, V]` logit tensor, warped, log-softmaxed."""
    logits = model(**batch.model_inputs(), use_cache=False).logits
    P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logits = warp_logits(logits[:, P - 1:P + L - 1].float(), temperature, top_k, top_p)
    logsm = torch.log_softmax(logits, -1)
    logp = logsm.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm.masked_fill(~torch.isfinite(logsm), 0)).sum(-1)
    attn = batch.response_attn.bool()
    return logp.masked_fill(~attn, 0), entropy.masked_fill(~attn, 0)


LAYOUTS = {"padded": {}, "packed": {"pack": True}, "shared prompts": {"share_prompts": True},
           "packed, shared prompts": {"pack": True, "share_prompts": True}}


@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_packed_and_shared_prompt_logprobs_and_entropy_equal_the_full_logits(engine, batch, chunk_tokens,
                                                                                     layout):
    ref_logp, ref_ent = full_logits_reference(engine.model, batch, temperature=0.7)
    with torch.no_grad():
        logp, ent = response_logprobs(engine.model, batch, 0.7, with_entropy=True, chunk_tokens=chunk_tokens,
                                      **LAYOUTS[layout])
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert (logp[~batch.response_attn.bool()] == 0).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_shared_prompt_and_padded_give_the_same_gradients(engine, batch, attn, monkeypatch):
    import models.families as families
    model = engine.model
    model.set_attn_implementation(attn)
    buckets = families.length_buckets
    grads, forwards = [], []
    try:
        for name, layout in [*LAYOUTS.items(), ("shared prompts, a bucket per length", {"share_prompts": True})]:
            if name.endswith("per length"):  # every response length its own forward after the shared prompts
                monkeypatch.setattr(families, "length_buckets",
                                    lambda lengths: buckets(lengths, max_padding=0.0, min_tokens=0))
                model.register_forward_pre_hook(lambda *_: forwards.append(1))
            model.zero_grad()
            logp, ent = response_logprobs(model, batch, with_entropy=True, entropy_grad=True, chunk_tokens=5,
                                          top_p=0.9, **layout)
            ((logp * batch.response_mask).sum() + 0.1 * ent.sum()).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    finally:
        model.zero_grad()
        model._forward_pre_hooks.clear()
        model.set_attn_implementation("sdpa")
    assert len(forwards) > 2  # the prompts' forward and a forward per response length
    assert grads[0].norm() > 0
    for other in grads[1:]:
        assert torch.allclose(grads[0], other, atol=1e-5, rtol=1e-4)


def test_shared_prompts_run_each_distinct_prompt_once_then_the_responses(engine, batch):
    """9 rows, 3 prompts: the prompt forward sees 3 rows of the prompt width, then the responses run after it
    (one bucket here: fewer real tokens than a bucket's minimum) without their last token."""
    shapes: list[tuple[int, int]] = []
    handle = engine.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                    with_kwargs=True)
    try:
        with torch.no_grad():
            response_logprobs(engine.model, batch, share_prompts=True)
    finally:
        handle.remove()
    longest = int(batch.response_attn.sum(-1).max())
    assert shapes == [(3, batch.prompt_ids.shape[1]), (9, longest - 1)]


def test_length_buckets_by_hand():
    from models.families import length_buckets
    # longest first: 10, 9, 8 pad to 30 <= 1.25 * 27; adding 2 would pad to 40 > 1.25 * 29; 2 and 1: 4 > 3.75
    assert length_buckets([10, 2, 9, 8, 1], max_padding=0.25, min_tokens=0) == [[0, 2, 3], [1], [4]]
    # a bucket under min_tokens real tokens takes the next row whatever the padding
    assert length_buckets([10, 2, 9, 8, 1], max_padding=0.25, min_tokens=5) == [[0, 2, 3], [1, 4]]
    assert length_buckets([3, 3, 3], max_padding=0.0, min_tokens=0) == [[0, 1, 2]]
    # the default allows 5% padding: 64, 64, 60 pad to 192 <= 1.05 * 188; 50 would pad to 192 > 1.05 * 178
    assert length_buckets([64, 60, 64], min_tokens=0) == [[0, 2, 1]]
    assert length_buckets([64, 50, 64], min_tokens=0) == [[0, 2], [1]]


def test_the_vocabulary_projection_never_sees_more_than_a_chunk(engine, batch):
    """No `[N, L, V]` tensor: the decoder's forward asks the head for no position, the loss path for at
    most `chunk_tokens` at a time — forward and the recompute in backward."""
    seen = []
    handle = engine.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.shape[:-1].numel()))
    try:
        logp, _ = response_logprobs(engine.model, batch, chunk_tokens=4)
        logp.sum().backward()
    finally:
        handle.remove()
        engine.model.zero_grad()
    n_tokens = int(batch.response_attn.sum())
    assert max(seen) == 4 and sum(seen) == 2 * n_tokens  # forward + recompute; the decoder call kept 0 positions


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 1.0), (6, 0.8)])
def test_truncated_sampling_logprobs_are_of_the_processed_distribution(engine, top_k, top_p):
    b = engine.generate(["12+3*4=", "5+6*7="], SamplingParams(n=4, max_new_tokens=16, seed=5, temperature=0.9,
                                                             top_k=top_k, top_p=top_p))
    with torch.no_grad():
        logp, _ = response_logprobs(engine.model, b, 0.9, top_k=top_k, top_p=top_p)
        full, _ = response_logprobs(engine.model, b, 0.9)
        ref, _ = full_logits_reference(engine.model, b, 0.9, top_k, top_p)
    mask = b.response_mask.bool()
    assert (logp - b.rollout_logp)[mask].abs().max() < 1e-4  # the learner's and the engine's agree
    assert torch.allclose(logp, ref, atol=1e-5)
    assert (logp - full)[mask].min() > -1e-6 and (logp - full)[mask].max() > 0.01  # renormalised: higher


def test_a_sampled_token_outside_the_learners_nucleus_keeps_a_finite_logprob(engine, batch):
    """A rounding difference at the nucleus boundary must not give -inf: a token the rollout sampled stays
    in the support (here: the least likely token, forced into the labels)."""
    b = batch.select([0])
    logits = engine.model(**b.model_inputs(), use_cache=False).logits[0, b.prompt_ids.shape[1] - 1]
    b.response_ids = b.response_ids.clone()
    b.response_ids[0, 0] = int(logits.argmin())
    with torch.no_grad():
        logp, _ = response_logprobs(engine.model, b, top_p=0.5)
    assert torch.isfinite(logp).all()


def test_output_scalings_of_the_model_family_are_applied(tmp_path):
    """Gemma-style final-logit soft-capping happens after the head: the chunked path must apply it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=16, final_logit_softcapping=0.5, pad_token_id=tok.pad_token_id,
                                           attn_implementation="eager")).eval()
    engine_like = _engine_around(model, tok)
    b = engine_like.generate(["12+3="], SamplingParams(n=2, max_new_tokens=6, seed=0))
    with torch.no_grad():
        logp, _ = response_logprobs(model, b)
        ref, _ = full_logits_reference(model, b)
        h = torch.randn(3, 32)
        assert output_head(model)(h).abs().max() <= 0.5  # capped
    assert torch.allclose(logp, ref, atol=1e-5)


def test_looped_family_final_loop_logprob_and_chunked_entropy():
    tok = build_tiny_tokenizer()
    model = build_tiny_ouro(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                            total_ut_steps=3, seed=1).eval()
    engine_like = _engine_around(model, tok)
    b = engine_like.generate(["12+3=", "7*8="], SamplingParams(n=2, max_new_tokens=8, seed=0))
    ref_logp, ref_ent = full_logits_reference(model, b)
    fam = LoopedFamily(chunk_tokens=3)
    with torch.no_grad():
        plain = fam.forward(model, b, outputs={"logp", "entropy"})
        looped = fam.forward(model, b, outputs={"logp", "entropy", "loop_logp"})
    attn = b.response_attn.bool()
    for out in (plain, looped):  # the per-loop path also fills padding positions: compare generated tokens
        assert torch.allclose(out["logp"][attn], ref_logp[attn], atol=1e-5)
        assert torch.allclose(out["entropy"], ref_ent, atol=1e-5)
    with pytest.raises(ValueError, match="packed"):
        fam.forward(model, b, pack=True)
    assert CausalFamily.supports_packing and not LoopedFamily.supports_packing
    # the per-loop path and its final-loop entropy metric project at most `chunk_tokens` positions at a time
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.shape[:-1].numel()))
    try:
        with torch.no_grad():
            fam.forward(model, b, outputs={"logp", "entropy", "loop_logp"})
    finally:
        handle.remove()
    assert seen and max(seen) <= 3
