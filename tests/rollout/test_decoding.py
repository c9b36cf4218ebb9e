"""The hf engine's own decode loop and its hook points (logits, residual stream, KV cache, insertion)."""

import pytest
import torch

from models.ouro import build_tiny_ouro
from models.tiny import build_tiny_tokenizer
from rollout.base import SamplingParams
from rollout.decoding import decode, keep_cache_positions
from rollout.hf_engine import HFEngine

PROMPTS = ["12+3*4=", "5+6*7=", "1+2*3="]


@pytest.fixture(scope="module")
def looped_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("ouro")
    tok = build_tiny_tokenizer()
    build_tiny_ouro(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, total_ut_steps=3,
                    seed=1).save_pretrained(path)
    tok.save_pretrained(path)
    return HFEngine(str(path))


def _gen(engine, decoding=None, params=None, **kw):
    sp = dict(n=1, temperature=0.0, max_new_tokens=16, seed=0)
    sp.update(kw)
    return engine.generate(PROMPTS, SamplingParams(**sp, decoding=decoding, decoding_params=params))


@torch.no_grad()
def _transformers_generate(engine, n=1, temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=16, seed=0, stop=None,
                           repetition_penalty=1.0):
    """The reference: transformers' `generate` with its processed scores stacked, rows ended as the engine
    ends them (EOS, or a stop string followed by generate's pad fill)."""
    from rl.batch import Batch
    from rollout.base import encode_prompts
    tok = engine.tokenizer
    rows = [p for p in PROMPTS for _ in range(n)]
    enc = encode_prompts(tok, rows)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  repetition_penalty=repetition_penalty)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k or None)
    if stop:
        kwargs.update(stop_strings=list(stop), tokenizer=tok)
    torch.manual_seed(seed * 1_000_003)
    out = engine.model.generate(**enc, **kwargs)
    resp = out.sequences[:, enc["input_ids"].shape[1]:]
    logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, resp[..., None]).squeeze(-1)
    L = resp.shape[1]
    is_eos = resp == tok.eos_token_id
    lengths = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, L)
    ended = is_eos.any(1)
    if stop:
        content = (resp != tok.pad_token_id).long()
        fill_start = torch.where(content.any(1), L - content.flip(1).argmax(1), 0)
        for i in range(len(resp)):
            p = int(fill_start[i])
            if tok.decode(resp[i, :p], skip_special_tokens=True).endswith(tuple(stop)):
                lengths[i], ended[i] = min(int(lengths[i]), p), True
    attn = (torch.arange(L)[None] < lengths[:, None]).long()
    resp = torch.where(attn.bool(), resp, tok.pad_token_id)
    return Batch(prompt_ids=enc["input_ids"], prompt_mask=enc["attention_mask"], response_ids=resp,
                 response_mask=attn.float(), response_attn=attn, group_id=torch.zeros(len(rows), dtype=torch.long),
                 rollout_logp=torch.where(attn.bool(), logp, 0.0), truncated=~ended,
                 responses=tok.batch_decode([r[:int(k)] for r, k in zip(resp, lengths)], skip_special_tokens=True))


def assert_same_generation(a, b, logp_atol=1e-5):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_attn, b.response_attn) and torch.equal(a.truncated, b.truncated)
    assert torch.allclose(a.rollout_logp, b.rollout_logp, atol=logp_atol)
    assert a.responses == b.responses


@pytest.mark.parametrize("which", ["engine", "looped_engine"])
def test_plain_loop_equals_generate_greedy(which, request):
    eng = request.getfixturevalue(which)
    assert_same_generation(_transformers_generate(eng), _gen(eng))
    assert_same_generation(_gen(eng), _gen(eng, "plain"))  # no method and `plain` are one loop


def test_plain_loop_equals_generate_when_sampling_with_top_k_and_top_p(engine):
    kw = dict(n=4, temperature=0.8, top_k=6, top_p=0.9, seed=11)
    assert_same_generation(_transformers_generate(engine, **kw), _gen(engine, "plain", **kw))


