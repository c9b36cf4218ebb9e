"""OuroForCausalLM: checkpoint format (Appendix A of the RLTT spec), the looped forward against a direct
re-computation, per-loop logprobs, KV cache per (loop, layer), gradient checkpointing."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from models.ouro import OuroConfig, OuroForCausalLM, build_tiny_ouro, exit_pdf
from models.tiny import build_tiny_tokenizer

H, L, HEADS, FF, T = 32, 2, 4, 48, 3


def _model(tied=False, seed=0):
    return build_tiny_ouro(build_tiny_tokenizer(), hidden_size=H, num_layers=L, num_heads=HEADS,
                           intermediate_size=FF, total_ut_steps=T, tie_word_embeddings=tied, seed=seed).eval()


def _public_names(num_layers):
    names = {"model.embed_tokens.weight", "model.norm.weight", "model.early_exit_gate.weight",
             "model.early_exit_gate.bias", "lm_head.weight"}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj")}
        names |= {p + f"mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")}
        names |= {p + f"{x}.weight" for x in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                                               "post_attention_layernorm_2")}
    return names


def test_parameter_names_and_shapes_match_the_public_format():
    m = _model()
    sd = m.state_dict()
    assert set(sd) == _public_names(L)
    v = m.config.vocab_size
    assert sd["model.early_exit_gate.weight"].shape == (1, H) and sd["model.early_exit_gate.bias"].shape == (1,)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (H, H)
    assert sd["model.layers.1.mlp.down_proj.weight"].shape == (H, FF)
    assert sd["lm_head.weight"].shape == (v, H) and sd["model.embed_tokens.weight"].shape == (v, H)


def test_loads_a_public_format_folder_with_no_missing_or_unexpected_keys(tmp_path):
    # a checkpoint folder as the public Ouro releases ship it: their config fields, remote-code auto_map,
    # safetensors with exactly the Appendix-A names (written here without our model class)
    g = torch.Generator().manual_seed(1)
    vocab = 61
    shapes = {"model.embed_tokens.weight": (vocab, H), "model.norm.weight": (H,), "lm_head.weight": (vocab, H),
              "model.early_exit_gate.weight": (1, H), "model.early_exit_gate.bias": (1,)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + f"self_attn.{x}.weight": (H, H) for x in ("q_proj", "k_proj", "v_proj", "o_proj")})
        shapes.update({p + "mlp.gate_proj.weight": (FF, H), p + "mlp.up_proj.weight": (FF, H),
                       p + "mlp.down_proj.weight": (H, FF)})
        shapes.update({p + f"{x}.weight": (H,) for x in ("input_layernorm", "input_layernorm_2",
                                                          "post_attention_layernorm", "post_attention_layernorm_2")})
    assert set(shapes) == _public_names(L)
    weights = {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["OuroForCausalLM"], "model_type": "ouro",
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": L, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "vocab_size": vocab, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "hidden_act": "silu", "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * L, "sliding_window": None, "tie_word_embeddings": False,
        "use_cache": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "total_ut_steps": T,
        "early_exit_threshold": 1.0, "torch_dtype": "float32"}))
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(model, OuroForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert AutoConfig.from_pretrained(tmp_path).total_ut_steps == T


@pytest.mark.parametrize("tied", [False, True])
def test_save_and_load_round_trip(tmp_path, tied):
    m = _model(tied)
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "ouro" and cfg["architectures"] == ["OuroForCausalLM"]
    assert cfg["total_ut_steps"] == T and cfg["tie_word_embeddings"] is tied
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(torch.equal(back.state_dict()[k], v) for k, v in m.state_dict().items())
    ids = torch.tensor([[5, 9, 17, 3, 22]])
    with torch.no_grad():  # nothing left uninitialised by loading (e.g. RoPE frequencies)
        assert torch.equal(back.eval()(ids).logits, m(ids).logits)
    if tied:
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_forward(m: OuroForCausalLM, ids: torch.Tensor):
    """Direct step-by-step re-computation from the state dict: embeddings once; per loop every layer
    (sandwich norms, RoPE attention, SwiGLU), then the final norm, whose output feeds the next loop."""
    sd, cfg = m.state_dict(), m.config
    s, d = ids.shape[1], cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(s).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):  # x [B, heads, S, d]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = sd["model.embed_tokens.weight"][ids]
    states, gates = [], []
    for _ in range(cfg.total_ut_steps):
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = _rms(h, sd[p + "input_layernorm.weight"])
            heads = [(x @ sd[p + f"self_attn.{n}_proj.weight"].T).view(1, s, HEADS, d).transpose(1, 2) for n in "qkv"]
            q, k, v = rope(heads[0]), rope(heads[1]), heads[2]
            att = (q @ k.transpose(-1, -2)) / d ** 0.5
            att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            a = (att @ v).transpose(1, 2).reshape(1, s, -1) @ sd[p + "self_attn.o_proj.weight"].T
            h = h + _rms(a, sd[p + "input_layernorm_2.weight"])
            x = _rms(h, sd[p + "post_attention_layernorm.weight"])
            f = (F.silu(x @ sd[p + "mlp.gate_proj.weight"].T) * (x @ sd[p + "mlp.up_proj.weight"].T))
            h = h + _rms(f @ sd[p + "mlp.down_proj.weight"].T, sd[p + "post_attention_layernorm_2.weight"])
        h = _rms(h, sd["model.norm.weight"])
        states.append(h)
        gates.append(h @ sd["model.early_exit_gate.weight"].T + sd["model.early_exit_gate.bias"])
    return states, torch.cat(gates, -1), [st @ sd["lm_head.weight"].T for st in states]


def test_looped_forward_matches_a_direct_recomputation():
    m = _model()
    ids = torch.tensor([[5, 9, 17, 3, 22, 40, 8]])
    states, gates, logits = _reference_forward(m, ids)
    with torch.no_grad():
        got_states, got_gates = m.loop_states(ids)
        assert len(got_states) == T
        for a, b in zip(got_states, states):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_gates, gates, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m(ids).logits, logits[-1], atol=1e-5, rtol=1e-5)  # sampling: last loop
        for t in range(1, T + 1):  # exit_at_step t runs t loops and reads out loop t
            torch.testing.assert_close(m(ids, exit_at_step=t).logits, logits[t - 1], atol=1e-5, rtol=1e-5)
        labels = torch.roll(ids, -1, 1)
        per_loop = m.loop_token_logprobs(got_states, labels, temperature=0.7, chunk_size=3)
        expect = torch.stack([torch.log_softmax(lg / 0.7, -1).gather(-1, labels[..., None]).squeeze(-1)
                              for lg in logits], -1)
        assert per_loop.shape == (1, 7, T)
        torch.testing.assert_close(per_loop, expect, atol=1e-5, rtol=1e-5)
    assert exit_pdf(gates).sum(-1).allclose(torch.ones(1, 7))


def test_chunked_loop_logprobs_give_the_same_gradients():
    m = _model()
    ids = torch.randint(6, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    grads = []
    for chunk in (2, 64):
        m.zero_grad()
        states, gates = m.loop_states(ids)
        (m.loop_token_logprobs(states, labels, 1.0, chunk_size=chunk) * exit_pdf(gates)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5)
    assert grads[0]["model.early_exit_gate.weight"].abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(6, 60, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for ckpt in (False, True):
        m = _model().train()
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert m.model.gradient_checkpointing
        states, _ = m.loop_states(ids)
        m.loop_token_logprobs(states, torch.roll(ids, -1, 1)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert len(grads[0]) == len(grads[1]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5)


def test_generate_with_the_loop_cache_equals_recomputing_everything():
    tok = build_tiny_tokenizer()
    m = _model()
    m.generation_config.eos_token_id = None  # run the full length
    enc = tok(["1+2=", "12+34=", "7"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = m.generate(**enc, max_new_tokens=10, do_sample=False)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        for _ in range(10):
            nxt = m(ids, attention_mask=mask, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    assert torch.equal(out, ids)


def test_config_defaults_are_ouro_1_4b():
    c = OuroConfig()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size, c.vocab_size,
            c.total_ut_steps, c.early_exit_threshold) == (2048, 24, 16, 5632, 49152, 4, 1.0)


def test_a_config_without_special_tokens_builds_and_import_models_registers_the_type(tmp_path):
    tiny = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                total_ut_steps=2)
    model = OuroForCausalLM(OuroConfig(**tiny))  # no pad_token_id given, as with transformers' own configs
    assert model.config.pad_token_id is None
    assert OuroConfig(pad_token_id=3, **tiny).pad_token_id == 3
    model.save_pretrained(tmp_path)
    # a fresh interpreter that imports the package only (not models.ouro) reloads it with the Auto classes
    code = ("import models, sys; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}); print(type(m).__name__)")
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "OuroForCausalLM"
