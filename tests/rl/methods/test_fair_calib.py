"""FAIR-Calib (rl/methods/fair_calib/core.py) and the fake quantizer (models/quant.py): the prior's accumulation by hand, its
window and floor, the quantizer against compressed-tensors, block calibration, the save format (spec:
rl/methods/fair_calib/README.md)."""

import pytest
import torch

from models.diffusion import build_tiny_llada
from models.quant import (
    FakeQuantLinear,
    fake_quant,
    flatten_input,
    flatten_weight,
    kron_factors,
    load_fake_quant,
    quantize_blocks,
    quantized_modules,
    save_fake_quant,
)
from models.tiny import build_tiny_tokenizer
from rl.methods.fair_calib.core import (
    accumulate_prior,
    calibrate_blocks,
    early_boost,
    lag_ccdf,
    lags_from_agreement,
    position_weights,
    probe_prior,
    stability_lags,
    trajectory_diagnostics,
    window_floor,
    window_prior,
)


def test_the_prior_accumulates_frontier_hits_and_masked_stage_reliability_by_hand():
    commits = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.bool)  # step t commits position ...
    masked = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 1]], dtype=torch.bool)  # masked when step t starts
    rel = torch.tensor([[0.5, 1.0, 0.2], [1.0, 0.0, 0.4], [0.0, 0.0, 1.0]])
    w = accumulate_prior(commits, masked, rel, beta=1.0, lambda1=1.0)
    # lambda0 = 2, 5/3, 4/3 at t = 0, 1, 2
    assert w.tolist() == pytest.approx([5 / 3 + 0.5 + 1.0, 2.0 + 1.0, 4 / 3 + 0.2 + 0.4 + 1.0])
    assert accumulate_prior(commits, masked, rel, masked_stage=False).tolist() == pytest.approx([5 / 3, 2.0, 4 / 3])
    assert accumulate_prior(commits, masked, rel, frontier=False).tolist() == pytest.approx([1.5, 1.0, 1.6])
    boosts = [early_boost(t, 10) for t in range(11)]
    assert all(a >= b for a, b in zip(boosts, boosts[1:])) and boosts[0] == 2.0 and boosts[-1] == 1.0


def test_the_window_sums_to_one_and_the_floor_holds_outside_it():
    w = window_prior(torch.tensor([5.0, 1.0, 2.0, 3.0, 4.0]), window=3, floor_frac=0.01)
    assert float(w[-3:].sum()) == pytest.approx(1.0)
    assert w[:2].tolist() == pytest.approx([0.01 / 3] * 2)  # 0.01 x the mean of the window's weights
    assert w[-3:].tolist() == pytest.approx([2 / 9, 3 / 9, 4 / 9])
    full = window_prior(torch.tensor([1.0, 3.0]), window=8)
    assert full.tolist() == pytest.approx([0.25, 0.75])


def test_prompt_tokens_take_the_floor_that_floor_frac_sets_when_the_generation_fits_the_window():
    # a 4-token generation inside a 256-position window: no generation position lies outside the window, so only
    # the floor argument can carry floor_frac to the prompt tokens
    raw = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    start = torch.tensor([2, 3])
    rows = {}
    for frac in (0.01, 0.5):
        prior = window_prior(raw, 256, frac)
        assert prior.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])  # the window holds every position
        rows[frac] = position_weights(mask, start, prior, window_floor(prior, 256, frac))
    # floor = floor_frac x mean of the window's weights = floor_frac / 4
    assert rows[0.01][0].tolist() == pytest.approx([0.0025, 0.0025, 0.1, 0.2, 0.3, 0.4, 0.0])
    assert rows[0.5][1].tolist() == pytest.approx([0.125, 0.125, 0.125, 0.1, 0.2, 0.3, 0.4])
    assert window_floor(window_prior(torch.ones(6), 4, 0.5), 4, 0.5) == pytest.approx(0.125)  # window of the last 4
    with pytest.raises(ValueError, match="^position_weights: a prior needs its floor"):
        position_weights(mask, start, window_prior(raw, 256))


