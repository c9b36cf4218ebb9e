"""Decode-time linear layers with weights packed once (`rollout.packed_linear`): the same products as `F.linear`,
every linear layer of the model packed on its first call and restored after, training untouched, a clean fallback."""

import copy

import pytest
import torch
import torch.nn.functional as F

import rollout.packed_linear as packed_linear
from models.quant import FakeQuantLinear
from models.tiny import build_tiny_model, build_tiny_tokenizer
from rollout.decoding import decode
from rollout.hardware import cpu_has_bf16_matmul
from rollout.packed_linear import packed_linear_weights, packs

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=5)
    model.config._attn_implementation = "eager"
    return tok, model.eval()


def _prompts(tok):
    return tok(["12+3*4=", "5+6*7=", "1+2*3="] * 3, return_tensors="pt", padding=True, padding_side="left",
               add_special_tokens=False)


def _linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not cpu_has_bf16_matmul(), reason="oneDNN's bf16 path is not supported on this CPU"))


MKL = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")


@pytest.mark.parametrize("dtype, packing", [pytest.param(torch.float32, "mkl", marks=MKL), (torch.float32, "onednn"),
                                            pytest.param(torch.bfloat16, "auto", marks=BF16.marks)])
def test_packed_products_equal_f_linear_and_every_linear_is_packed_then_restored(tiny, dtype, packing):
    tok, model = tiny
    model = copy.deepcopy(model).to(dtype)
    assert all(packs(m) for m in _linears(model))
    enc = _prompts(tok)
    with torch.no_grad():
        own = model(**enc).logits.float()
        with packed_linear_weights(model, rows=9, fp32_packing=packing) as packed:
            inside = model(**enc).logits.float()
            assert set(packed) == set(_linears(model))  # 2 layers x 7 projections + the LM head
            assert len(packed) == 15
        assert packed == {}  # the packed copies are dropped on exit
    assert all("forward" not in m.__dict__ for m in model.modules())  # the modules' own forwards again
    scale = own.abs().max()
    # fp32: MKL's sgemm on a packed operand, or oneDNN's; bf16: oneDNN's products in another blocking order: equal
    # to the dtype's rounding
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (inside - own).abs().max() <= tol * scale


@MKL
def test_an_fp32_weight_packed_once_for_mkl_serves_every_row_count():
    """fp32 weights pack for MKL's sgemm where the packing is `mkl`; one packing multiplies blocks of any row count
    (the decode batch shrinks as rows end), bit for bit as `F.linear` at the decode's block sizes."""
    assert packed_linear.uses_mkl(torch.float32, "mkl") and not packed_linear.uses_mkl(torch.bfloat16, "mkl")
    g = torch.Generator().manual_seed(0)
    weight, bias, stale = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(96, 64)
    packed = packed_linear._pack(weight, 128, "mkl")
    for rows in (64, 97, 128, 200):
        x = torch.randn(rows, 64, generator=g)
        # `stale` is passed as the plain weight: a call that multiplied it instead of the packed copy would differ
        assert torch.equal(packed_linear._multiply(x, packed, stale, None, "mkl"), F.linear(x, weight)), rows
        assert torch.equal(packed_linear._multiply(x[:, None], packed, stale, bias, "mkl"),
                           F.linear(x[:, None], weight, bias))
    for rows in (1, 5):  # a few rows: MKL's other kernels, equal to fp32 rounding
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(packed_linear._multiply(x, packed, stale, bias, "mkl"), F.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)


def test_an_fp32_weight_packed_once_for_onednn_serves_every_row_count():
    """fp32 weights pack for oneDNN where the packing is `onednn`: one packing (for 128 rows) multiplies blocks of
    any row count, equal to `F.linear` to fp32 rounding."""
    assert not packed_linear.uses_mkl(torch.float32, "onednn")
    g = torch.Generator().manual_seed(0)
    weight, bias, stale = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(96, 64)
    packed = packed_linear._pack(weight, 128, "onednn")
    for rows in (1, 5, 64, 97, 128, 200):
        x = torch.randn(rows, 64, generator=g)
        # `stale` is passed as the plain weight: a call that multiplied it instead of the packed copy would differ
        torch.testing.assert_close(packed_linear._multiply(x, packed, stale, bias, "onednn"),
                                   F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_linear._multiply(x[:, None], packed, stale, None, "onednn"),
                                   F.linear(x[:, None], weight), rtol=1e-5, atol=1e-5)


def test_auto_packs_fp32_for_mkl_on_intel_cpus_and_for_onednn_elsewhere(monkeypatch):
    for vendor, expected in (("GenuineIntel", "mkl" if torch.backends.mkl.is_available() else "onednn"),
                             ("AuthenticAMD", "onednn"), ("", "onednn")):
        monkeypatch.setattr(packed_linear, "cpu_vendor", lambda vendor=vendor: vendor)
        assert packed_linear.resolve_fp32_packing("auto") == expected, vendor
    assert packed_linear.resolve_fp32_packing("onednn") == "onednn"  # a fixed choice is kept on any CPU


