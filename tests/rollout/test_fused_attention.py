"""The fused one-query decode attention (`rollout.fused_attention`): its formula by hand and against a reference
with grouped heads, the compiled kernel against the formula, and the decode loop with it."""

import copy
import math
import threading

import pytest
import torch

import rollout.compiled_decode as compiled_decode
import rollout.fused_attention as fused
from models.ouro import build_tiny_ouro
from models.tiny import build_tiny_model, build_tiny_tokenizer
from rollout.decoding import decode
from rollout.fused_attention import MIN_ROW_HEADS, PREFIX, applies, attend_one_query, fused_decode_attention


def test_one_query_attention_by_hand():
    # q = (1, 0), keys (1, 0) and (0, 1): scores 1 and 0, weights e/(e+1) and 1/(e+1) on values (1, 2), (3, 4)
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 1, 2, 2)
    w = math.e / (math.e + 1)
    out = attend_one_query(q, k, v, None, scaling=1.0)
    assert out.shape == (1, 1, 1, 2)
    torch.testing.assert_close(out.view(2), torch.tensor([w * 1 + (1 - w) * 3, w * 2 + (1 - w) * 4]))
    # the second key masked (the additive mask's dtype minimum): all weight on the first value
    mask = torch.tensor([0.0, torch.finfo(torch.float32).min]).view(1, 1, 1, 2)
    torch.testing.assert_close(attend_one_query(q, k, v, mask, scaling=1.0).view(2), torch.tensor([1.0, 2.0]))
    # scaling 2: scores 2 and 0
    w2 = math.e ** 2 / (math.e ** 2 + 1)
    torch.testing.assert_close(attend_one_query(q, k, v, None, scaling=2.0).view(2),
                               torch.tensor([w2 + (1 - w2) * 3, 2 * w2 + (1 - w2) * 4]))


def _reference(q, k, v, mask, scaling):
    """Textbook attention in fp64 with the key/value heads repeated for their query heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = q.double() @ k.transpose(2, 3) * scaling + mask[..., :k.shape[2]].double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_heads_and_the_compiled_kernel_match_textbook_attention(dtype):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, C, D = 3, 4, 2, 7, 8
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, C, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(B, 1, 1, C + 2, dtype=dtype)  # wider than the keys: only the first C columns count
    mask[0, ..., :3] = torch.finfo(dtype).min  # a left-padded row
    mask[2, ..., 5:] = torch.finfo(dtype).min  # unfilled cache columns
    ref = _reference(q, k, v, mask, 0.3)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    eager = attend_one_query(q, k, v, mask, 0.3)
    assert eager.dtype == dtype and eager.shape == (B, 1, H, D)
    torch.testing.assert_close(eager.double(), ref, **tol)
    compiled = fused._kernel()(q, k, v, mask, 0.3)
    torch.testing.assert_close(compiled.double(), ref, **tol)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_the_compiled_kernel_keeps_one_graph_when_sizes_that_were_equal_differ():
    # its first call has as many rows as cached positions: with duck sizing its graph would be guarded on their
    # equality and compile again at the next call (`fused.compile_kernel`)
    def attend(q, k, v, mask, scaling):  # a frame of its own: no other test's compiled graph serves it
        return attend_one_query(q, k, v, mask, scaling)
    kernel = fused.compile_kernel(attend)
    g = torch.Generator().manual_seed(0)
    frames = torch._dynamo.utils.counters["frames"]
    compiled_before = frames["ok"]
    for rows, cached in ((6, 6), (6, 7), (5, 9)):
        q = torch.randn(rows, 4, 1, 8, generator=g)
        k, v = (torch.randn(rows, 2, cached, 8, generator=g) for _ in range(2))
        mask = torch.zeros(rows, 1, 1, cached)
        mask[0, ..., :2] = torch.finfo(torch.float32).min
        torch.testing.assert_close(kernel(q, k, v, mask, 0.3), attend_one_query(q, k, v, mask, 0.3), rtol=0,
                                   atol=1e-6)
    assert frames["ok"] - compiled_before == 1


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=3)
    model.config._attn_implementation = "eager"
    return tok, model.eval()


def _prompts(tok, copies=22):
    """3 prompts x 22 = 66 rows: with the tiny model's 4 heads, 264 (row, head) pairs, past `MIN_ROW_HEADS`."""
    return tok(["12+3*4=", "5+6*7=", "1+2*3="] * copies, return_tensors="pt", padding=True, padding_side="left",
               add_special_tokens=False)


