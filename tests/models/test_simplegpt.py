"""SimpleGPT (models/simplegpt.py): SimpleNorm after every block linear, no pre-norms, the released initialisation,
HF save/load and generation, and the curvature probe its benchmark uses."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from models.simplegpt import SimpleGPTForCausalLM, SimpleNormLinear
from models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    return tok, build_tiny_model(tok, hidden_size=64, num_layers=3, num_heads=4, intermediate_size=128, seed=0,
                                 norm_placement="simplenorm").eval()


def test_every_block_linear_is_directly_followed_by_its_norm_and_there_are_no_pre_norms(tiny):
    tok, model = tiny
    assert isinstance(model, SimpleGPTForCausalLM) and model.config.model_type == "simplegpt"
    blocks = model.model.layers
    linears = {n: m for n, m in blocks.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 7 * 3 and all(isinstance(m, SimpleNormLinear) for m in linears.values())
    norms = [n for n, m in blocks.named_modules() if isinstance(m, LlamaRMSNorm)]
    assert sorted(norms) == sorted(f"{n}.norm" for n in linears)  # the only norms in the blocks: no pre-norms
    assert isinstance(model.model.norm, LlamaRMSNorm)  # the final norm is kept
    # on a real forward, each norm's input is exactly its linear's W x: nothing sits between them
    seen = {}

    def check(name):
        def hook(module, args, out):
            seen[name] = torch.allclose(module.norm.last_input, F.linear(args[0], module.weight, module.bias))
        return hook
    handles = []
    for name, m in linears.items():
        handles.append(m.register_forward_hook(check(name)))
        handles.append(m.norm.register_forward_pre_hook(lambda mod, args: setattr(mod, "last_input", args[0])))
    try:
        model(**tok(["12+34=46", "abc"], return_tensors="pt", padding=True))
    finally:
        for h in handles:
            h.remove()
    assert set(seen) == set(linears) and all(seen.values())
    # the block is h = x + Attn(x), y = h + MLP(h): the residual stream is not normalised
    layer = blocks[0]
    x = torch.randn(2, 5, 64)
    pos = torch.arange(5)[None].expand(2, -1)
    emb = model.model.rotary_emb(x, pos)
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None].expand(2, 1, 5, 5)
    h = x + layer.self_attn(hidden_states=x, position_embeddings=emb, attention_mask=mask)[0]
    assert torch.allclose(layer(x, attention_mask=mask, position_embeddings=emb), h + layer.mlp(h), atol=1e-6)


def test_simplenorm_output_rms_is_the_gain_whatever_the_input_scale():
    lin = SimpleNormLinear(48, 96, bias=False, eps=1e-5, init_std=0.02)
    x = torch.randn(4, 10, 48)
    for scale in (1.0, 1e3):  # (eps = 1e-5 only shows for outputs of RMS near 3e-3)
        rms = lin(x * scale).pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-3)
    assert torch.allclose(lin(x * 1000), lin(x), atol=1e-4)  # x × 1000 leaves it unchanged
    with torch.no_grad():
        lin.norm.weight.fill_(-2.5)
    rms = lin(x * 1000).pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.full_like(rms, 2.5), atol=1e-3)  # ≈ |gain|


def test_the_released_initialisation(tiny):
    _, model = tiny
    torch.manual_seed(0)
    big = build_tiny_model(build_tiny_tokenizer(), hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512,
                           norm_placement="simplenorm")
    for i, layer in enumerate(big.model.layers):
        deep = 0.02 / math.sqrt(2 * (i + 1))
        for m, std in ((layer.self_attn.q_proj, 0.02), (layer.mlp.gate_proj, 0.02), (layer.self_attn.o_proj, deep),
                       (layer.mlp.up_proj, deep), (layer.mlp.down_proj, deep)):
            w = m.weight
            # a normal truncated at ±3σ has std 0.9866σ
            assert float(w.detach().std()) == pytest.approx(0.9866 * std, rel=0.05) and float(w.abs().max()) <= 3 * std + 1e-9
            assert torch.equal(m.norm.weight, torch.ones_like(m.norm.weight))
    assert float(big.model.embed_tokens.weight.detach().std()) == pytest.approx(1.0, rel=0.05)
    s = 256 ** -0.5
    assert float(big.lm_head.weight.detach().std()) == pytest.approx(0.9866 * s, rel=0.05)
    assert not big.config.tie_word_embeddings


def test_it_saves_loads_and_generates_like_any_hf_causal_lm(tmp_path):
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    path = save_tiny(tmp_path / "sg", hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                     norm_placement="simplenorm")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert isinstance(model, SimpleGPTForCausalLM)
    again = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[1, 5, 9, 13, 4]])
    assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
    engine = HFEngine(str(path))
    batch = engine.generate(["1+2=", "34+5="], SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    enc = engine.tokenizer(["1+2="], return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=6, do_sample=False)[0, enc["input_ids"].shape[1]:]
    got = batch.response_ids[0][batch.response_mask[0].bool()]
    assert got.tolist() == ref[:len(got)].tolist()
    with pytest.raises(ValueError, match="norm_placement must be one of"):
        save_tiny(tmp_path / "bad", norm_placement="postnorm")


def test_vllm_is_refused_for_simplegpt_at_start_up():
    from pathlib import Path

    from cluster.pipeline import check_recipe
    from rl import config
    from rl.config import ConfigError
    root = Path(__file__).resolve().parents[2]
    cfg = config.load(root / "recipes/quickstart.yaml", ["model.tiny.norm_placement=simplenorm", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="rollout.engine: vllm has no SimpleGPT"):
        check_recipe(cfg, None)


def test_top_hessian_eigenvalue_of_a_quadratic():
    from rl.curvature import top_hessian_eigenvalue
    A = torch.tensor([[3.0, 1.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, -1.0]])  # eigenvalues 3.618, 1.382, -1
    x = nn.Parameter(torch.tensor([0.3, -0.2, 0.5]))
    eig = top_hessian_eigenvalue(lambda: 0.5 * x @ A @ x + (x ** 3).sum() * 0, [x], iters=50)
    assert eig == pytest.approx((5 + math.sqrt(5)) / 2, rel=1e-4)
