"""Decomper (rl/methods/decomper/core.py): the factorizations, the closed-form and learned drift compensation, on a tiny Llama
trained in code (rl/methods/decomper/README.md)."""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from rl.methods.decomper.core import (
    block_drift,
    closed_form_bias,
    compress,
    input_stats,
    learn_biases,
    plain_factors,
    rank_for_ratio,
    target_linears,
    tiny_arithmetic_lm,
    token_kl_and_nll,
    whitened_factors,
)


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


def test_the_fused_layer_computes_what_the_factors_and_bias_compute():
    torch.manual_seed(2)
    w, x = torch.randn(32, 48), torch.randn(7, 48)
    a, b = whitened_factors(w, (x.T @ x).double() + torch.eye(48, dtype=torch.float64), 9)
    bias = torch.randn(32)
    fused = nn.Linear(48, 32)
    with torch.no_grad():
        fused.weight.copy_((a @ b).float())
        fused.bias.copy_(bias)
    unfused = x @ b.float().T @ a.float().T + bias  # A(Bx) + b: two thin matmuls
    assert torch.allclose(fused(x), unfused, atol=1e-5, rtol=1e-5)


def test_compression_keeps_module_types_and_adds_only_biases(trained, tmp_path):
    from transformers import AutoModelForCausalLM
    model, calib, held = trained
    comp = copy.deepcopy(model)
    report = compress(comp, input_stats(model, calib), 0.4, "whitened", "closed_form")
    linears = target_linears(comp)
    assert set(report) == set(linears) and len(linears) == 4 * 7
    assert [type(m) for m in comp.modules()] == [type(m) for m in model.modules()]
    n_orig = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in comp.parameters()) == n_orig + sum(m.out_features for m in linears.values())
    for name, r in report.items():
        sv = torch.linalg.svdvals(linears[name].weight.detach().double())
        assert sv[r["rank"]] < 1e-5 * sv[0]  # rank k up to float32 rounding
    comp.save_pretrained(tmp_path / "c")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "c").eval()
    assert again.config.attention_bias and again.config.mlp_bias
    with torch.no_grad():
        assert torch.allclose(again(**held[0]).logits, comp(**held[0]).logits, atol=1e-6)


def test_at_full_rank_the_biases_stay_near_zero(trained):
    model, calib, _ = trained
    comp = copy.deepcopy(model)
    compress(comp, input_stats(model, calib), 0.0, "whitened", "closed_form")
    learn_biases(model, comp, calib, lr=1e-3, epochs=1)
    assert max(float(m.bias.abs().max()) for m in target_linears(comp).values()) < 1e-3


def test_the_learned_bias_brings_held_out_outputs_closer_than_no_or_closed_form_compensation(trained):
    """At ρ = 0.8 with plain SVD: held-out token KL to the original and perplexity, and the last block's drift. (The
    closed-form bias zeroes the mean error of each layer alone; whether that helps the whole model varies with the
    model: benchmarks/diffusion_compression.py measures the three over seeds.)"""
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
    assert nll["learned"] < nll["none"], nll
    assert last["learned"] < min(last["closed_form"], last["none"]), last


@pytest.mark.slow
def test_the_compressed_policy_is_served_by_vllm_and_trained_by_rl(ray_cluster, tmp_path):
    """recipes/decomper_tiny.yaml at test size, with the vllm engine: SFT, decomper (whitened SVD, learned
    biases), one GRPO step on the compressed model (learner and vLLM both load it), evaluation."""
    import json

    from cluster.pipeline import run
    from rl import config
    from tests.cluster.test_pipeline import ROOT, TINY, vllm_model
    out = tmp_path / "run"
    stages = ("stages=[{name: model}, {name: data}, {name: sft}, {name: decomper, params: {ratio: 0.5, "
              "calib_sequences: 8, heldout_sequences: 8, calib_length: 32, epochs: 1}}, {name: rl}, {name: evaluate}]")
    summary = run(config.load(ROOT / "recipes/decomper_tiny.yaml", [
        f"output_dir={out}", *TINY, *vllm_model("vllm"), "rollout.engine=vllm", "rollout.engine_params={}",
        "sft.steps=10", "sft.batch_size=16", "trainer.steps=1", "data.synthetic.num_train=200", stages]))
    assert summary["steps"] == 1 and "accuracy_after_rl" in summary
    report = json.loads((out / "stages" / "decomper" / "compression_report.json").read_text())
    assert report["factor_params"] < 0.51 * report["dense_params"]
    assert len(report["learned"]) == 1 and len(report["drift"]) == 1  # one block
    assert report["learned"][0]["mse_after"] <= report["learned"][0]["mse_before"]  # on the calibration sequences
    assert set(summary["decomper"]["heldout_token_kl"]) == {"uncompensated", "compensated"}
    policy = summary["stages"]["decomper"]["artifacts"]["policy"]
    assert json.loads((Path(policy) / "config.json").read_text())["mlp_bias"] is True
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["actor/mismatch_abs_diff"] < 1e-3  # vLLM samples from the compressed weights the learner holds


def test_block_by_block_statistics_equal_those_of_a_whole_model_pass(trained):
    model, calib, _ = trained
    whole = input_stats(model, calib)
    for j in range(4):
        part = input_stats(model, calib, block=j)
        assert set(part) == {k for k in whole if k.startswith(f"model.layers.{j}.")}
        for k, v in part.items():
            assert v.count == whole[k].count
            assert torch.allclose(v.xtx, whole[k].xtx) and torch.allclose(v.xsum, whole[k].xsum)
