"""The masked-diffusion family (models/diffusion.py): the public LLaDA checkpoint layout, the bidirectional forward,
the MDLM training terms, LLaDA's block sampler."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from models.diffusion import (
    MASK_TOKEN,
    LLaDAConfig,
    LLaDAModelLM,
    build_tiny_llada,
    diffusion_generate,
    mask_for_training,
    num_transfer_tokens,
    rotary,
)
from models.families import MaskedDiffusionFamily, family_for_model_type, masked_token_logp
from models.tiny import build_tiny_tokenizer
from rl.batch import batch_of_examples
from rl.sft_data import prompt_response_example

# GSAI-ML/LLaDA-8B-Base config.json as published (auto_map left out: it names the remote code this class replaces)
PUBLIC_LLADA_8B = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 4096,
    "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
    "layer_norm_with_affine": True, "mask_token_id": 126336, "max_sequence_length": 4096, "mlp_hidden_size": 12288,
    "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 32, "n_kv_heads": 32,
    "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
    "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
    "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 126464, "weight_tying": False,
}


def public_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, read off its config with the OLMo/LLaDA naming."""
    d, ff, vocab = cfg["d_model"], cfg["mlp_hidden_size"], cfg["embedding_size"]
    kv = cfg["n_kv_heads"] * d // cfg["n_heads"]
    out = {"model.transformer.wte.weight": (vocab, d), "model.transformer.ln_f.weight": (d,),
           "model.transformer.ff_out.weight": (vocab, d)}
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        out |= {p + "attn_norm.weight": (d,), p + "ff_norm.weight": (d,), p + "q_proj.weight": (d, d),
                p + "k_proj.weight": (kv, d), p + "v_proj.weight": (kv, d), p + "attn_out.weight": (d, d),
                p + "ff_proj.weight": (ff, d), p + "up_proj.weight": (ff, d), p + "ff_out.weight": (d, ff)}
    return out


def _small_public(**sizes) -> dict:
    return {**PUBLIC_LLADA_8B, "d_model": 32, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2, "mlp_hidden_size": 48,
            "vocab_size": 64, "embedding_size": 64, "mask_token_id": 63, "eos_token_id": 1, "pad_token_id": 1,
            **sizes}


def test_the_8b_config_builds_the_public_layout():
    cfg = AutoConfig.for_model(**PUBLIC_LLADA_8B)
    assert isinstance(cfg, LLaDAConfig) and cfg.hidden_size == 4096 and cfg.num_hidden_layers == 32
    with torch.device("meta"):
        model = AutoModel.from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == public_tensor_shapes(PUBLIC_LLADA_8B)
    assert sum(v.numel() for v in model.parameters()) == pytest.approx(8.0e9, rel=0.01)  # "LLaDA-8B"


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_checkpoint_in_the_public_layout_loads_with_nothing_missing_and_round_trips(tmp_path, kv_heads):
    cfg = _small_public(n_kv_heads=kv_heads)
    torch.manual_seed(0)
    tensors = {k: torch.randn(s) * 0.05 for k, s in public_tensor_shapes(cfg).items()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(model, LLaDAModelLM)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, tensors[k]), k
    assert AutoModelForCausalLM.from_pretrained(tmp_path).state_dict().keys() == tensors.keys()
    model.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    for key in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "mask_token_id", "rope_theta",
                "weight_tying", "block_type"):
        assert saved[key] == cfg[key], key
    assert saved["model_type"] == "llada"
    x = torch.randint(0, 63, (2, 7))
    assert torch.equal(AutoModel.from_pretrained(tmp_path / "again")(x).logits, model(x).logits)


def test_settings_llada_does_not_ship_are_refused_naming_the_field():
    for key, value in (("alibi", True), ("block_type", "sequential"), ("activation_type", "gelu")):
        with pytest.raises(ValueError, match=key):
            LLaDAModelLM(LLaDAConfig(**_small_public(**{key: value})))


def _tiny(seed=0):
    tok = build_tiny_tokenizer(mask_token=True)
    return tok, build_tiny_llada(tok, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, seed=seed).eval()


