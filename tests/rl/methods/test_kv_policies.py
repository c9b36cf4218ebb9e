"""BeaconKV and its baselines (rl/methods/beaconkv/README.md): the scoring pieces against hand computations, and the
cache policies on the hf engine's decode loop with a tiny GQA Llama."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.tiny import build_tiny_tokenizer
from rl.methods.beaconkv.core import (
    HarnessConfig,
    QueryBuffer,
    farthest_point_sampling,
    harness_stream,
    key_importance,
    rope,
    rope_tables,
    select_keep,
    simulate_policy,
)
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine

POLICIES = ("kv_streaming", "kv_snapkv", "kv_h2o", "kv_rkv", "beaconkv")


def _min_pairwise_cosine_distance(x):
    u = torch.nn.functional.normalize(x, dim=-1)
    d = 1 - u @ u.T
    d.fill_diagonal_(float("inf"))
    return float(d.min())


def test_fps_never_repeats_an_index_even_on_identical_points():
    x = torch.ones(10, 4)  # every point the same: distances are all 0
    idx = farthest_point_sampling(x, 6)
    assert len(set(idx.tolist())) == 6
    assert farthest_point_sampling(x, 20).tolist() == list(range(10))  # k >= N: all of them


def test_fps_spreads_points_further_than_random_subsets():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(5, 16, generator=g)
    x = torch.cat([c + 0.1 * torch.randn(40, 16, generator=g) for c in centers])  # 5 tight clusters
    fps = _min_pairwise_cosine_distance(x[farthest_point_sampling(x, 5)])
    randoms = [_min_pairwise_cosine_distance(x[torch.randperm(200, generator=g)[:5]]) for _ in range(50)]
    assert fps > max(randoms)
    picked = farthest_point_sampling(x, 5) // 40
    assert sorted(picked.tolist()) == [0, 1, 2, 3, 4]  # one representative per cluster


def test_the_query_buffer_never_exceeds_its_upper_limit():
    buf = QueryBuffer(upper=32, lower=8)
    g = torch.Generator().manual_seed(1)
    sizes = []
    for _ in range(200):
        buf.add(torch.randn(2, 1, 8, generator=g))
        sizes.append(len(buf))
    assert max(sizes) <= 32 and buf.compressions > 0
    assert sizes[32] == 8  # the 33rd query fills it past the limit: FPS-compressed to the lower limit
    buf.add(torch.randn(2, 100, 8, generator=g))  # a prefill longer than the limit compresses at once
    assert len(buf) == 8 and buf.beacons(4).shape == (2, 4, 8)
    with pytest.raises(ValueError, match="lower < upper"):
        QueryBuffer(upper=8, lower=8)


def test_rope_at_a_position_is_the_pairwise_rotation():
    D, pos = 8, 37
    q = torch.randn(3, D)
    cos, sin = rope_tables(torch.tensor([pos] * 3), D)
    got = rope(q, cos, sin)
    want = torch.empty_like(q)
    for i in range(D // 2):  # Llama's convention: dimension i rotates with dimension i + D/2
        angle = pos / 10000 ** (2 * i / D)
        c, s = math.cos(angle), math.sin(angle)
        want[:, i] = q[:, i] * c - q[:, i + D // 2] * s
        want[:, i + D // 2] = q[:, i + D // 2] * c + q[:, i] * s
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gqa_importance_is_the_max_over_observation_queries_and_the_heads_of_a_group():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(4, 3, 8, generator=g), torch.randn(2, 5, 8, generator=g)  # 4 query heads, 2 KV heads
    valid = torch.tensor([True, True, False, True, True])
    got = key_importance(q, k, valid)
    for kv in range(2):
        heads = [2 * kv, 2 * kv + 1]
        probs = []
        for h in heads:
            s = q[h] @ k[kv].T / math.sqrt(8)
            s[:, ~valid] = float("-inf")
            probs.append(s.softmax(-1))
        torch.testing.assert_close(got[kv], torch.stack(probs).amax(0).amax(0))
    assert got[:, 2].eq(0).all()


def test_select_keep_keeps_sink_recent_and_the_top_scores_and_padding_last():
    scores = torch.tensor([[0.0, 0.0, 5.0, 1.0, 9.0, 2.0, 3.0, 0.5, 0.1, 0.2]])
    valid = torch.tensor([False, False] + [True] * 8)
    # valid keys are 2..9: sink = key 2, recent = keys 8 and 9, budget 2 of keys 3..7 by score: 4 and 6
    assert select_keep(scores, 2, 1, 2, valid).tolist() == [[2, 4, 6, 8, 9]]
    # more kept than valid keys: all valid ones, and the leftmost padding
    assert select_keep(scores, 6, 1, 2, valid).tolist() == [[0, *range(2, 10)]]


def test_on_the_harness_beacons_keep_revisited_keys_that_recent_windows_evict():
    """The spec's synthetic harness at a reduced length (the benchmark runs 4,000 steps, every budget, 3 seeds)."""
    stream = harness_stream(HarnessConfig(steps=1200), seed=0)
    res = {p: simulate_policy(stream, p, budget=128) for p in ("beacon", "snapkv", "streaming")}
    assert all(r["max_cache"] <= 128 + 4 + 16 for r in res.values())
    assert res["beacon"]["recall_revisit"] > res["snapkv"]["recall_revisit"] + 0.2
    assert res["beacon"]["recall_revisit"] > res["streaming"]["recall_revisit"] + 0.2
    # local queries read recent keys, which every policy keeps
    assert min(r["recall_local"] for r in res.values()) > 0.9