def _teacher_forced_logp(model, enc, resp, lengths):
    """Each sampled token's logprob from one forward over prompt and response (the learner's view)."""
    P = enc["input_ids"].shape[1]
    real = (torch.arange(resp.shape[1])[None] < lengths[:, None]).long()
    mask = torch.cat([enc["attention_mask"], real], 1)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([enc["input_ids"], resp], 1), attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1) * real, real.bool()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loop_with_the_fused_kernel_samples_with_the_models_logprobs(tiny, monkeypatch, dtype):
    """The fused kernel keeps scores in fp32 where the model's bf16 kernel rounds them, so the two loops may sample
    differently; what must hold is that each run's logprobs are the model's, to the dtype's rounding, and that the
    kernel ran at every decode step of every layer (and never at the prefill), reading views of the cache's filled
    part (not its whole buffers, as bf16 attention without the kernel does) in both dtypes."""
    tok, model = tiny
    cast = copy.deepcopy(model).to(dtype)
    enc = _prompts(tok)
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    calls: list[int] = []
    cached: list[int] = []  # the key positions each call read
    kernel = fused._kernel()

    def counting(*args):
        calls.append(args[0].shape[0])
        cached.append(args[1].shape[2])
        return kernel(*args)
    monkeypatch.setattr(fused, "_kernel", lambda: counting)
    errors = {}
    for on in (True, False):
        torch.manual_seed(4)
        resp, logp, lengths, _, _ = decode(cast, enc["input_ids"], enc["attention_mask"], fused_attention=on, **kw)
        if on:
            steps = int(lengths.max())  # the longest row's tokens: the loop fed back all but the last
            assert steps > 3 and calls == [66] * (2 * (steps - 1))  # every layer, every decode step, all rows
            P = enc["input_ids"].shape[1]  # both layers of decode step s read the prompt and s tokens
            assert cached == [P + s for s in range(1, steps) for _ in range(2)]
            assert cast.config._attn_implementation == "eager"  # restored
        reference, real = _teacher_forced_logp(model, enc, resp, lengths)  # fp32 weights, the model's kernel
        errors[on] = (logp - reference)[real].abs()
    assert len(calls) == 2 * (steps - 1)  # the run without it did not call it
    if dtype == torch.float32:
        assert errors[True].max() < 1e-5 and errors[False].max() < 1e-5
    else:
        assert errors[True].max() < 1e-2 and errors[False].max() < 1e-2
        assert errors[True].mean() < 1.5 * errors[False].mean() + 1e-3  # no worse than the model's own bf16 kernel


class HooksTheForward:
    """A decoding method with a (empty) forward hook: the loop is then not the plain one."""

    def forward_hooks(self, model, state):
        return []


def test_the_kernel_is_left_out_where_it_does_not_apply(tiny, monkeypatch):
    tok, model = tiny
    enc = _prompts(tok)
    monkeypatch.setattr(fused, "_kernel", lambda: pytest.fail("the fused kernel ran"))
    kw = dict(max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=tok.pad_token_id,
              fused_attention=True)
    decode(model, enc["input_ids"], enc["attention_mask"], method=HooksTheForward(), **kw)  # a hooked forward
    small = _prompts(tok, copies=21)  # 63 rows x 4 heads: under MIN_ROW_HEADS, the compile would not pay
    assert 63 * 4 < MIN_ROW_HEADS <= 66 * 4 and not applies(model, rows=63) and applies(model, rows=66)
    decode(model, small["input_ids"], small["attention_mask"], **kw)
    ouro = build_tiny_ouro(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, total_ut_steps=2)
    assert not applies(ouro)
    decode(ouro.to(torch.bfloat16).eval(), enc["input_ids"], enc["attention_mask"], **kw)
    softcapped = copy.deepcopy(model)
    softcapped.config._attn_implementation = "flex_attention"
    assert not applies(softcapped)


