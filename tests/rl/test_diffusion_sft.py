"""recipes/llada_sft_tiny.yaml and fair_calib_tiny.yaml at test size: a masked-diffusion model trained by SFT (the
MDLM loss) on the DeepSpeed learner through Ray, quantized W4A4 by FAIR-Calib, and evaluated quantized with the
block sampler in the hf engine."""

import json

import pytest

from rl import config
from rl.config import ConfigError
from tests.cluster.test_pipeline import ROOT

SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
         "model.tiny.intermediate_size=64", "data.synthetic.num_train=600", "data.synthetic.num_eval=16",
         "sft.steps=40", "sft.batch_size=32", "sft.lr=3e-3", "sft.warmup_steps=2", "sft.eval_every=20",
         "sft.eval_fraction=0.05", "learner.micro_batch_size=32", "rollout.threads=1", "learner.threads=1",
         "logging.progress_bar=false", "logging.tensorboard=false"]


@pytest.mark.slow
def test_a_tiny_llada_trains_with_the_mdlm_loss_is_quantized_and_evaluates_by_diffusion(ray_cluster, tmp_path):
    from cluster.pipeline import run
    out = tmp_path / "llada"
    quantize = ("{name: fair_calib, params: {probes: 4, calib_sequences: 8, diag_sequences: 4, epochs: 2, "
                "batch_size: 4, transform: kron}}")
    summary = run(config.load(ROOT / "recipes/llada_sft_tiny.yaml", [
        f"output_dir={out}", *SMALL, f"stages=[{{name: model}}, {{name: data}}, {{name: sft}}, {quantize}, "
        "{name: evaluate}]"]))
    assert list(summary["stages"]) == ["model", "data", "sft", "fair_calib", "evaluate"]
    report = json.loads((out / "stages" / "fair_calib" / "quantization_report.json").read_text())
    assert len(report["prior"]) == 4 and sum(report["prior"]) == pytest.approx(1.0)
    assert all(b["loss_after"] <= b["loss_before"] for b in report["blocks"]) and len(report["blocks"]) == 2
    assert set(report["rtn"]) == set(report["calibrated"]) == {
        "frontier_flip_rate", "trajectory_kl", "post_commit_mismatch", "stability_lag_mean", "stability_lag_censored",
        "stability_lag_ccdf"}
    saved = json.loads((out / "stages" / "fair_calib" / "model" / "fake_quant.json").read_text())
    assert saved["transform"] == "kron" and report["transform"] == "kron"  # evaluated quantized, flattened
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
    assert examples and max(tok_count) <= 4  # the 4-token canvas (3 digits and EOS) was decoded


def test_a_recipe_that_runs_rl_on_a_masked_diffusion_model_is_refused_at_start_up(tmp_path):
    from cluster.pipeline import check_recipe
    cfg = config.load(ROOT / "recipes/llada_sft_tiny.yaml", [
        f"output_dir={tmp_path}", "stages=[{name: model}, {name: data}, {name: sft}, {name: rl}]"])
    with pytest.raises(ConfigError, match="masked_diffusion.*'rl' stage"):
        check_recipe(cfg, None)


def test_the_addition_task_has_fixed_width_sums_disjoint_splits_and_refuses_more_problems_than_exist(tmp_path):
    from rl.tasks.arithmetic import addition_task
    paths = addition_task(tmp_path, num_train=100, num_eval=20, sft_fraction=0.5, seed=0, digits=2)
    rows = {name: [json.loads(x) for x in open(p)] for name, p in paths.items()}
    assert [len(rows[n]) for n in ("sft", "train", "eval")] == [50, 50, 20]
    for r in rows["sft"] + rows["train"] + rows["eval"]:
        a, b = map(int, r["prompt"].rstrip("=").split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and r["answer"] == f"{a + b:03d}"
    prompts = [{r["prompt"] for r in rows[n]} for n in ("sft", "train", "eval")]
    assert not (prompts[0] & prompts[1]) and not (prompts[2] & (prompts[0] | prompts[1]))
    # two-digit operands: 90 × 90 = 8,100 problems; asking for more fails at once instead of drawing forever
    with pytest.raises(ValueError, match="digits=2 has 8100 distinct problems; num_train \\+ num_eval = 8200"):
        addition_task(tmp_path, num_train=8000, num_eval=200, sft_fraction=0.9, seed=0, digits=2)
