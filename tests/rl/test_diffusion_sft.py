"""recipes/llada_sft_tiny.yaml and fair_calib_tiny.yaml at test size: a masked-diffusion model trained by SFT (the
MDLM loss) on the DeepSpeed learner through Ray, quantized W4A4 by FAIR-Calib, and evaluated quantized with the
block sampler in the hf engine."""

import json

import pytest

from rl import config
from rl.config import ConfigError
from tests.rl.test_pipeline import ROOT

SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
         "model.tiny.intermediate_size=64", "data.synthetic.num_train=600", "data.synthetic.num_eval=16",
         "sft.steps=40", "sft.batch_size=32", "sft.lr=3e-3", "sft.warmup_steps=2", "sft.eval_every=20",
         "sft.eval_fraction=0.05", "learner.micro_batch_size=32", "rollout.threads=1", "learner.threads=1",
         "logging.progress_bar=false", "logging.tensorboard=false"]


@pytest.mark.slow
def test_a_tiny_llada_trains_with_the_mdlm_loss_is_quantized_and_evaluates_by_diffusion(ray_cluster, tmp_path):
    from rl.pipeline import run
    out = tmp_path / "llada"
    quantize = ("{name: quantize_fair, params: {probes: 4, calib_sequences: 8, diag_sequences: 4, epochs: 2, "
                "batch_size: 4}}")
    summary = run(config.load(ROOT / "recipes/llada_sft_tiny.yaml", [
        f"output_dir={out}", *SMALL, f"stages=[{{name: model}}, {{name: data}}, {{name: sft}}, {quantize}, "
        "{name: evaluate}]"]))
    assert list(summary["stages"]) == ["model", "data", "sft", "quantize_fair", "evaluate"]
    report = json.loads((out / "stages" / "quantize_fair" / "quantization_report.json").read_text())
    assert len(report["prior"]) == 5 and sum(report["prior"]) == pytest.approx(1.0)
    assert all(b["loss_after"] <= b["loss_before"] for b in report["blocks"]) and len(report["blocks"]) == 2
    assert set(report["rtn"]) == set(report["calibrated"]) == {"frontier_flip_rate", "trajectory_kl",
                                                              "post_commit_mismatch"}
    assert (out / "stages" / "quantize_fair" / "model" / "fake_quant.json").exists()  # evaluated quantized
    assert json.loads((out / "base_model" / "config.json").read_text())["model_type"] == "llada"
    hist = [json.loads(x) for x in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(hist) == 40
    first, last = sum(h["sft/loss"] for h in hist[:5]) / 5, sum(h["sft/loss"] for h in hist[-5:]) / 5
    assert last < 0.8 * first  # the MDLM loss falls
    evals = [h["sft/eval_loss"] for h in hist if "sft/eval_loss" in h]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert 0.0 <= summary["accuracy_after_rl"] <= 1.0
    examples = summary["eval_examples_after_rl"]
    tok_count = [len(e["response"]) for e in examples]
    assert examples and max(tok_count) <= 5  # the 5-token canvas (4 digits and EOS) was decoded


def test_a_recipe_that_runs_rl_on_a_masked_diffusion_model_is_refused_at_start_up(tmp_path):
    from rl.pipeline import check_components
    cfg = config.load(ROOT / "recipes/llada_sft_tiny.yaml", [
        f"output_dir={tmp_path}", "stages=[{name: model}, {name: data}, {name: sft}, {name: rl}]"])
    with pytest.raises(ConfigError, match="masked_diffusion.*'rl' stage"):
        check_components(cfg, None)
