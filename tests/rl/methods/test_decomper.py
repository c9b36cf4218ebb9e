"""Decomper (rl/methods/decomper/core.py): the factorizations, the closed-form and learned drift compensation, on a tiny Llama
trained in code (rl/methods/decomper/README.md)."""

import copy
from pathlib import Path

import pytest
import torch

from rl.methods.decomper.core import (
    block_drift,
    closed_form_bias,
    compress,
    input_stats,
    learn_biases,
    plain_factors,
    rank_for_ratio,
    target_linears,
    token_kl_and_nll,
    whitened_factors,
)
from rl.methods.decomper.task import tiny_arithmetic_lm


@pytest.fixture(scope="module")
def trained():
    """A 4-block tiny Llama fitted to arithmetic text for 200 steps, with calibration and held-out batches."""
    model, batch = tiny_arithmetic_lm(seed=0, steps=200)
    return model, [batch(16) for _ in range(2)], [batch(16) for _ in range(2)]


def test_the_rank_removes_the_asked_share_of_parameters():
    assert rank_for_ratio(100, 100, 0.4) == 30  # 30 * 200 = 6,000 of 10,000 kept
    assert rank_for_ratio(64, 128, 0.6) == 17  # floor(0.4 * 8192 / 192)
    assert rank_for_ratio(64, 128, 0.0) == 64  # no compression: full rank
    with pytest.raises(ValueError, match="ratio"):
        rank_for_ratio(8, 8, 1.0)


def test_full_rank_factors_give_back_the_weight_and_whitening_wins_on_the_data():
    torch.manual_seed(0)
    w = torch.randn(24, 16)
    mix = torch.randn(16, 16) * torch.logspace(0, -2, 16)  # correlated inputs of very unequal scales
    x = torch.randn(500, 16) @ mix.T
    xtx = x.double().T @ x.double()
    for a, b in (plain_factors(w, 16), whitened_factors(w, xtx, 16)):
        assert torch.allclose(a @ b, w.double(), atol=1e-8)
    k = 5
    err = {name: float(((w.double() - a @ b) @ x.double().T).norm())
           for name, (a, b) in (("plain", plain_factors(w, k)), ("whitened", whitened_factors(w, xtx, k)))}
    assert err["whitened"] < 0.5 * err["plain"]  # SVD-LLM: truncation error measured on the calibration inputs


def test_the_closed_form_bias_zeroes_the_mean_output_error():
    torch.manual_seed(1)
    w, x = torch.randn(12, 10), torch.randn(300, 10) + 2.0
    a, b = plain_factors(w, 3)
    low = a @ b
    bias = closed_form_bias(w, low, x.double().mean(0))
    error = x.double() @ w.double().T - (x.double() @ low.T + bias)
    assert error.mean(0).abs().max() < 1e-10 and error.abs().mean() > 0.1


def test_the_low_rank_layer_computes_a_times_b_x_plus_the_bias_with_its_factors_alone():
    from models.lowrank import LowRankLinear
    torch.manual_seed(2)
    w, x = torch.randn(32, 48), torch.randn(7, 48)
    a, b = whitened_factors(w, (x.T @ x).double() + torch.eye(48, dtype=torch.float64), 9)
    bias = torch.randn(32)
    layer = LowRankLinear.from_factors(a, b, bias, torch.float32)
    dense = x @ (a @ b).float().T + bias
    with torch.no_grad():
        assert torch.allclose(layer(x), dense, atol=1e-5, rtol=1e-5)
    assert sorted((k, tuple(v.shape)) for k, v in layer.state_dict().items()) == [
        ("down.weight", (9, 48)), ("up.bias", (32,)), ("up.weight", (32, 9))]  # 9 x (32 + 48) + 32 numbers


