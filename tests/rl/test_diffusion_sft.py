"""recipes/llada_sft_tiny.yaml at test size: a masked-diffusion model trained by SFT (the MDLM loss) on the
DeepSpeed learner through Ray and evaluated with the block sampler in the hf engine."""

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
def test_the_tiny_llada_recipe_trains_with_the_mdlm_loss_and_evaluates_by_diffusion(ray_cluster, tmp_path):
    from rl.pipeline import run
    out = tmp_path / "llada"
    summary = run(config.load(ROOT / "recipes/llada_sft_tiny.yaml", [f"output_dir={out}", *SMALL]))
    assert list(summary["stages"]) == ["model", "data", "sft", "evaluate"]
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
