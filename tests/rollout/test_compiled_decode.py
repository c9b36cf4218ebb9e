"""The hf engine's decode step compiled as one graph over a static KV cache (`rollout.compiled_decode`): the same
tokens and logprobs as the eager loop, the hook points that stay outside the graph kept, the rest decoded eagerly
with one warning. One model and one (rows, capacity) bucket for the module, so it compiles once (seconds)."""

import warnings

import pytest
import torch

from models.ouro import build_tiny_ouro
from models.tiny import build_tiny_model, build_tiny_tokenizer
from rollout import compiled_decode
from rollout.decoding import KVBuffers, decode

PROMPTS = ["12+3*4=", "5+6*7=", "1+1*1=", "99+9*9="] * 2


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=3).eval()
    # the model's most sampled token serves as EOS, so that rows end at different steps (and keep running in the
    # static graph)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    ids = decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=20, temperature=1.0, top_k=0,
                 top_p=1.0, eos_token_id=-1, pad_token_id=tok.pad_token_id)[0]
    model.generation_config.eos_token_id = int(ids.flatten().mode().values)
    return model


def _run(model, tok, compiled, *, temperature=0.0, seed=0, prompts=PROMPTS, max_new_tokens=20, **kw):
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    options = dict(top_k=0, top_p=1.0, eos_token_id=model.generation_config.eos_token_id, pad_token_id=tok.pad_token_id,
                   tokenizer=tok, fused_attention=False, packed_weights=False)
    options.update(kw)
    return decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens,
                  temperature=temperature, compiled=compiled, **options)


def _assert_same(a, b):
    assert torch.equal(a[2], b[2]) and torch.equal(a[0], b[0]) and torch.equal(a[4], b[4])
    assert (a[1] - b[1]).abs().max() < 1e-5  # fp32 logprobs: the graph's kernels round differently, no more


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 0), (1.0, 7)])
def test_the_compiled_step_samples_the_eager_loops_tokens_and_logprobs(model, tok, temperature, seed):
    eager = _run(model, tok, False, temperature=temperature, seed=seed)
    compiled = _run(model, tok, True, temperature=temperature, seed=seed)
    _assert_same(eager, compiled)
    if temperature > 0:
        assert len(set(eager[2].tolist())) > 1  # rows ended at different steps: the ended ones kept running
    # and the eager reference is the loop with its own speed-ups on (fused attention, packed weights, compaction)
    _assert_same(_run(model, tok, False, temperature=temperature, seed=seed, fused_attention=True,
                      packed_weights=True), compiled)