def test_compression_stores_the_factors_and_saves_and_loads_them_smaller(trained, tmp_path):
    from models.families import CausalFamily
    from models.lowrank import LowRankLinear, load_low_rank, save_low_rank
    from rollout.hf_engine import HFEngine
    model, calib, held = trained
    comp = copy.deepcopy(model)
    report = compress(comp, input_stats(model, calib), 0.4, "whitened", "closed_form")
    layers = target_linears(comp)
    assert set(report) == set(layers) and len(layers) == 4 * 7
    assert all(isinstance(m, LowRankLinear) and m.rank == report[n]["rank"] for n, m in layers.items())
    n_orig, n_comp = (sum(p.numel() for p in m.parameters()) for m in (model, comp))
    dense = sum(r["dense_params"] for r in report.values())
    # every projection's m x n weight became k (m + n) factor numbers and an m-vector bias
    assert n_comp == n_orig - dense + sum(r["factor_params"] + r["shape"][0] for r in report.values())
    assert n_comp < n_orig - 0.35 * dense
    from models.tiny import build_tiny_tokenizer
    model.save_pretrained(tmp_path / "orig")
    save_low_rank(comp, tmp_path / "c")
    build_tiny_tokenizer().save_pretrained(tmp_path / "c")  # the tokenizer tiny_arithmetic_lm's model reads
    size = {k: (tmp_path / k / "model.safetensors").stat().st_size for k in ("orig", "c")}
    assert size["c"] < size["orig"] - 0.35 * 4 * dense  # fp32: the removed projection numbers are off the disk
    for again in (load_low_rank(tmp_path / "c"), CausalFamily().load(str(tmp_path / "c")),
                  HFEngine(str(tmp_path / "c")).model):
        assert sum(p.numel() for p in again.parameters()) == n_comp
        with torch.no_grad():
            assert torch.allclose(again(**held[0]).logits, comp(**held[0]).logits, atol=1e-5)


def test_vllm_refuses_a_low_rank_folder_naming_why(trained, tmp_path):
    pytest.importorskip("vllm")
    from models.lowrank import save_low_rank
    from rollout.vllm_engine import VLLMEngine
    model, calib, _ = trained
    comp = copy.deepcopy(model)
    compress(comp, input_stats(model, calib), 0.4, "plain", "none")
    save_low_rank(comp, tmp_path / "c")
    with pytest.raises(ValueError, match="low-rank factors.*rollout.engine hf"):
        VLLMEngine(str(tmp_path / "c"))


def test_at_full_rank_the_biases_stay_near_zero(trained):
    model, calib, _ = trained
    comp = copy.deepcopy(model)
    compress(comp, input_stats(model, calib), 0.0, "whitened", "closed_form")
    learn_biases(model, comp, calib, lr=1e-3, epochs=1)
    assert max(float(m.bias.abs().max()) for m in target_linears(comp).values()) < 1e-3


def test_the_learned_bias_brings_held_out_outputs_closer_than_no_or_closed_form_compensation(trained):
    """At ρ = 0.8 with plain SVD: held-out token KL to the original and the last block's drift, the two distances the
    learned biases are fitted to shrink. (The closed-form bias zeroes the mean error of each layer alone; whether that
    helps the whole model varies with the model.) Perplexity is not what the biases fit: it moved either way by a few
    tenths of a percent here across CPU kinds (a model trained on another kernel set), and by seed in
    benchmarks/diffusion_compression.py (learned below none in 2 of 3 seeds), so it is only held to cost under 0.5%."""
    model, calib, held = trained
    stats = input_stats(model, calib)
    results = {}
    for comp_kind in ("none", "closed_form", "learned"):
        comp = copy.deepcopy(model)
        compress(comp, stats, 0.8, "plain", "none" if comp_kind == "none" else "closed_form")
        if comp_kind == "learned":
            history = learn_biases(model, comp, calib, lr=1e-3, epochs=3)
            assert all(h["mse_after"] < h["mse_before"] for h in history)
        results[comp_kind] = (token_kl_and_nll(model, comp, held), block_drift(model, comp, held))
    kl = {k: v[0]["token_kl"] for k, v in results.items()}
    nll = {k: v[0]["nll_compressed"] for k, v in results.items()}
    last = {k: v[1][-1] for k, v in results.items()}
    assert kl["learned"] < min(kl["closed_form"], kl["none"]), kl
    assert nll["learned"] < 1.005 * nll["none"], nll
    assert last["learned"] < min(last["closed_form"], last["none"]), last