def test_blocks_of_several_queries_and_training_run_the_models_own_kernel(tiny):
    tok, model = tiny
    enc = _prompts(tok)
    with torch.no_grad():
        own = model(**enc).logits
        with fused_decode_attention(model) as on:
            assert on and model.config._attn_implementation == PREFIX + "eager"
            inside = model(**enc).logits
    assert torch.equal(own, inside)  # the prefill: the same kernel and the same additive mask
    assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError, match="boom"), fused_decode_attention(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "eager"  # restored on an error too


def test_a_kernel_that_does_not_compile_leaves_the_models_kernel_with_one_warning(tiny, monkeypatch):
    tok, model = tiny
    half = copy.deepcopy(model).to(torch.bfloat16)
    enc = _prompts(tok)
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=tok.pad_token_id)

    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")
    monkeypatch.setattr(fused, "_state", {"ran": False, "failed": None})
    monkeypatch.setattr(fused, "_kernel", lambda: no_compiler)
    torch.manual_seed(2)
    with pytest.warns(UserWarning, match="did not compile.*InvalidCxxCompiler") as caught:
        degraded = decode(half, enc["input_ids"], enc["attention_mask"], fused_attention=True, **kw)
    assert len([w for w in caught if "did not compile" in str(w.message)]) == 1
    assert fused._state["failed"].startswith("RuntimeError")
    torch.manual_seed(2)
    own = decode(half, enc["input_ids"], enc["attention_mask"], fused_attention=False, **kw)
    for a, b in zip(degraded, own):
        assert torch.equal(a, b)  # exactly the model's own kernel
    # once the kernel has compiled and run, an error in it is not taken for a compile failure
    monkeypatch.setattr(fused, "_state", {"ran": True, "failed": None})
    with pytest.raises(RuntimeError, match="InvalidCxxCompiler"):
        decode(half, enc["input_ids"], enc["attention_mask"], fused_attention=True, **kw)


def test_share_prompt_reads_points_each_row_at_its_groups_first_row():
    groups = torch.tensor([2, 0, 2, 1, 0, 1])
    fused.share_prompt_reads(groups, 48)
    assert fused.shared_prompt()["rows"].tolist() == [0, 1, 0, 3, 1, 3] and fused.shared_prompt()["length"] == 48
    fused.share_prompt_reads(groups[[1, 2, 3, 5]], 64)  # rows 0 and 4 left the batch: new first rows
    assert fused.shared_prompt()["rows"].tolist() == [0, 1, 2, 2] and fused.shared_prompt()["length"] == 64
    fused.share_prompt_reads(groups, 0)  # no prompt in the cache: every row reads its own
    assert fused.shared_prompt()["rows"] is None
    fused.share_prompt_reads(torch.tensor([3, 1, 2]), 64)  # no two rows share a prompt
    assert fused.shared_prompt()["rows"] is None
    seen = []  # another thread keeps its own setting
    fused.share_prompt_reads(groups, 48)
    thread = threading.Thread(target=lambda: seen.append(fused.shared_prompt()["rows"]))
    thread.start()
    thread.join()
    assert seen == [None] and fused.shared_prompt()["rows"] is not None
    fused.share_prompt_reads(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_prompt_kernel_reads_a_groups_prompt_from_one_row_alone(dtype):
    """Rows 0-2 share a prompt of 5 positions, rows 3-4 another. With equal copies the kernel gives the one-query
    kernel's numbers bit for bit; with the copies of rows 1, 2 and 4 overwritten it still does (it reads the prompt
    from rows 0 and 3 alone), while a change past the prompt reaches the row that holds it."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, C, D, P = 5, 4, 2, 9, 8, 5
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, C, D, generator=g).to(dtype) for _ in range(2))
    first = torch.tensor([0, 0, 0, 3, 3])
    k[:, :, :P], v[:, :, :P] = k[first, :, :P], v[first, :, :P]
    mask = torch.zeros(B, 1, 1, C, dtype=dtype)
    mask[3:, ..., :2] = torch.finfo(dtype).min  # the second prompt is left-padded by 2
    dense = fused._kernel()(q, k, v, mask, 0.3)
    shared = fused._shared_kernel()
    assert torch.equal(shared(q, k, v, mask, 0.3, first, P), dense)
    assert torch.equal(fused.attend_shared_prompt(q, k, v, mask, 0.3, first, P), attend_one_query(q, k, v, mask, 0.3))
    stale_k, stale_v = k.clone(), v.clone()
    stale_k[[1, 2, 4], :, :P] += 1.0
    stale_v[[1, 2, 4], :, :P] -= 1.0
    assert torch.equal(shared(q, stale_k, stale_v, mask, 0.3, first, P), dense)
    assert not torch.equal(fused._kernel()(q, stale_k, stale_v, mask, 0.3), dense)  # the copies were read there
    later = k.clone()
    later[1, :, P:] += 1.0
    moved = shared(q, later, v, mask, 0.3, first, P)
    assert not torch.equal(moved[1], dense[1])
    assert torch.equal(moved[[0, 2, 3, 4]], dense[[0, 2, 3, 4]])


def test_the_shared_prompt_kernel_runs_from_min_shared_prompt_bytes_of_prompt_copies(monkeypatch):
    """A layer of 5 rows x 2 key/value heads x head size 8 in fp32 whose 5-position prompt copies hold
    2 x 5 x 2 x 5 x 8 x 4 = 3,200 bytes: at a threshold of 3,200 the shared kernel runs, at 3,201 the per-row one; in
    bf16 the same copies hold 1,600 bytes, against bf16's own threshold."""
    B, Hkv, C, D, P = 5, 2, 9, 8, 5
    q, k, v = torch.randn(B, 4, 1, D), torch.randn(B, Hkv, C, D), torch.randn(B, Hkv, C, D)
    ran = []
    shared, own = fused._shared_kernel(), fused._kernel()
    monkeypatch.setattr(fused, "_shared_kernel", lambda: lambda *a: ran.append("shared") or shared(*a))
    monkeypatch.setattr(fused, "_kernel", lambda: lambda *a: ran.append("own") or own(*a))
    fused.share_prompt_reads(torch.tensor([0, 0, 0, 1, 1]), P)
    for threshold in (3200, 3201):
        monkeypatch.setattr(fused, "MIN_SHARED_PROMPT_BYTES", {2: 1, 4: threshold})  # fp32: 4-byte elements
        fused._attend(q, k, v, None, 0.3)
    fused._attend(q[:4], k[:4], v[:4], None, 0.3)  # rows that do not match the loop's (never in the loop): its own
    monkeypatch.setattr(fused, "MIN_SHARED_PROMPT_BYTES", {2: 1600, 4: 1})  # bf16 copies: half the bytes
    fused._attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 0.3)
    monkeypatch.setattr(fused, "MIN_SHARED_PROMPT_BYTES", {2: 1601, 4: 1})
    fused._attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 0.3)
    fused.share_prompt_reads(None)
    assert ran == ["shared", "own", "own", "shared", "own"]