def test_the_repetition_penalty_is_transformers_own_greedy_and_sampling(engine, monkeypatch):
    """Prompt by prompt (transformers counts a left-padded row's pad tokens as seen; the loop, as vLLM, counts the
    prompt's and the response's tokens only), the penalised loop decodes what `generate` decodes."""
    import sys

    from models.sampling import penalize_repeats
    logits, seen = torch.tensor([[2.0, -1.0, 0.5]]), torch.tensor([[True, True, False]])
    assert penalize_repeats(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5]]  # by hand: 2 / 2, -1 x 2, unseen
    batched = _gen(engine, repetition_penalty=1.6, max_new_tokens=24)
    assert not torch.equal(batched.response_ids, _gen(engine, max_new_tokens=24).response_ids)  # it changes greedy
    for i, prompt in enumerate(PROMPTS):
        monkeypatch.setattr(sys.modules[__name__], "PROMPTS", [prompt])
        for kw in (dict(max_new_tokens=24), dict(n=3, temperature=0.9, top_k=8, seed=5, max_new_tokens=24)):
            alone = _gen(engine, repetition_penalty=1.6, **kw)
            assert_same_generation(_transformers_generate(engine, repetition_penalty=1.6, **kw), alone)
            if "n" not in kw:  # padding beside a longer prompt changes nothing
                assert torch.equal(batched.response_ids[i], alone.response_ids[0])


def test_plain_loop_honours_stop_strings_like_generate(engine):
    kw = dict(n=3, temperature=1.0, seed=3, max_new_tokens=30, stop=list("0123456789"))
    assert_same_generation(_transformers_generate(engine, **kw), _gen(engine, "plain", **kw))


class BanToken:
    def __init__(self, token_id: int):
        self.token_id = token_id

    def process_logits(self, logits, state):
        return logits.index_fill(-1, torch.tensor([self.token_id]), float("-inf"))