@pytest.fixture(scope="module")
def gqa_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("gqa")
    tok = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return HFEngine(str(path))


PROMPTS = ["12+3*4=", "5+6*7=1", "1+2*3=4+5*6=7+8*9="]  # different lengths: left padding in the cache


def _gen(engine, decoding=None, params=None, n_tokens=40):
    # greedy; a row that ends early keeps feeding padding with the others, so the cache grows as long as any row
    return engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=n_tokens, seed=0,
                                                   decoding=decoding, decoding_params=params))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_keeps_the_cache_within_its_bound_on_the_engine(gqa_engine, policy):
    plain = _gen(gqa_engine)
    roomy = _gen(gqa_engine, policy, {"budget": 200})  # nothing to evict: decodes as plain
    assert torch.equal(roomy.response_ids, plain.response_ids)
    torch.testing.assert_close(roomy.rollout_logp, plain.rollout_logp, atol=1e-5, rtol=0)
    params = {"budget": 8, "sink": 2, "recent": 4}
    out = _gen(gqa_engine, policy, params)
    method = gqa_engine.decoding_method(policy, params)
    assert method.stats["max_cache"] <= 8 + 2 + 4 and method.stats["evictions"] > 0
    # k and v, 2 layers, B 3, 2 KV heads, the 14 kept and the fed token x 16 fp32
    assert method.stats["peak_bytes"] == 2 * 2 * 2 * 3 * 15 * 16 * 4
    assert out.response_ids.shape[0] == 3 and not torch.equal(out.rollout_logp, plain.rollout_logp)


def test_eviction_every_interval_tokens_stays_within_the_bound(gqa_engine):
    params = {"budget": 12, "sink": 2, "recent": 4, "interval": 5}
    _gen(gqa_engine, "beaconkv", params)
    method = gqa_engine.decoding_method("beaconkv", params)
    assert method.stats["max_cache"] <= 18
    assert method.stats["evictions"] <= (len(PROMPTS[2]) + 40) // 5 + 1  # one eviction per 5 tokens at most


def test_beacons_are_rotated_at_the_current_position_with_the_models_rope(gqa_engine):
    from rl.methods.beaconkv.decoding import BeaconKV
    method = BeaconKV()
    model = gqa_engine.model
    method.head_dim, method.n_heads, method.rotary = 16, 4, model.model.rotary_emb
    q = torch.randn(4, 3, 16)
    cos, sin = rope_tables(torch.tensor([50, 50, 50]), 16, theta=model.config.rope_parameters["rope_theta"])
    torch.testing.assert_close(method.rotate(q, torch.tensor([50, 50, 50])), rope(q, cos, sin), atol=1e-5, rtol=1e-5)


def test_the_recall_task_asks_every_key_in_alphabetical_order_and_scores_by_hand():
    import random

    from rollout.kv_recall import recall_example, score_recall
    prompt, answer, table = recall_example(random.Random(3), n_keys=5, filler=2)
    assert sorted(table) == list("abcde") and prompt.endswith(";") and len(prompt) == 11
    assert answer == "".join(f"{k}{table[k]}.." for k in "abcde")
    assert all(f"{k}{v}" in prompt for k, v in table.items())
    # the first value written for a key counts; a key never written is wrong
    assert score_recall("a2..b5..a3..", {"a": "2", "b": "6", "c": "1"}) == pytest.approx(1 / 3)
    assert score_recall(answer, table) == 1.0


def test_recall_evaluation_counts_the_full_cache_as_a_policy_that_never_evicts_would():
    import random

    from rl.registry import lookup
    from rollout.kv_recall import evaluate_recall, recall_example
    tok = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    rng = random.Random(0)
    examples = [recall_example(rng, n_keys=6, filler=3) for _ in range(3)]
    full = evaluate_recall(model, tok, examples)
    never = evaluate_recall(model, tok, examples, lookup("decoding", "kv_streaming")(budget=1000))
    small = evaluate_recall(model, tok, examples, lookup("decoding", "kv_streaming")(budget=4, sink=2, recent=4))
    assert never["peak_kv_bytes"] == full["peak_kv_bytes"]
    assert never["accuracy"] == full["accuracy"]  # nothing evicted: the same greedy answers
    assert small["peak_kv_bytes"] < full["peak_kv_bytes"]