def _long_prompts(tok, copies=16):
    """4 prompts of 48-54 characters x 16 = 64 rows (256 (row, head) pairs with 4 heads): prompts past
    48 positions."""
    texts = ["12+3*4=" * 7, "5+6*7=" * 8, "1+2*3=" * 9, "9*9+1=" * 8]
    return tok(texts * copies, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)


# CI: the eager loop (the engine's default); the compiled step (off by default) in the extended suite
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_the_loop_reads_each_prompt_once_per_group_and_samples_what_it_samples_without(tiny, monkeypatch, compiled):
    """bf16, rows ending at EOS: with long prompts the loop runs the shared-prompt kernel at every decode step with
    its rows as they stand (fewer as ended rows leave), and samples the same tokens with the same logprobs as the
    loop whose rows read their own copies."""
    tok, model = tiny
    half = copy.deepcopy(model).to(torch.bfloat16)
    enc = _long_prompts(tok)
    monkeypatch.setattr(compiled_decode, "ROW_BUCKET", 8)  # the compiled step's rows leave by eights
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id, fused_attention=True, packed_weights=True, compiled=compiled)
    kernel = fused._shared_kernel()
    seen: list[tuple[int, list[int]]] = []

    def recording(q, k, v, mask, scaling, rows, length):
        seen.append((length, rows.tolist()))
        return kernel(q, k, v, mask, scaling, rows, length)
    monkeypatch.setattr(fused, "_shared_kernel", lambda: recording)
    runs = {}
    for threshold in (0, 1 << 62):  # the tiny model's cache is far under the threshold: every size, then none
        monkeypatch.setattr(fused, "MIN_SHARED_PROMPT_BYTES", {2: threshold, 4: threshold})
        torch.manual_seed(5)
        runs[threshold] = decode(half, enc["input_ids"], enc["attention_mask"], **kw)
    shared, own = runs.values()
    for a, b in zip(shared, own):
        assert torch.equal(a, b)
    lengths, ended = shared[2], shared[4]
    assert ended.any() and not ended.all()  # rows ended at EOS, others ran on
    steps = int(lengths.max())
    assert len(seen) == 2 * (steps - 1)  # both layers of every decode step, only in the first run
    P = enc["input_ids"].shape[1]
    assert all(length == P for length, _ in seen)
    batches = [rows for _, rows in seen]
    assert batches[0] == [i % 4 for i in range(64)] == batches[1]  # row i holds prompt i % 4
    assert len(batches[-1]) < 64  # ended rows left the batch, and the first rows were recounted
    for rows in batches:
        assert all(rows[r] <= r and rows[rows[r]] == rows[r] for r in range(len(rows)))
    assert fused.shared_prompt()["rows"] is None  # cleared when the loop ends