@pytest.mark.slow
def test_the_compressed_policy_is_served_and_trained_by_rl_as_factors(ray_cluster, tmp_path):
    """recipes/decomper_tiny.yaml at test size: decomper (whitened SVD, learned biases), one GRPO step on the
    compressed model (the learner and the hf engine both load its factors), evaluation. The recipe's SFT warm-up is
    left out: the stage compresses whatever policy it is given (the SFT stage has its own tests)."""
    import json

    from cluster.pipeline import run
    from rl import config
    from tests.cluster.test_pipeline import ROOT, TINY
    out = tmp_path / "run"
    stages = ("stages=[{name: model}, {name: data}, {name: decomper, params: {ratio: 0.5, "
              "calib_sequences: 8, heldout_sequences: 8, calib_length: 32, epochs: 1}}, {name: rl}, {name: evaluate}]")
    summary = run(config.load(ROOT / "recipes/decomper_tiny.yaml", [
        f"output_dir={out}", *TINY,
        "trainer.steps=1", "data.synthetic.num_train=200", stages]))
    assert summary["steps"] == 1 and "accuracy_after_rl" in summary
    report = json.loads((out / "stages" / "decomper" / "compression_report.json").read_text())
    assert report["factor_params"] < 0.51 * report["dense_params"]
    assert len(report["learned"]) == 1 and len(report["drift"]) == 1  # one block
    assert report["learned"][0]["mse_after"] <= report["learned"][0]["mse_before"]  # on the calibration sequences
    assert set(summary["decomper"]["heldout_token_kl"]) == {"uncompensated", "compensated"}
    policy = summary["stages"]["decomper"]["artifacts"]["policy"]
    assert (Path(policy) / "low_rank.json").exists()
    sizes = summary["decomper"]["model_params"]
    assert sizes["compressed"] < sizes["original"]  # the factors are what was saved, served and trained
    assert summary["decomper"]["bytes_on_disk"]["compressed"] < summary["decomper"]["bytes_on_disk"]["original"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["actor/mismatch_abs_diff"] < 1e-3  # the engine samples from the factors the learner holds


def test_block_by_block_statistics_equal_those_of_a_whole_model_pass(trained):
    model, calib, _ = trained
    whole = input_stats(model, calib)
    for j in range(4):
        part = input_stats(model, calib, block=j)
        assert set(part) == {k for k in whole if k.startswith(f"model.layers.{j}.")}
        for k, v in part.items():
            assert v.count == whole[k].count
            assert torch.allclose(v.xtx, whole[k].xtx) and torch.allclose(v.xsum, whole[k].xsum)


def test_small_ranks_and_the_whitening_ridge_by_hand():
    assert rank_for_ratio(2, 2, 0.9) == 1  # floor(0.1 * 4 / 4) = 0: at least one direction stays
    torch.manual_seed(3)
    w, x = torch.randn(6, 5).double(), torch.randn(40, 5).double() * 3
    xtx = x.T @ x
    for eps in (0.5, 1e-6):
        reg = eps * float(xtx.diagonal().mean()) + 1e-12
        s = torch.linalg.cholesky(xtx + reg * torch.eye(5, dtype=torch.float64))
        u, sv, vh = torch.linalg.svd(w @ s, full_matrices=False)
        a_ref, b_ref = u[:, :2] * sv[:2].sqrt(), sv[:2].sqrt()[:, None] * vh[:2] @ torch.linalg.inv(s)
        a, b = whitened_factors(w, xtx, 2, eps)
        assert torch.allclose(a @ b, a_ref @ b_ref, atol=1e-9)
    default, explicit = whitened_factors(w, xtx, 2), whitened_factors(w, xtx, 2, 1e-6)
    assert all(torch.equal(p, q) for p, q in zip(default, explicit))


def test_learned_biases_follow_adam_on_the_token_mean_block_error(trained):
    """learn_biases on a one-block slice of the work: the reported error is the token-mean squared error of the
    block's output over the real tokens (by hand), the lr given is Adam's, the defaults are lr 1e-3 and 2 epochs,
    the log gets each block's index and errors, and nothing is left trainable."""
    from models.blocks import block_outputs
    from rl.methods.decomper.core import learn_biases
    model, calib, _ = trained
    comp = copy.deepcopy(model)
    compress(comp, input_stats(model, calib), 0.8, "plain", "none")
    with torch.no_grad():
        errs = []
        for b in calib:
            mask = b["attention_mask"].bool()
            d = block_outputs(comp, b, 0)[0][mask].float() - block_outputs(model, b, 0)[0][mask].float()
            errs.append(float(d.pow(2).sum(-1).mean()))
    logs = []
    runs = {lr: copy.deepcopy(comp) for lr in (1e-3, 1e-2)}
    history = {lr: learn_biases(model, m, calib, lr=lr, epochs=1, log=lambda *a: logs.append(a))
               for lr, m in runs.items()}
    assert history[1e-3][0]["mse_before"] == pytest.approx(sum(errs) / len(errs), rel=1e-5)
    assert [h["block"] for h in history[1e-3]] == [0, 1, 2, 3]
    assert [(j, b, a) for j, b, a in logs[:4]] == [(h["block"], h["mse_before"], h["mse_after"])
                                                   for h in history[1e-3]]
    assert history[1e-3][0]["mse_after"] != history[1e-2][0]["mse_after"]  # the rate reaches Adam
    assert not any(p.requires_grad for m in runs.values() for p in m.parameters())
    a, b = copy.deepcopy(comp), copy.deepcopy(comp)
    assert learn_biases(model, a, calib) == learn_biases(model, b, calib, lr=1e-3, epochs=2)