def test_stage_two_minimises_the_prior_weighted_hidden_state_error_by_hand():
    """The loss calibrate_blocks reports before training equals Σ_i w_i ‖h^q_i − h*_i‖² / Σ_i w_i computed here from
    the two models' block outputs: a uniform (or unweighted) block MSE gives another number with these weights."""
    import copy

    from models.blocks import block_outputs
    tok, fp = _tiny()
    quant = copy.deepcopy(fp)
    quantize_blocks(quant, 4, 4)
    enc = tok(["12+34=0046", "51+6=0057"], return_tensors="pt", padding=True, padding_side="right")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    with torch.no_grad():
        err = (block_outputs(quant, batch, 0)[0].float() - block_outputs(fp, batch, 0)[0].float()).pow(2).sum(-1)
    real = enc["attention_mask"].bool()
    worst, best = int(torch.where(real, err, -1.0).argmax()), int(torch.where(real, err, torch.inf).argmin())
    w = torch.zeros(err.shape)
    w.view(-1)[worst], w.view(-1)[best] = 0.3, 0.1  # the positions quantized worst and best (weights sum < 1)
    by_hand = float((0.3 * err.view(-1)[worst] + 0.1 * err.view(-1)[best]) / 0.4)
    uniform = float(err[real].mean())
    assert abs(by_hand - uniform) > 0.05 * by_hand  # the weights matter for this check
    history = calibrate_blocks(fp, quant, [batch], [w], epochs=0)
    assert history[0]["loss_before"] == pytest.approx(by_hand, rel=1e-5)


def test_the_stage_quantizes_a_bfloat16_model_on_its_device(tmp_path):
    from rl.methods.fair_calib.stage import quantize_model
    tok, fp = _tiny()
    fp.save_pretrained(tmp_path / "fp")
    tok.save_pretrained(tmp_path / "fp")
    calib = [(tok(q)["input_ids"], tok(a)["input_ids"]) for q, a in [("12+34=", "046"), ("5+6=", "011")] * 2]
    report = quantize_model(str(tmp_path / "fp"), str(tmp_path / "q"), calib, [c[0] for c in calib[:2]],
                            tok.pad_token_id, tok.mask_token_id, w_bits=4, a_bits=4, weighting="fair", probes=2,
                            window=256, floor_frac=0.5, beta=1.0, lambda1=1.0, gen_length=3, block_length=3, steps=3,
                            epochs=2, lr=1e-2, batch_size=2, seed=0, dtype="bfloat16")
    assert report["dtype"] == "bfloat16" and report["device"] == "cpu"
    assert report["prior_floor"] == pytest.approx(0.5 / 3)  # floor_frac x the mean of a 3-position window
    assert all(b["loss_after"] <= b["loss_before"] for b in report["blocks"])
    import json
    assert json.loads((tmp_path / "q" / "config.json").read_text())["dtype"] == "bfloat16"  # saved as it ran
    assert set(report["calibrated"]) >= {"frontier_flip_rate", "trajectory_kl"}


def test_the_quantizer_rounds_as_compressed_tensors_does():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    torch.manual_seed(0)
    w, x = torch.randn(6, 16), torch.randn(3, 5, 16)
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="channel")
    mx = w.abs().amax(1, keepdim=True)
    scale, zp = calculate_qparams(-mx, mx, args)
    assert torch.allclose(fake_quant(w, mx, 4), fake_quantize(w, scale, zp, args), atol=1e-6)
    tok_args = QuantizationArgs(num_bits=4, symmetric=True, strategy="token", dynamic=True)
    amx = x.abs().amax(-1, keepdim=True)
    scale, zp = calculate_qparams(-amx, amx, tok_args)
    assert torch.allclose(fake_quant(x, amx, 4), fake_quantize(x, scale, zp, tok_args), atol=1e-6)
    assert len(torch.unique(fake_quant(w, mx, 4)[0])) <= 16  # 4 bits


def test_calibration_gradients_reach_the_clipping_ratios():
    torch.manual_seed(0)
    lin = FakeQuantLinear(torch.nn.Linear(16, 8), 4, 4)
    out = lin(torch.randn(4, 16))
    (out - torch.randn_like(out)).pow(2).mean().backward()
    assert lin.w_clip.grad.abs().sum() > 0 and lin.a_clip.grad.abs().sum() > 0
    assert lin.linear.weight.grad is None  # the full-precision weights stay frozen