def test_attention_is_bidirectional_and_left_padding_changes_nothing():
    tok, m = _tiny()
    x = torch.tensor([[5, 6, 7, 8, 9]])
    y = x.clone()
    y[0, 4] = 10
    with torch.no_grad():
        a, b = m(x).logits, m(y).logits
    assert not torch.allclose(a[0, 0], b[0, 0])  # position 0 sees position 4
    padded = torch.tensor([[tok.pad_token_id, tok.pad_token_id, 5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        c = m(padded, attention_mask=mask).logits
    assert torch.allclose(c[0, 2:], a[0], atol=1e-5)


def test_rotary_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    inv = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    emb = torch.cat([pos[..., None] * inv] * 2, -1)
    want = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    got = rotary(q, k, pos, 500000.0)
    assert torch.allclose(got[0], want[0], atol=1e-6) and torch.allclose(got[1], want[1], atol=1e-6)


def test_training_noise_is_seeded_per_row_and_only_masks_response_tokens():
    attn = torch.ones(400, 12, dtype=torch.long)
    attn[:, 9:] = 0
    seeds = torch.arange(400) * 7
    m1, p1 = mask_for_training(attn, seeds)
    m2, p2 = mask_for_training(attn[100:200], seeds[100:200])  # the same rows alone: the same noise
    assert torch.equal(m1[100:200], m2) and torch.equal(p1[100:200], p2)
    assert not m1[:, 9:].any()
    assert ((p1 >= 1e-3) & (p1 <= 1.0)).all()
    # E[p] = 1/2 (t ~ U(0, 1)): about half of the real tokens are masked; each row near its own rate
    assert 0.45 < float(m1[:, :9].float().mean()) < 0.55
    assert float(((m1[:, :9].float().mean(1) - p1).abs()).mean()) < 0.2


def test_the_mdlm_terms_are_log_probabilities_over_the_mask_rate_at_masked_positions():
    tok, m = _tiny()
    b = batch_of_examples([prompt_response_example(tok, "12+3=", "15"), prompt_response_example(tok, "5+5=", "10"),
                           prompt_response_example(tok, "7*8=", "56")], tok.pad_token_id)
    b.set_extra("noise_seed", torch.tensor([11, 12, 13]))
    with torch.no_grad():
        terms = masked_token_logp(m, b)
    masked, rate = mask_for_training(b.response_attn, torch.tensor([11, 12, 13]))
    assert masked.any() and torch.equal(terms != 0, masked)
    noisy = b.response_ids.masked_fill(masked, tok.mask_token_id)
    ids = torch.cat([b.prompt_ids, noisy], 1)
    with torch.no_grad():
        logits = m(ids, attention_mask=torch.cat([b.prompt_mask, b.response_attn], 1)).logits
    P = b.prompt_ids.shape[1]
    want = torch.log_softmax(logits[:, P:], -1).gather(-1, b.response_ids[..., None]).squeeze(-1) / rate[:, None]
    assert torch.allclose(terms[masked], want[masked], atol=1e-5)
    fam = MaskedDiffusionFamily()
    assert family_for_model_type("llada") == "masked_diffusion"
    with pytest.raises(ValueError, match="entropy"):
        fam.forward(m, b, outputs={"logp", "entropy"})
    del b.extras["noise_seed"]  # no seeds: refused, not the row index as seed (the same masks every step)
    with pytest.raises(ValueError, match="needs its per-row noise seeds"):
        masked_token_logp(m, b)


def test_the_transfer_schedule_splits_evenly_with_the_remainder_first():
    assert num_transfer_tokens(torch.tensor([10, 4, 0]), 4).tolist() == [[3, 3, 2, 2], [1, 1, 1, 1], [0, 0, 0, 0]]


def test_block_sampling_commits_each_position_once_most_confident_first_and_block_by_block():
    tok, m = _tiny()
    enc = tok(["12+3=", "5+5="], return_tensors="pt", padding=True)
    out = diffusion_generate(m, enc["input_ids"], enc["attention_mask"], gen_length=8, block_length=4, steps=4,
                             mask_id=tok.mask_token_id, commit_log=True)
    assert out.forwards == 4 and (out.tokens != tok.mask_token_id).all()
    assert (out.commit_step >= 0).all()
    # two blocks of 4 tokens, two steps each: two commits per row per step, block 0 before block 1
    assert [len(e["committed"]) for e in out.log] == [4, 4, 4, 4]
    assert (out.commit_step[:, :4] <= 1).all() and (out.commit_step[:, 4:] >= 2).all()
    # low confidence remasking: what step 0 commits is the argmax at the most confident masked positions
    ids = torch.cat([enc["input_ids"], torch.full((2, 8), tok.mask_token_id)], 1)
    attn = torch.cat([enc["attention_mask"], torch.ones(2, 8, dtype=torch.long)], 1)
    with torch.no_grad():
        probs = torch.softmax(m(ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits, -1)
    P = enc["input_ids"].shape[1]
    conf, best = probs[:, P:P + 4].max(-1)
    for row in range(2):
        first = {(p, t) for r, p, t, _ in out.log[0]["committed"] if r == row}
        top = torch.topk(conf[row], 2).indices.tolist()
        assert first == {(p, int(best[row, p])) for p in top}
    with pytest.raises(ValueError, match="multiple"):
        diffusion_generate(m, enc["input_ids"], enc["attention_mask"], gen_length=8, block_length=3, steps=4,
                           mask_id=tok.mask_token_id)


def test_the_tiny_tokenizer_has_the_mask_token_only_when_asked():
    assert build_tiny_tokenizer(mask_token=True).mask_token == MASK_TOKEN
    plain = build_tiny_tokenizer()
    assert plain.mask_token is None and len(plain) == len(build_tiny_tokenizer(mask_token=True)) - 1
    with pytest.raises(ValueError, match="mask token"):
        build_tiny_llada(plain)


def test_gradient_checkpointing_gives_the_same_gradients():
    tok, m = _tiny()
    m.train()
    x = torch.randint(0, 90, (2, 9))

    def grads():
        m.zero_grad()
        F.cross_entropy(m(x).logits.flatten(0, 1), x.flatten()).backward()
        return [p.grad.clone() for p in m.parameters()]
    plain = grads()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert m.model.gradient_checkpointing  # the blocks now run under activation checkpointing
    again = grads()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, again))


def test_core_spends_one_forward_per_probe_and_remasked_tokens_are_committed_again():
    from models.diffusion import Remasking
    tok, m = _tiny()
    enc = tok(["12+3=", "5+5="], return_tensors="pt", padding=True)
    kw = dict(gen_length=8, block_length=8, steps=8, mask_id=tok.mask_token_id, commit_log=True)
    out = diffusion_generate(m, enc["input_ids"], enc["attention_mask"], revise=Remasking("core", 2, 4, 2), **kw)
    assert out.forwards == 8 + 2 and out.remasked == 2 * 2 * 2  # two probes, two rows, m = 2
    probes = [e for e in out.log if "probe" in e]
    assert [e["step"] for e in probes] == [1, 4]  # floor((i + 1) * 8 / 3) - 1
    for e in probes:
        for row, pos, *_ in e["remasked"]:
            later = [c for c in out.log if "committed" in c and c["step"] > e["step"]
                     and any(r == row and p == pos for r, p, _, _ in c["committed"])]
            assert later  # sent back to the mask, then committed again by the schedule
    assert (out.tokens != tok.mask_token_id).all() and (out.commit_step >= 0).all()
    for policy in ("random", "low_margin"):  # the controls spend no forward
        ctl = diffusion_generate(m, enc["input_ids"], enc["attention_mask"], revise=Remasking(policy, 2, 4, 2), **kw)
        assert ctl.forwards == 8 and ctl.remasked == 8 and (ctl.tokens != tok.mask_token_id).all()
    # blocks of 4 steps: the probe due at step 3, a block's last, runs at step 2 (it used to be skipped silently)
    blocked = diffusion_generate(m, enc["input_ids"], enc["attention_mask"], revise=Remasking("core", 1, 4, 2),
                                 **{**kw, "block_length": 4})
    assert [e["step"] for e in blocked.log if "probe" in e] == [2] and blocked.forwards == 8 + 1
    with pytest.raises(ValueError, match="need at least 2 denoising steps per block"):
        Remasking("core", 1, 4, 2).probe_steps(8, per_block=1)
    with pytest.raises(ValueError, match="3 probes do not fit on distinct steps"):
        Remasking("core", 3, 4, 2).probe_steps(4, per_block=2)
    with pytest.raises(ValueError, match="policy"):
        Remasking("remdm")


def test_the_core_score_is_the_drop_in_support_when_the_candidates_are_masked_together():
    from models.diffusion import Remasking, _revise
    tok, m = _tiny(seed=3)
    mask_id = tok.mask_token_id
    prompt = tok(["47+38="], return_tensors="pt")["input_ids"]
    P = prompt.shape[1]
    x = torch.cat([prompt, torch.tensor([[5, 9, 7, mask_id, mask_id, mask_id]])], 1)
    attn = torch.ones_like(x)
    pos_ids = torch.arange(x.shape[1])[None]
    logp = torch.tensor([[-0.1, -2.0, -0.5, 0.0, 0.0, 0.0]])
    margin = torch.tensor([[0.9, 0.1, 0.2, 0.0, 0.0, 0.0]])
    events, used = _revise(m, x, attn, pos_ids, P, (P, x.shape[1]), logp, margin, mask_id,
                           Remasking("core", 1, candidates=2, m=1, score="commit"), None)
    assert used == 1
    # candidates: the two committed tokens of lowest margin (response positions 1 and 2), masked together
    probe = x.clone()
    probe[0, P + 1], probe[0, P + 2] = mask_id, mask_id
    with torch.no_grad():
        lp = torch.log_softmax(m(probe, attention_mask=attn, position_ids=pos_ids).logits.float(), -1)[0]
    scores = {1: -2.0 - float(lp[P + 1, 9]), 2: -0.5 - float(lp[P + 2, 7])}
    best = max(scores, key=scores.get)
    assert len(events) == 1 and events[0][:3] == [0, best, int(x[0, P + best])]
    assert events[0][3] == pytest.approx(scores[best], abs=1e-5)
    low, _ = _revise(m, x, attn, pos_ids, P, (P, x.shape[1]), logp, margin, mask_id,
                     Remasking("low_margin", 1, candidates=2, m=1), None)
    assert low[0][1] == 1  # the lowest margin
    # the spec's score: the support in the current state (its forward's logits, the candidates visible) minus the
    # support with the candidates masked together
    with torch.no_grad():
        state_logits = m(x, attention_mask=attn, position_ids=pos_ids).logits.float()
    now = torch.log_softmax(state_logits, -1)[0]
    state_scores = {i: float(now[P + i, x[0, P + i]] - lp[P + i, x[0, P + i]]) for i in (1, 2)}
    top = max(state_scores, key=state_scores.get)
    events, used = _revise(m, x, attn, pos_ids, P, (P, x.shape[1]), logp, margin, mask_id,
                           Remasking("core", 1, candidates=2, m=1), None, state_logits=state_logits)
    assert used == 1 and events[0][1] == top and events[0][3] == pytest.approx(state_scores[top], abs=1e-5)
    assert Remasking("core").score == "state"  # the spec's reading by default
    with pytest.raises(ValueError, match="score"):
        Remasking("core", score="margin")


def test_the_margin_is_the_chosen_probability_minus_the_largest_other():
    from models.diffusion import _margin
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    assert _margin(probs, torch.tensor([0, 2])).tolist() == pytest.approx([0.2, -0.3])


def test_a_remasked_token_is_masked_again_forgotten_and_owed_to_the_next_step():
    from models.diffusion import _remask
    P, mask_id = 2, 99
    x = torch.tensor([[1, 2, 5, 6, 7], [1, 2, 8, 9, 4]])
    logp, margin = torch.full((2, 3), -0.5), torch.full((2, 3), 0.4)
    commit_step, debt = torch.full((2, 3), 3), torch.zeros(2, dtype=torch.long)
    _remask([[0, 1, 6, 0.3], [1, 0, 8, 0.2], [1, 2, 4, 0.1]], x, logp, margin, commit_step, debt, P, mask_id)
    assert x.tolist() == [[1, 2, 5, 99, 7], [1, 2, 99, 9, 99]]
    assert logp.tolist() == [[-0.5, 0.0, -0.5], [0.0, -0.5, 0.0]]
    assert margin.tolist() == [[pytest.approx(0.4), 0.0, pytest.approx(0.4)], [0.0, pytest.approx(0.4), 0.0]]
    assert commit_step.tolist() == [[3, -1, 3], [-1, 3, -1]] and debt.tolist() == [1, 2]


def test_remasking_settings_out_of_range_are_refused_one_by_one():
    from models.diffusion import Remasking
    for bad in ({"probes": -1}, {"m": 0}, {"candidates": 0}, {"perturb_frac": 1.0}, {"perturb_frac": -0.1}):
        with pytest.raises(ValueError, match=r"probes >= 0, m >= 1, candidates >= 1, 0 <= perturb_frac < 1"):
            Remasking("core", **{"probes": 1, **bad})
    Remasking("core", probes=0, m=1, candidates=1, perturb_frac=0.99)  # the edges themselves are allowed
    assert Remasking("none", probes=2).probe_steps(8) == set() and Remasking("core", probes=0).probe_steps(8) == set()
    assert Remasking("low_margin", probes=1).probe_steps(8) == {3}


def test_block_sampling_logs_its_blocks_and_the_log_probabilities_it_committed_with():
    tok, m = _tiny()
    enc = tok(["12+3=", "5+5="], return_tensors="pt", padding=True)
    out = diffusion_generate(m, enc["input_ids"], enc["attention_mask"], gen_length=8, block_length=4, steps=4,
                             mask_id=tok.mask_token_id, commit_log=True)
    assert [e["block"] for e in out.log] == [0, 0, 1, 1] and [e["step"] for e in out.log] == [0, 1, 2, 3]
    ids = torch.cat([enc["input_ids"], torch.full((2, 8), tok.mask_token_id)], 1)
    attn = torch.cat([enc["attention_mask"], torch.ones(2, 8, dtype=torch.long)], 1)
    with torch.no_grad():
        logits = m(ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits.float(), -1)
    P = enc["input_ids"].shape[1]
    for row, pos, token, confidence in out.log[0]["committed"]:
        assert float(out.logp[row, pos]) == pytest.approx(float(logp[row, P + pos, token]), abs=1e-5)
        assert confidence == pytest.approx(float(logp[row, P + pos, token].exp()), abs=1e-5)


def test_a_row_samples_and_probes_alike_alone_and_beside_a_longer_prompt():
    """Left padding is masked in every forward, the CORE probe's included: a row's tokens, log-probabilities and
    probe scores do not depend on the rows beside it."""
    from models.diffusion import Remasking
    tok, m = _tiny(seed=1)
    kw = dict(gen_length=8, block_length=4, steps=8, mask_id=tok.mask_token_id, commit_log=True,
              revise=Remasking("core", 2, 4, 2))
    both = tok(["123+456=", "5+5="], return_tensors="pt", padding=True)
    alone = tok(["5+5="], return_tensors="pt")
    assert (both["attention_mask"][1] == 0).sum() == 4
    a = diffusion_generate(m, both["input_ids"], both["attention_mask"], **kw)
    b = diffusion_generate(m, alone["input_ids"], alone["attention_mask"], **kw)
    assert torch.equal(a.tokens[1], b.tokens[0]) and torch.allclose(a.logp[1], b.logp[0], atol=1e-5)
    probes_a = [[ev for ev in e["remasked"] if ev[0] == 1] for e in a.log if "probe" in e]
    probes_b = [e["remasked"] for e in b.log if "probe" in e]
    assert len(probes_b) == 2 and all(len(p) == 2 for p in probes_b)
    for pa, pb in zip(probes_a, probes_b):
        assert [ev[1:3] for ev in pa] == [ev[1:3] for ev in pb]
        assert [ev[3] for ev in pa] == pytest.approx([ev[3] for ev in pb], abs=1e-4)
    # the reconstruction's score reads the log-probabilities the sampler committed with
    commit = diffusion_generate(m, alone["input_ids"], alone["attention_mask"],
                                **{**kw, "revise": Remasking("core", 2, 4, 2, score="commit")})
    assert commit.forwards == 8 + 2 and commit.remasked == 4 and (commit.tokens != tok.mask_token_id).all()


def test_sampling_and_random_remasking_draw_from_the_given_generator_alone():
    from models.diffusion import Remasking
    tok, m = _tiny()
    enc = tok(["12+3=", "5+5="], return_tensors="pt", padding=True)
    kw = dict(gen_length=8, block_length=8, steps=8, mask_id=tok.mask_token_id, commit_log=True, temperature=0.9,
              revise=Remasking("random", 3, 6, 2))
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)  # the process's own stream differs between the runs
        runs.append(diffusion_generate(m, enc["input_ids"], enc["attention_mask"],
                                       generator=torch.Generator().manual_seed(7), **kw))
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert [e.get("remasked") for e in runs[0].log] == [e.get("remasked") for e in runs[1].log]


def test_probes_look_back_one_block_only():
    """A probe's candidates are the committed tokens of its own block and the one before, never earlier ones."""
    from models.diffusion import Remasking
    tok, m = _tiny(seed=2)
    enc = tok(["12+3=", "5+5="], return_tensors="pt", padding=True)
    out = diffusion_generate(m, enc["input_ids"], enc["attention_mask"], gen_length=12, block_length=4, steps=12,
                             mask_id=tok.mask_token_id, commit_log=True, revise=Remasking("low_margin", 5, 16, 6))
    probes = [e for e in out.log if "probe" in e]
    late = [e for e in probes if e["step"] >= 8]  # in the third block
    assert late and all(4 <= pos < 12 for e in late for _, pos, *_ in e["remasked"])
    assert any(pos < 8 for e in late for _, pos, *_ in e["remasked"])  # the previous block is a candidate


def _probe_case():
    """Two rows after the prompt "47+38=": row 0 with five committed response tokens and one mask, row 1 with one
    committed token; margins chosen so that row 0's candidates are its positions 1 and 2."""
    tok, m = _tiny(seed=3)
    mask_id = tok.mask_token_id
    prompt = tok(["47+38=", "47+38="], return_tensors="pt")["input_ids"]
    x = torch.cat([prompt, torch.tensor([[5, 9, 7, 4, 6, mask_id], [8, mask_id, mask_id, mask_id, mask_id, mask_id]])],
                  1)
    logp = torch.tensor([[-0.1, -2.0, -0.5, -0.3, -0.2, 0.0], [-0.7, 0.0, 0.0, 0.0, 0.0, 0.0]])
    margin = torch.tensor([[0.9, 0.1, 0.2, 0.8, 0.7, 0.0], [0.3, 0.0, 0.0, 0.0, 0.0, 0.0]])
    return m, mask_id, prompt.shape[1], x, logp, margin


def test_a_perturbed_probe_also_masks_the_other_committed_tokens_the_generator_picks():
    from models.diffusion import Remasking, _revise
    m, mask_id, P, x, logp, margin = _probe_case()
    attn, pos_ids = torch.ones_like(x), torch.arange(x.shape[1])[None].expand(2, -1)
    # a seed whose draws for row 0's three other committed tokens (response positions 0, 3, 4) pick some, not all
    seed = next(s for s in range(100) if 0 < (torch.rand(3, generator=torch.Generator().manual_seed(s)) < 0.5).sum() < 3)
    torch.manual_seed(seed + 1)  # the process's own stream is not what picks
    events, used = _revise(m, x, attn, pos_ids, P, (P, x.shape[1]), logp, margin, mask_id,
                           Remasking("core", 1, candidates=2, m=2, perturb_frac=0.5, score="commit"),
                           torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    probe = x.clone()
    probe[0, [P + 1, P + 2]] = mask_id
    others = torch.tensor([P, P + 3, P + 4])
    probe[0, others[torch.rand(3, generator=g) < 0.5]] = mask_id
    probe[1, P] = mask_id  # row 1's only committed token is its candidate; nothing else to perturb
    with torch.no_grad():
        lp = torch.log_softmax(m(probe, attention_mask=attn, position_ids=pos_ids).logits.float(), -1)
    want = {(0, i): float(logp[0, i] - lp[0, P + i, x[0, P + i]]) for i in (1, 2)}
    want[(1, 0)] = float(logp[1, 0] - lp[1, P, x[1, P]])
    assert used == 1 and {(r, p): s for r, p, _, s in events} == pytest.approx(want, abs=1e-5)


def test_an_unperturbed_probe_draws_nothing_and_rows_without_candidates_are_passed_over():
    from models.diffusion import Remasking, _revise
    m, mask_id, P, x, logp, margin = _probe_case()
    attn, pos_ids = torch.ones_like(x), torch.arange(x.shape[1])[None].expand(2, -1)
    g = torch.Generator().manual_seed(5)
    before = g.get_state()
    _revise(m, x, attn, pos_ids, P, (P, x.shape[1]), logp, margin, mask_id,
            Remasking("core", 1, candidates=2, m=1, score="commit"), g)
    assert torch.equal(g.get_state(), before)  # later sampling draws what it would without the probe
    # row 0 all masked in the window: row 1 (one candidate) is still revised
    y = x.flip(0)
    events, _ = _revise(m, y, attn, pos_ids, P, (P + 1, x.shape[1]), logp.flip(0), margin.flip(0), mask_id,
                        Remasking("low_margin", 1, candidates=2, m=1), None)
    assert [e[:2] for e in events] == [[1, 1]]
    events, _ = _revise(m, x, attn, pos_ids, P, (P, x.shape[1]), logp, margin, mask_id,
                        Remasking("low_margin", 1, candidates=2, m=1), None)
    assert [e[:2] for e in events] == [[0, 1], [1, 0]]  # a row with one committed token has one candidate
    with pytest.raises(ValueError, match="^remasking score 'state' needs the current state's logits$"):
        _revise(m, x, attn, pos_ids, P, (P, x.shape[1]), logp, margin, mask_id, Remasking("core", 1), None)
