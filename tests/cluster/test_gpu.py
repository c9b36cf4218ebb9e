"""GPU-only paths: NCCL weight broadcast into vLLM engines, colocated on one device. Skipped without CUDA."""

import pytest
import torch

from rl.pipeline import run
from rl.tracking import read_metrics
from tests.rl.test_pipeline import _cfg, _digit_reward

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (NCCL broadcast, vLLM on GPU)")]


@pytest.mark.parametrize("sync", ["collective", "object_store"])
def test_vllm_on_gpu_with_each_weight_sync(ray_cluster, tmp_path, sync):
    pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm]'")
    cfg = _cfg(tmp_path, sync, "trainer.steps=3", "learner.lr=5e-3", "rollout.engine=vllm",
               "rollout.engine_params={gpu_memory_utilization: 0.2}", f"rollout.weight_sync={sync}",
               "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128", _digit_reward(tmp_path))
    summary = run(cfg)
    metrics = read_metrics(tmp_path / sync)
    assert summary["steps"] == 3
    # fp32 on both sides (TF32 matmuls allowed): after each sync the engine samples the learner's weights
    assert all(m["actor/mismatch_abs_diff"] < 5e-3 for m in metrics)
    assert all(m["rollout/weight_load_s"] > 0 for m in metrics)