def test_the_flattening_is_the_kronecker_product_and_keeps_the_layer_exact_before_rounding():
    assert kron_factors(16) == (4, 4) and kron_factors(24) == (4, 6) and kron_factors(7) == (1, 7)
    torch.manual_seed(0)
    p1, p2 = torch.eye(4) + 0.3 * torch.randn(4, 4), torch.eye(6) + 0.3 * torch.randn(6, 6)
    x, w = torch.randn(5, 24, dtype=torch.float64), torch.randn(3, 24, dtype=torch.float64)
    p1, p2 = p1.double(), p2.double()
    assert torch.allclose(flatten_input(x, p1, p2), x @ torch.kron(p1, p2))
    assert torch.allclose(flatten_weight(w, p1, p2), w @ torch.linalg.inv(torch.kron(p1, p2)).T)
    assert torch.allclose(flatten_input(x, p1, p2) @ flatten_weight(w, p1, p2).T, x @ w.T)
    lin = torch.nn.Linear(24, 3)
    x32 = torch.randn(5, 24)
    with torch.no_grad():  # at the identity it is the plain quantizer
        assert torch.equal(FakeQuantLinear(lin, 4, 4, "kron")(x32), FakeQuantLinear(lin, 4, 4)(x32))


def test_a_learned_flattening_spreads_an_outlier_channel_that_clipping_alone_cannot_fix():
    """FlatQuant's point on one layer: with one input channel 30x the others, per-token 4-bit activations lose
    every other channel; trained on the layer's output error, the transform cuts it where the clipping ratios
    alone do not."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(256, 16)
    x[:, 3] *= 30
    target = lin(x).detach()
    errors = {}
    for transform in ("none", "kron"):
        q = FakeQuantLinear(lin, 4, 4, transform)
        start = float((q(x) - target).pow(2).mean().detach())
        opt = torch.optim.AdamW(q.quantizer_parameters().values(), lr=1e-2, weight_decay=0.0)
        for _ in range(200):
            loss = (q(x) - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        errors[transform] = float((q(x) - target).pow(2).mean().detach())
    assert errors["kron"] < 0.25 * start and errors["kron"] < 0.25 * errors["none"]


def test_a_flattened_model_saves_and_reloads_with_its_transforms(tmp_path):
    import copy
    tok, fp = _tiny()
    quant = copy.deepcopy(fp)
    mods = quantize_blocks(quant, 4, 4, "kron")
    torch.manual_seed(1)
    with torch.no_grad():
        for m in mods.values():
            m.p1.add_(0.1 * torch.randn_like(m.p1))
    tok.save_pretrained(tmp_path / "q")
    save_fake_quant(quant, tmp_path / "q")
    loaded = load_fake_quant(copy.deepcopy(fp), tmp_path / "q")
    assert all(m.transform == "kron" for m in quantized_modules(loaded).values())
    batch = tok(["12+34=0046"], return_tensors="pt")
    plain = copy.deepcopy(fp)
    quantize_blocks(plain, 4, 4)
    with torch.no_grad():
        assert torch.allclose(loaded(**batch).logits, quant(**batch).logits, atol=1e-5)
        # the perturbed transforms came back: not the plain quantizer's output
        assert not torch.allclose(loaded(**batch).logits, plain(**batch).logits, atol=1e-4)


def _tiny():
    tok = build_tiny_tokenizer(mask_token=True)
    return tok, build_tiny_llada(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64).eval()


def test_the_frontier_prior_spends_the_early_boost_on_each_commit_once():
    tok, m = _tiny()
    enc = tok(["12+34=", "5+6="], return_tensors="pt", padding=True)
    w = probe_prior(m, enc["input_ids"], enc["attention_mask"], mask_id=tok.mask_token_id, gen_length=6, steps=3,
                    probes=4, masked_stage=False)
    # every rollout commits 2 positions at each of the 3 steps: sum of weights = 2 x (2 + 5/3 + 4/3)
    assert float(w.sum()) == pytest.approx(2 * (2 + 5 / 3 + 4 / 3)) and (w > 0).all()
    both = probe_prior(m, enc["input_ids"], enc["attention_mask"], mask_id=tok.mask_token_id, gen_length=6, steps=3,
                       probes=4)
    assert (both > w).all()  # the masked-stage term adds to every position that waits


def test_block_calibration_lowers_the_weighted_error_and_the_model_saves_and_reloads(tmp_path):
    import copy

    from rollout.hf_engine import HFEngine
    tok, fp = _tiny()
    quant = copy.deepcopy(fp)
    mods = quantize_blocks(quant, 4, 4)
    assert len(mods) == 2 * 7
    enc = tok(["12+34=0046", "51+6=0057", "7+80=0087"], return_tensors="pt", padding=True, padding_side="right")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    prior = window_prior(torch.rand(4), 4)
    weights = [position_weights(enc["attention_mask"], torch.tensor([6, 5, 5]), prior, window_floor(prior, 4, 0.01))]
    assert weights[0][0, 6:10].sum() == pytest.approx(1.0, abs=1e-5)
    history = calibrate_blocks(fp, quant, [batch], weights, epochs=5, lr=2e-2)
    assert all(h["loss_after"] <= h["loss_before"] for h in history) and history[0]["loss_after"] < history[0]["loss_before"]
    diag = trajectory_diagnostics(fp, quant, enc["input_ids"][:, :5], enc["attention_mask"][:, :5],
                                  mask_id=tok.mask_token_id, gen_length=4, block_length=4, steps=4)
    assert 0 <= diag["frontier_flip_rate"] <= 1 and diag["trajectory_kl"] >= 0
    ccdf = diag["stability_lag_ccdf"]  # P(δ_lag >= d): 1 at d = 0, non-increasing, lags within the 4 steps
    assert ccdf[0] == 1.0 and all(a >= b for a, b in zip(ccdf, ccdf[1:])) and len(ccdf) <= 5
    assert 0 <= diag["stability_lag_censored"] <= 1 and diag["stability_lag_mean"] == pytest.approx(sum(ccdf[1:]))
    tok.save_pretrained(tmp_path / "q")
    save_fake_quant(quant, tmp_path / "q", extra={"weighting": "fair"})
    assert quantized_modules(quant)  # still quantized after saving
    engine = HFEngine(str(tmp_path / "q"))
    assert sorted(quantized_modules(engine.model)) == sorted(mods)
    with torch.no_grad():
        assert torch.allclose(engine.model(**batch).logits, quant(**batch).logits, atol=1e-5)
    with torch.no_grad():  # and it differs from the full-precision model
        assert not torch.allclose(fp(**batch).logits, quant(**batch).logits, atol=1e-3)
    plain = load_fake_quant(copy.deepcopy(fp), tmp_path)  # no fake_quant.json there: unchanged
    assert not quantized_modules(plain)


def test_the_stability_lag_counts_the_steps_from_commit_until_the_prediction_agrees_for_good_by_hand():
    # one row, 3 positions, 4 steps; agree[t, 0, i]: the top-1 for position i after step t is its final token
    agree = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)[:, None, :]
    commit = torch.tensor([[0, 1, 2]])
    lags, censored = lags_from_agreement(agree, commit)
    # position 0: committed at 0, agrees at 0, not at 1, then for good from 2 -> lag 2
    # position 1: committed at 1, agrees from 1 through 3 -> lag 0
    # position 2: committed at 2, agrees at 2 but not in the final state -> censored at 4 - 2 = 2
    assert lags.tolist() == [[2, 0, 2]] and censored.tolist() == [[False, False, True]]
    assert lag_ccdf(lags, 3) == pytest.approx([1.0, 2 / 3, 2 / 3, 0.0])
    # what happens before a position's commit does not count
    early = agree.clone()
    early[0, 0, 1] = True
    assert lags_from_agreement(early, commit)[0].tolist() == [[2, 0, 2]]


def test_the_stability_lag_reads_each_committed_position_masked_again_alone():
    tok, m = _tiny()
    enc = tok(["12+34=", "5+6="], return_tensors="pt", padding=True, padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    tokens = torch.randint(5, 15, (2, 3), generator=torch.Generator().manual_seed(0))
    commit = torch.zeros(2, 3, dtype=torch.long)  # all committed at the one step: lag 0 iff the model agrees there
    lags, censored = stability_lags(m, ids, mask, tokens, commit, mask_id=tok.mask_token_id, steps=1)
    P = ids.shape[1]
    attn = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
    for row in range(2):
        for i in range(3):
            probe = torch.cat([ids[row], tokens[row]])[None].clone()
            probe[0, P + i] = tok.mask_token_id
            with torch.no_grad():
                top = m(input_ids=probe, attention_mask=attn[row:row + 1],
                        position_ids=(attn[row:row + 1].cumsum(-1) - 1).clamp(min=0)).logits[0, P + i].argmax()
            agrees = bool(top == tokens[row, i])
            assert censored[row, i].item() == (not agrees) and lags[row, i].item() == (0 if agrees else 1)
    with pytest.raises(ValueError, match="every response position must be committed"):
        stability_lags(m, ids, mask, tokens, commit - 1, mask_id=tok.mask_token_id, steps=1)


def test_the_prior_defaults_and_a_window_whose_weights_sum_below_one():
    raw = torch.tensor([0.1, 0.2, 0.3])
    assert torch.equal(window_prior(raw, 2), window_prior(raw, 2, 0.01))  # floor_frac 0.01 by default
    assert window_prior(raw, 2).tolist() == pytest.approx([0.01 * 0.5, 0.4, 0.6])  # normalised even below 1
    commits = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)
    none = torch.zeros(2, 2, dtype=torch.bool)
    # beta 2: lambda0 = 1 + 2 (1 - t/T) = 3, 2 at t = 0, 1
    assert accumulate_prior(commits, none, torch.zeros(2, 2), beta=2.0).tolist() == [3.0, 2.0]


def test_lag_summary_of_no_positions_has_a_one_point_ccdf():
    from rl.methods.fair_calib.core import lag_summary
    summary = lag_summary(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.bool))
    assert len(summary["stability_lag_ccdf"]) == 1


def test_block_calibration_is_adamw_on_the_weighted_error_keeping_the_best_epoch():
    """calibrate_blocks against its description written out for a one-block model: AdamW (no weight decay, the
    lr given) on block 0's quantizer parameters alone, the prior-weighted MSE to the teacher's block output, the
    parameters of the epoch with the lowest loss kept; then nothing left trainable. The defaults are 15 epochs at
    5e-3."""
    import copy

    from models.blocks import block_outputs
    tok = build_tiny_tokenizer(mask_token=True)
    fp = build_tiny_llada(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64).eval()
    enc = tok(["12+34=0046", "51+6=0057"], return_tensors="pt", padding=True, padding_side="right")
    batches = [{"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}]
    weights = [enc["attention_mask"].float() * torch.linspace(0.2, 1.0, enc["input_ids"].shape[1])]
    quant, reference = copy.deepcopy(fp), copy.deepcopy(fp)
    quantize_blocks(quant, 4, 4)
    quantize_blocks(reference, 4, 4)
    calls = []
    history = calibrate_blocks(fp, quant, batches, weights, epochs=3, lr=2e-2, log=lambda *a: calls.append(a))
    params = [p for m in reference.modules() if isinstance(m, FakeQuantLinear)
              for p in m.quantizer_parameters().values()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.0)
    target = block_outputs(fp, batches[0], 0)[0].detach().float()

    def loss():
        out = block_outputs(reference, batches[0], 0)[0].float()
        return ((out - target).pow(2).sum(-1) * weights[0]).sum() / weights[0].sum()
    best, kept = float(loss()), [p.detach().clone() for p in params]
    start = best
    for _ in range(3):
        opt.zero_grad()
        loss().backward()
        opt.step()
        if (now := float(loss())) < best:
            best, kept = now, [p.detach().clone() for p in params]
    got = [p for m in quant.modules() if isinstance(m, FakeQuantLinear) for p in m.quantizer_parameters().values()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, kept))
    assert history == [{"block": 0, "loss_before": pytest.approx(start, rel=1e-5),
                        "loss_after": pytest.approx(best, rel=1e-5)}]
    assert [c[0] for c in calls] == [0]
    assert not any(p.requires_grad for p in quant.parameters())  # frozen again, the base weights never trained
    defaults, explicit = copy.deepcopy(reference), copy.deepcopy(reference)
    for m in (defaults, explicit):
        for p in m.parameters():
            p.requires_grad_(False)
    assert calibrate_blocks(fp, defaults, batches, weights) == calibrate_blocks(fp, explicit, batches, weights,
                                                                               epochs=15, lr=5e-3)