def test_the_fused_attention_and_packed_weights_run_inside_the_graph_over_the_filled_positions(model, tok,
                                                                                                monkeypatch):
    """At 256 (row, head) pairs and more the plain loop attends with `rollout.fused_attention`'s kernel; inside the
    compiled step it runs as `looprl::attend_filled` over the positions filled so far (not the static capacity),
    and the linear layers multiply packed weights through `looprl::packed_linear`, each packed once a
    generate: the same tokens and logprobs as the eager loop."""
    from rollout import fused_attention, packed_linear
    rows = PROMPTS * 8  # 64 rows x 4 heads
    assert fused_attention.applies(model, rows=len(rows))
    eager = _run(model, tok, False, temperature=1.0, prompts=rows, fused_attention=True, packed_weights=True)
    monkeypatch.setattr(compiled_decode, "ROW_BUCKET", 8)  # 11 of the 64 rows end early
    windows, packs = [], []
    kernel, pack = fused_attention._kernel, packed_linear._pack

    def recording_kernel():
        compiled_kernel = kernel()

        def attend(query, key, value, mask, scaling):
            windows.append(key.shape[2])
            return compiled_kernel(query, key, value, mask, scaling)
        return attend
    monkeypatch.setattr(fused_attention, "_kernel", recording_kernel)
    monkeypatch.setattr(packed_linear, "_pack", lambda weight, r, packing: packs.append(r) or pack(weight, r, packing))
    buffers = KVBuffers()
    compiled = _run(model, tok, True, temperature=1.0, prompts=rows, fused_attention=True, packed_weights=True,
                    kv_buffers=buffers)
    _assert_same(eager, compiled)
    # the rows that ended went out of the graph's batch by row buckets: 64 rows, then fewer, down to the bucket
    # that held the rows still decoding at the last step
    alive_last = int((compiled[2] == compiled[2].max()).sum())
    bucket = compiled_decode.ROW_BUCKET
    assert sorted(key[1] for key in buffers.static)[::len(buffers.static) - 1] == [
        max(bucket, -(-alive_last // bucket) * bucket), len(rows)]
    prompt = tok(rows, return_tensors="pt", padding=True)["input_ids"].shape[1]
    steps = int(compiled[2].max()) - 1  # the first token comes from the prefill's logits
    layers = model.config.num_hidden_layers
    # every layer of every one-token step attends to the prompt and the tokens fed so far, one more each step
    assert windows == [prompt + 1 + s for s in range(steps) for _ in range(layers)]
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert packs == [len(rows)] * linears  # each weight packed once, for the generate's row count


def test_logits_processors_penalties_and_stop_strings_stay_outside_the_graph(model, tok):
    from recipes.extending.decoding import NoImmediateRepeat
    kw = dict(temperature=1.0, seed=2, method=NoImmediateRepeat(), repetition_penalty=1.3, stop=["*"])
    eager, compiled = _run(model, tok, False, **kw), _run(model, tok, True, **kw)
    _assert_same(eager, compiled)
    for row, length in zip(compiled[0], compiled[2]):  # the processor acted: no token repeats its predecessor
        tokens = row[:int(length)].tolist()
        assert all(x != y for x, y in zip(tokens, tokens[1:]))


def test_one_graph_serves_every_generate_of_a_bucket(model, tok):
    from torch._dynamo.utils import counters
    _run(model, tok, True)
    graphs = counters["stats"]["unique_graphs"]
    # other prompts, one token shorter after padding, another length cap: the same (rows, capacity) bucket
    shorter = [p[1:] if len(p) > 6 else p for p in PROMPTS]
    _run(model, tok, True, prompts=shorter, temperature=1.0, max_new_tokens=19)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("packed_weights", [False, True])
def test_weights_changed_between_steps_are_read_by_the_graph(model, tok, packed_weights):
    """In-flight weight updates copy into the model's tensors: the compiled step reads them, as the eager one does
    (neither packs a copy of weights that may change)."""
    head = model.lm_head.weight
    saved = head.detach().clone()

    def swap(step):
        if step == 3:
            with torch.no_grad():
                head.mul_(-1.0)
    try:
        eager = _run(model, tok, False, between_steps=swap, packed_weights=packed_weights)
        head.data.copy_(saved)
        compiled = _run(model, tok, True, between_steps=swap, packed_weights=packed_weights)
    finally:
        head.data.copy_(saved)
    _assert_same(eager, compiled)
    assert not torch.equal(compiled[0], _run(model, tok, True)[0])  # the swap changed the tokens after step 3


class _ResidualShift:
    """A method with a residual hook: the graph cannot capture it."""

    def residual_hooks(self, model):
        return {0: lambda hidden, state: hidden + 0.5}


def test_what_the_graph_cannot_capture_decodes_eagerly_and_says_so_once(model, tok):
    compiled_decode._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = _run(model, tok, False, method=_ResidualShift(), temperature=1.0)
        first = _run(model, tok, True, method=_ResidualShift(), temperature=1.0)
        _run(model, tok, True, method=_ResidualShift(), temperature=1.0)
    said = [str(w.message) for w in caught if "compiled decode" in str(w.message)]
    assert len(said) == 1 and "hooks the forward" in said[0]
    _assert_same(eager, first)
    assert not torch.equal(first[0], _run(model, tok, True, temperature=1.0)[0])  # the hook did act


def test_a_looped_model_decodes_eagerly_with_the_reason(tok):
    ouro = build_tiny_ouro(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, total_ut_steps=2,
                           seed=1).eval()
    compiled_decode._warned.clear()
    with pytest.warns(UserWarning, match="OuroForCausalLM does not declare a compileable forward"):
        compiled = _run(ouro, tok, True, temperature=1.0)
    _assert_same(_run(ouro, tok, False, temperature=1.0), compiled)


def test_the_engine_option_decodes_through_the_graph(tmp_path, tok, model, monkeypatch):
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    eager = HFEngine(str(tmp_path)).generate(PROMPTS[:4], sp)
    engine = HFEngine(str(tmp_path), compiled_decode=True)
    steps, original = [], compiled_decode.StaticDecodeCache.step
    monkeypatch.setattr(compiled_decode.StaticDecodeCache, "step", lambda self, *a: steps.append(1) or original(self, *a))
    compiled = engine.generate(PROMPTS[:4], sp)
    assert len(steps) == int(compiled.response_attn.sum(-1).max()) - 1  # every step after the prefill's: the graph
    assert torch.equal(eager.response_ids, compiled.response_ids)
    assert (eager.rollout_logp - compiled.rollout_logp).abs().max() < 1e-5
    # the engine keeps the bucket's static cache: another generate's keys and values in it change nothing
    engine.generate(PROMPTS[:4][::-1], sp)
    again = engine.generate(PROMPTS[:4], sp)
    assert len(engine.kv_buffers.static) == 1 and torch.equal(again.response_ids, compiled.response_ids)


def test_rows_go_on_in_the_least_row_bucket_that_holds_the_live_ones():
    bucket = compiled_decode.ROW_BUCKET
    assert bucket == 32
    assert compiled_decode.fewer_rows(128, 128) is None and compiled_decode.fewer_rows(128, 97) is None
    assert compiled_decode.fewer_rows(128, 96) == 96 and compiled_decode.fewer_rows(128, 65) == 96
    assert compiled_decode.fewer_rows(96, 33) == 64 and compiled_decode.fewer_rows(128, 0) == 32
    assert compiled_decode.fewer_rows(32, 1) is None and compiled_decode.fewer_rows(8, 0) is None


def _registered_method(name, tmp_path, model):
    """A registered causal decoding method, built with small settings for the 8-row, 20-token test decode."""
    from rl.registry import lookup
    cls = lookup("decoding", name)
    if name == "densesteer":
        torch.manual_seed(5)
        torch.save({1: torch.randn(model.config.hidden_size)}, tmp_path / "vectors.pt")
        return cls(str(tmp_path / "vectors.pt"), layer=1, strength=2.0)
    if name in ("kv_snapkv", "kv_rkv", "beaconkv"):
        return cls(budget=10, sink=2, recent=4)
    if name in ("kv_streaming", "kv_h2o"):
        return cls(budget=10)
    if name == "guidance":
        return cls(lookahead=3)
    return cls()


@pytest.mark.parametrize("name", ["plain", "kv_streaming", "kv_snapkv", "kv_rkv", "kv_h2o", "beaconkv", "densesteer",
                                  "guidance"])
def test_every_registered_decoding_method_decodes_alike_with_the_compiled_option(model, tok, tmp_path, name):
    """The causal decoding methods the registry holds (the masked-diffusion ones have their own sampler): with the
    compiled option each samples what the eager loop samples; those that hook the forward, edit the cache or insert
    tokens decode eagerly and say why."""
    compiled_decode._warned.clear()
    eager = _run(model, tok, False, method=_registered_method(name, tmp_path, model), temperature=1.0, seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _run(model, tok, True, method=_registered_method(name, tmp_path, model), temperature=1.0, seed=4)
    said = [str(w.message) for w in caught if "compiled decode" in str(w.message)]
    _assert_same(eager, compiled)
    if name == "plain":
        assert said == []
    else:
        assert len(said) == 1 and "this call decodes with the eager step" in said[0]