def test_two_engines_in_one_process_keep_their_own_fp32_packing(monkeypatch, tmp_path):
    """The packing is each engine's (`engine_params.hf.fp32_packing`), not the process's: engines built one after
    the other with either packing generate with their own, in any order."""
    from models.tiny import save_tiny
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    made = []
    pack = packed_linear._pack
    monkeypatch.setattr(packed_linear, "_pack", lambda weight, rows, packing: made.append(packing)
                        or pack(weight, rows, packing))
    path = str(save_tiny(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128))
    choices = ["onednn", "mkl"] if torch.backends.mkl.is_available() else ["onednn"]
    engines = {choice: HFEngine(path, fp32_packing=choice) for choice in choices}
    for choice in [*choices, *reversed(choices)]:
        made.clear()
        engines[choice].generate(["12+3*4="], SamplingParams(n=2, max_new_tokens=4, seed=0))
        assert made == [choice] * 15, choice  # 2 layers x 7 projections + the LM head, each packed once


def test_a_bad_fp32_packing_is_refused_naming_the_key_before_the_engine_loads_a_model(monkeypatch, tmp_path):
    from rollout.hf_engine import HFEngine
    with pytest.raises(ValueError, match=r"rollout.engine_params.hf.fp32_packing: 'blas' is none of auto, mkl"):
        HFEngine(str(tmp_path / "no-model-here"), fp32_packing="blas")
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'mkl', but this torch was built without MKL"):
        packed_linear.resolve_fp32_packing("mkl")


@pytest.mark.parametrize("packing", [pytest.param("mkl", marks=MKL), "onednn"])
def test_decode_with_packed_weights_samples_the_models_tokens_and_logprobs(tiny, packing):
    tok, model = tiny
    enc = _prompts(tok)
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    runs = {}
    for on in (True, False):
        torch.manual_seed(7)
        runs[on] = decode(model, enc["input_ids"], enc["attention_mask"], packed_weights=on, fp32_packing=packing, **kw)
    (resp, logp, lengths, _, _), (resp0, logp0, lengths0, _, _) = runs[True], runs[False]
    assert int(lengths.max()) > 3
    assert torch.equal(resp, resp0) and torch.equal(lengths, lengths0)
    torch.testing.assert_close(logp, logp0, rtol=0, atol=1e-5)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_training_inside_the_context_runs_f_linear_with_the_same_gradients(tiny):
    tok, model = tiny
    enc = _prompts(tok)

    def grads(m):
        m = copy.deepcopy(m).train()
        with packed_linear_weights(m) as packed:
            m(**enc).logits.float().logsumexp(-1).mean().backward()
            assert packed == {}  # a forward that needs gradients packs nothing
        return {n: p.grad for n, p in m.named_parameters()}
    inside = grads(model)
    plain = copy.deepcopy(model).train()
    plain(**enc).logits.float().logsumexp(-1).mean().backward()
    for n, p in plain.named_parameters():
        assert torch.equal(inside[n], p.grad), n


def test_a_wrapper_that_calls_f_linear_itself_is_left_alone(tiny):
    tok, model = tiny
    model = copy.deepcopy(model)
    layer = model.model.layers[0].mlp
    layer.down_proj = FakeQuantLinear(layer.down_proj, w_bits=8, a_bits=16)
    assert not packs(layer.down_proj)
    enc = _prompts(tok)
    with torch.no_grad(), packed_linear_weights(model) as packed:
        model(**enc)
        assert layer.down_proj.linear not in packed  # its inner linear is never called: never packed
        assert len(packed) == 14


def test_a_packed_path_that_fails_warns_once_and_decodes_with_f_linear(tiny, monkeypatch):
    tok, model = tiny
    enc = _prompts(tok)
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=tok.pad_token_id)

    def no_op(weight, rows, packing):
        raise RuntimeError("mkldnn::_reorder_linear_weight is not available in this build")
    monkeypatch.setattr(packed_linear, "_state", {"ran": False, "failed": None})
    monkeypatch.setattr(packed_linear, "_pack", no_op)
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="did not run.*not available") as caught:
        degraded = decode(model, enc["input_ids"], enc["attention_mask"], packed_weights=True, **kw)
    assert len([w for w in caught if "did not run" in str(w.message)]) == 1
    torch.manual_seed(3)
    own = decode(model, enc["input_ids"], enc["attention_mask"], packed_weights=False, **kw)
    for a, b in zip(degraded, own):
        assert torch.equal(a, b)  # exactly F.linear
    # once packed products have run, an error in them is raised, not taken for a missing op
    monkeypatch.setattr(packed_linear, "_state", {"ran": True, "failed": None})
    with pytest.raises(RuntimeError, match="not available"):
        decode(model, enc["input_ids"], enc["attention_mask"], packed_weights=True, **kw)