def test_a_logits_processor_changes_the_distribution_the_logprobs_are_of(engine, monkeypatch):
    plain = _gen(engine, "plain")
    first = int(plain.response_ids[0, 0])
    from rl import registry
    monkeypatch.setitem(registry._REGISTRY["decoding"], "ban", BanToken)
    banned = _gen(engine, "ban", {"token_id": first})
    assert first not in banned.response_ids[0, : int(banned.response_attn[0].sum())].tolist()
    # the first token is the runner-up of the raw distribution, and its logprob is under the renormalised one
    inputs = engine.tokenizer(PROMPTS[:1], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        logits = engine.model(**inputs).logits[0, -1].float()
    second = int(logits.topk(2).indices[1])
    assert int(banned.response_ids[0, 0]) == second
    logits[first] = float("-inf")
    assert float(banned.rollout_logp[0, 0]) == pytest.approx(float(torch.log_softmax(logits, -1)[second]), abs=1e-5)


class Steer:
    """Adds `scale` × a fixed direction to the residual stream after `layer`; counts its calls."""

    def __init__(self, layer: int = 0, scale: float = 0.0):
        self.layer, self.scale, self.calls = layer, scale, []

    def residual_hooks(self, model):
        direction = torch.ones(model.config.hidden_size)

        def hook(hidden, state):
            self.calls.append((state.step, hidden.shape[1]))
            return hidden + self.scale * direction
        return {self.layer: hook}


def test_residual_stream_hooks_run_at_prefill_and_every_step(engine, monkeypatch):
    from rl import registry
    monkeypatch.setitem(registry._REGISTRY["decoding"], "steer", Steer)
    plain = _gen(engine, "plain", max_new_tokens=6)
    zero = _gen(engine, "steer", {"layer": 1, "scale": 0.0}, max_new_tokens=6)
    assert_same_generation(plain, zero)
    method = engine.decoding_method("steer", {"layer": 1, "scale": 0.0})
    steps = [s for s, _ in method.calls]
    widths = [w for _, w in method.calls]
    assert steps[0] == 0 and widths[0] == engine.tokenizer(PROMPTS, padding=True,
                                                           return_tensors="pt")["input_ids"].shape[1]  # prefill
    assert all(w == 1 for w in widths[1:]) and steps[1:] == list(range(1, len(steps)))  # one per decode step
    steered = _gen(engine, "steer", {"layer": 1, "scale": 8.0}, max_new_tokens=6)
    assert not torch.equal(steered.response_ids, plain.response_ids)


class Window:
    """Keeps the last `size` cache entries (a sliding-window eviction policy); records the cache length."""

    def __init__(self, size: int):
        self.size, self.lengths = size, []

    def kv_policy(self, cache, state):
        n = cache.get_seq_length()
        if n > self.size:
            keep_cache_positions(cache, state, torch.arange(n - self.size, n))
        self.lengths.append(cache.get_seq_length())


def test_a_kv_cache_policy_evicts_between_steps(engine, monkeypatch):
    from rl import registry
    monkeypatch.setitem(registry._REGISTRY["decoding"], "window", Window)
    plain = _gen(engine, "plain", max_new_tokens=20)
    assert_same_generation(plain, _gen(engine, "window", {"size": 1000}, max_new_tokens=20))  # nothing to evict: unchanged
    small = _gen(engine, "window", {"size": 6}, max_new_tokens=20)
    method = engine.decoding_method("window", {"size": 6})
    assert method.lengths and max(method.lengths) <= 6
    assert small.response_ids.shape[0] == 3 and not torch.equal(small.response_ids, plain.response_ids)


class InsertAfterFirst:
    """After the first sampled token, append `text`'s tokens to every row (re-prefilled in the next step)."""

    def __init__(self, text: str):
        self.text = text

    def insert(self, state):
        if state.step != 1:
            return None
        ids = state.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        return [ids for _ in state.responses]


def test_inserted_tokens_are_re_prefilled_and_masked_from_training(engine, monkeypatch):
    from rl import registry
    monkeypatch.setitem(registry._REGISTRY["decoding"], "insert", InsertAfterFirst)
    plain = _gen(engine, "plain")
    out = _gen(engine, "insert", {"text": "7*7"})
    k = len(engine.tokenizer("7*7", add_special_tokens=False)["input_ids"])
    assert torch.equal(out.response_ids[:, 0], plain.response_ids[:, 0])
    assert out.observation_mask[:, 1:1 + k].sum() == 3 * k and out.observation_mask[:, 0].sum() == 0
    assert out.observation_mask[:, 1 + k:].sum() == 0 and out.rollout_logp[:, 1:1 + k].abs().sum() == 0
    # what follows the insertion is what plain greedy decoding gives from prompt + first token + inserted span
    for i, prompt in enumerate(PROMPTS):
        n = int(out.response_attn[i].sum())
        head = engine.tokenizer.decode(out.response_ids[i, :1 + k])
        cont = engine.generate([prompt + head], SamplingParams(n=1, temperature=0.0, max_new_tokens=16 - 1 - k,
                                                               decoding="plain"))
        m = int(cont.response_attn[0].sum())
        assert out.response_ids[i, 1 + k:n].tolist() == cont.response_ids[0, :m].tolist()
        assert torch.allclose(out.rollout_logp[i, 1 + k:n], cont.rollout_logp[0, :m], atol=1e-5)


def test_decode_without_a_method_needs_no_registry(engine):
    enc = engine.tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    tok = engine.tokenizer
    resp, logp, lengths, inserted, ended = decode(engine.model, enc["input_ids"], enc["attention_mask"],
                                                  max_new_tokens=5, temperature=0.0, top_k=0, top_p=1.0,
                                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert resp.shape[0] == 3 and int(inserted.sum()) == 0 and lengths.max() <= 5 and ended.dtype == torch.bool


def test_reserved_cache_layer_appends_in_place_grows_and_follows_a_replaced_cache():
    from rollout.decoding import ReservedLayer
    layer, parts = ReservedLayer(capacity=3), []
    for step in range(5):  # past its capacity: it grows
        k = torch.randn(2, 2, 1, 4)
        parts.append(k)
        keys, values = layer.update(k, k + 1)
        assert torch.equal(keys, torch.cat(parts, -2)) and torch.equal(values, torch.cat(parts, -2) + 1)
        if step == 1:
            first = layer.keys.data_ptr()
        if step == 2:
            assert layer.keys.data_ptr() == first  # appended in place, no copy
    keep = torch.tensor([0, 2, 4])  # an eviction policy replaces the tensors
    layer.keys, layer.values = layer.keys.index_select(-2, keep), layer.values.index_select(-2, keep)
    k = torch.randn(2, 2, 1, 4)
    keys, _ = layer.update(k, k)
    assert torch.equal(keys, torch.cat([torch.cat(parts, -2).index_select(-2, keep), k], -2))


def test_selecting_rows_copies_their_filled_positions_into_the_other_buffers_and_appending_goes_on():
    """`ReservedLayer.select_rows` (a shared prefill's copies, dropping ended rows) copies only the filled positions
    of the rows kept, in the index's order (repeats allowed), into buffers with the same room; past them the buffers
    stay finite (zeros here: masked under `full_view`), and the next write appends in place after them."""
    from rollout.decoding import KVBuffers, ReservedLayer
    for buffers in (None, KVBuffers()):
        layer = ReservedLayer(capacity=6, full_view=True, buffers=buffers)
        k = torch.randn(4, 2, 3, 4)
        layer.update(k, k + 1)
        before = layer._k.data_ptr()
        layer._k[:, :, 3:] = 7.0  # never-written room: not copied
        index = torch.tensor([2, 0, 2])
        layer.select_rows(index)
        assert layer._k.data_ptr() != before and layer._k.shape == (3, 2, 6, 4)
        assert torch.equal(layer.keys, k[index]) and torch.equal(layer.values, k[index] + 1)
        assert torch.isfinite(layer._k).all() and not layer._k[:, :, 3:].any()
        k1 = torch.randn(3, 2, 1, 4)
        keys, values = layer.update(k1, k1)
        assert keys.shape[-2] == 6 and torch.equal(keys[:, :, :4], torch.cat([k[index], k1], -2))
        assert layer._k.data_ptr() == keys.data_ptr()  # appended into the selected buffers, no copy


def test_a_full_view_layer_hands_attention_its_whole_buffers_and_reports_their_length_for_the_mask():
    from rollout.decoding import ReservedLayer
    layer = ReservedLayer(capacity=6, full_view=True)
    assert layer.get_mask_sizes(3) == (3, 0)  # empty: the first write is sized by the mask it is given
    k = torch.randn(2, 2, 3, 4)
    keys, _ = layer.update(k, k)
    assert keys.shape[-2] == 3  # allocated in this write: a view of what the mask covers
    assert layer.get_mask_sizes(1) == (6, 0)
    k1 = torch.randn(2, 2, 1, 4)
    keys, values = layer.update(k1, k1 + 1)
    assert keys.shape[-2] == 6 and keys.is_contiguous()  # the whole buffer, no strided view
    assert torch.equal(keys[:, :, :4], torch.cat([k, k1], -2)) and torch.equal(values[:, :, 3], (k1 + 1)[:, :, 0])
    assert not keys[:, :, 4:].any()  # unfilled columns are zeros (finite), masked by the padded mask
    assert layer.get_seq_length() == 4 and layer.keys.shape[-2] == 4
    assert layer.get_mask_sizes(3) == (4 + 3, 0)  # no room for 3 more: the layer grows in that write
    keys, _ = layer.update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    assert keys.shape[-2] == 7 and layer.get_mask_sizes(1) == (14, 0)


def test_rows_that_repeat_a_prompt_share_its_prefill_and_sample_as_if_each_ran_its_own(engine):
    """n samples per prompt: the prompt's forward runs once per distinct prompt (its cache rows copied to the
    repeats), and what is sampled equals the loop that prefills every row (a method that hooks the forward)."""
    class HooksNothing:  # any method with a forward hook sees every row, so the prompts run row by row
        def forward_hooks(self, model, state):
            return []
    tok = engine.tokenizer
    rows = [p for p in PROMPTS for _ in range(4)]
    enc = tok(rows, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    widths: list[int] = []
    handle = engine.model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape),
                                                    with_kwargs=True)
    runs = []
    try:
        for method in (None, HooksNothing()):
            widths.clear()
            torch.manual_seed(5)
            runs.append(decode(engine.model, enc["input_ids"], enc["attention_mask"], max_new_tokens=8,
                               temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, method=method))
            runs[-1] = (*runs[-1], list(widths))
    finally:
        handle.remove()
    (shared, *_, shared_widths), (own, *_, own_widths) = runs
    P = enc["input_ids"].shape[1]
    assert shared_widths[0] == (3, P) and own_widths[0] == (12, P)  # the prefill: 3 distinct prompts, or all 12 rows
    assert shared_widths[1][0] == 12  # the first decode step runs every row (later ones drop the ended: below)
    for a, b in zip(runs[0][:5], runs[1][:5]):
        assert torch.equal(a, b)
    assert len({tuple(r.tolist()) for r in shared}) > 3  # the repeats sampled different responses


def test_the_plain_loop_in_bf16_reads_whole_cache_buffers_and_samples_what_strided_views_sample(engine, monkeypatch):
    """On CPU in bf16 the plain loop's attention reads the cache's whole buffers (its unfilled columns masked):
    the same tokens as attention over the filled part alone, logprobs equal to rounding."""
    import copy

    import rollout.decoding as decoding
    tok = engine.tokenizer
    model = copy.deepcopy(engine.model).to(torch.bfloat16)
    enc = tok([p for p in PROMPTS for _ in range(4)], return_tensors="pt", padding=True, padding_side="left",
              add_special_tokens=False)
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    made: list[bool] = []
    factory = decoding.reserved_cache

    def recording(capacity, full_view=False, buffers=None):
        made.append(full_view)
        return factory(capacity, full_view, buffers)
    monkeypatch.setattr(decoding, "reserved_cache", recording)
    torch.manual_seed(4)
    whole = decode(model, enc["input_ids"], enc["attention_mask"], **kw)
    assert made and all(made)
    monkeypatch.setattr(decoding, "reserved_cache", lambda capacity, full_view=False, buffers=None: factory(capacity, False, buffers))
    torch.manual_seed(4)
    strided = decode(model, enc["input_ids"], enc["attention_mask"], **kw)
    assert torch.equal(whole[0], strided[0]) and torch.equal(whole[2], strided[2])
    torch.testing.assert_close(whole[1], strided[1], rtol=0, atol=2e-2)  # bf16 logits
    assert int(whole[2].sum()) > 12  # some rows decoded several tokens, reading the cache


def test_a_cache_layer_that_cannot_be_copied_by_row_falls_back_to_prefilling_every_row(engine, monkeypatch):
    import rollout.decoding as decoding
    tok = engine.tokenizer
    enc = tok([p for p in PROMPTS for _ in range(2)], return_tensors="pt", padding=True, padding_side="left",
              add_special_tokens=False)
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    torch.manual_seed(2)
    shared = decode(engine.model, enc["input_ids"], enc["attention_mask"], **kw)
    monkeypatch.setattr(decoding, "COPYABLE_LAYERS", ())  # as for a layer kind with more per-row state
    widths: list[int] = []
    handle = engine.model.register_forward_pre_hook(lambda m, a, k: widths.append(k["input_ids"].shape[0]),
                                                    with_kwargs=True)
    try:
        torch.manual_seed(2)
        fallback = decode(engine.model, enc["input_ids"], enc["attention_mask"], **kw)
    finally:
        handle.remove()
    assert widths[:2] == [3, 6]  # the shared forward, dropped, then every row's
    for a, b in zip(shared, fallback):
        assert torch.equal(a, b)


def test_sample_rows_draws_what_multinomial_draws_and_a_rows_token_does_not_depend_on_the_others():
    from rollout.decoding import sample_rows
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(9, 50, generator=g) ** 4
    probs[:, :10] = 0  # as after top-k / top-p
    probs = probs / probs.sum(-1, keepdim=True)
    every = torch.arange(9)
    for seed in range(5):
        torch.manual_seed(seed)
        expected = torch.multinomial(probs, num_samples=1).squeeze(1)
        torch.manual_seed(seed)
        assert torch.equal(sample_rows(probs, every, 9), expected)
        live = torch.tensor([1, 4, 8])
        torch.manual_seed(seed)
        assert torch.equal(sample_rows(probs[live], live, 9), expected[live])  # the same draw for rows 1, 4, 8
    assert (expected >= 10).all()


def test_the_plain_loop_drops_ended_rows_and_samples_what_every_row_samples(engine, monkeypatch):
    """Rows that ended (EOS) leave the batch the plain loop runs once they are an eighth of it: fewer rows per
    forward, the same tokens, lengths and logprobs as running every row to the end."""
    import rollout.decoding as decoding
    tok = engine.tokenizer
    enc = tok([p for p in PROMPTS for _ in range(16)], return_tensors="pt", padding=True, padding_side="left",
              add_special_tokens=False)
    # an EOS-prone model: the EOS logit raised, so that rows end at different steps
    head = engine.model.get_output_embeddings()
    bias = torch.zeros(head.out_features)
    bias[tok.eos_token_id] = 1.5
    hook = head.register_forward_hook(lambda m, a, out: out + bias)
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    rows: list[int] = []
    count = engine.model.register_forward_pre_hook(lambda m, a, k: rows.append(k["input_ids"].shape[0]),
                                                   with_kwargs=True)
    runs = []
    try:
        for share in (decoding.COMPACT_SHARE, 2.0):  # 2.0: never compacts
            monkeypatch.setattr(decoding, "COMPACT_SHARE", share)
            rows.clear()
            torch.manual_seed(7)
            runs.append((decode(engine.model, enc["input_ids"], enc["attention_mask"], **kw), list(rows)))
    finally:
        hook.remove()
        count.remove()
    (compacted, compacted_rows), (full, full_rows) = runs
    assert full_rows[1:] == [48] * (len(full_rows) - 1)
    assert len(compacted_rows) == len(full_rows) and compacted_rows[-1] < 24  # fewer rows as they end
    assert all(a >= b for a, b in zip(compacted_rows[1:], compacted_rows[2:]))
    lengths = full[2]
    assert len(set(lengths.tolist())) > 5 and bool(full[4].any()) and not bool(full[4].all())
    for a, b in zip(compacted[:5], full[:5]):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_storage_kept_across_generates_is_reused_and_samples_what_fresh_buffers_sample(engine, dtype):
    """`KVBuffers`: the loop's cache takes its storage from buffers kept between generates (the shared prefill's
    row copy, each compaction and each growth write into the side the layer does not hold). Consecutive generates,
    rows ending at EOS (compactions) and a smaller batch after a larger one: the same tokens, lengths and logprobs
    as fresh buffers, and after the first generate no buffer is allocated again. In bf16 attention reads the
    whole buffers (stale columns from an earlier generate are masked)."""
    import copy

    from rollout.decoding import KVBuffers
    tok = engine.tokenizer
    model = copy.deepcopy(engine.model).to(dtype)
    head = model.get_output_embeddings()
    bias = torch.zeros(head.out_features, dtype=dtype)
    bias[tok.eos_token_id] = 1.5  # rows end at different steps: the loop compacts its batch
    head.register_forward_hook(lambda m, a, out: out + bias)
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    kept = KVBuffers()
    storage: list[dict] = []
    for copies, seed in ((16, 7), (16, 8), (5, 9)):
        enc = tok([p for p in PROMPTS for _ in range(copies)], return_tensors="pt", padding=True,
                  padding_side="left", add_special_tokens=False)
        torch.manual_seed(seed)
        fresh = decode(model, enc["input_ids"], enc["attention_mask"], **kw)
        torch.manual_seed(seed)
        reused = decode(model, enc["input_ids"], enc["attention_mask"], kv_buffers=kept, **kw)
        for a, b in zip(reused, fresh):
            assert torch.equal(a, b)
        storage.append({key: flat.data_ptr() for key, flat in kept._flat.items()})
    assert len(set(fresh[2].tolist())) > 3 and bool(fresh[4].any())  # rows ended at several steps
    layers = len(model.model.layers)
    assert set(storage[0]) == {(slot, role, side) for slot in range(layers) for role in "kv" for side in (0, 1)}
    assert storage[1] == storage[0] and storage[2] == storage[0]  # nothing allocated after the first generate
    assert kept.nbytes() > 0
    kept.clear()
    assert kept.nbytes() == 0


def test_kv_storage_serves_one_decode_at_a_time():
    from rollout.decoding import KVBuffers
    kept = KVBuffers()
    like = torch.zeros(1)
    with kept.claim() as first:
        assert first is kept
        first.take(0, "k", 0, (2, 3), like)
        with kept.claim() as second:  # a concurrent decode gets storage of its own
            assert second is not kept and second.nbytes() == 0
    with kept.claim() as again:
        assert again is kept and again.take(0, "k", 0, (3, 2), like).data_ptr() == kept._flat[(0, "k", 0)].data_ptr()
    grown = kept.take(0, "k", 0, (4, 4), like)  # larger than the buffer: a new one
    assert grown.shape == (4, 4) and kept._flat[(0, "k", 0)].numel() == 16
