"""GPU-only paths: DeepSpeed learners and rollout engines on CUDA, weights by CUDA IPC between colocated
roles, NCCL broadcast between GPUs. Skipped without CUDA (and without a second GPU / vLLM where needed)."""

import multiprocessing as mp

import pytest
import torch

from cluster.pipeline import run
from rl.loop.tracking import read_metrics
from tests.cluster.test_pipeline import _cfg, _digit_reward

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SMALL = ["model.tiny.hidden_size=64", "model.tiny.intermediate_size=128"]


def _open_and_sum(handles, meta, bucket_bytes, queue):
    from rollout.weight_sync import gpu_uuid, open_state_ipc
    sums = {}
    for part in open_state_ipc(handles, meta, bucket_bytes):
        sums.update({k: float(v.double().sum()) for k, v in part.items()})
    queue.put((gpu_uuid(), sums))


def test_cuda_ipc_buckets_are_read_by_another_process():
    from rollout.weight_sync import gpu_uuid, plan_buckets, share_state_ipc, state_meta
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"w{i}": torch.randn(33, 17 + i, device="cuda", generator=g) for i in range(6)}
    state["h"] = torch.randn(5, device="cuda", generator=g).to(torch.bfloat16)
    meta, bucket_bytes = state_meta(state), 4096
    assert len(plan_buckets(meta, bucket_bytes)) > 2  # several buckets, and a dtype change
    buckets, handles = share_state_ipc(state, meta, bucket_bytes)
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_open_and_sum, args=(handles, meta, bucket_bytes, queue))
    proc.start()
    uuid, sums = queue.get(timeout=120)
    proc.join(60)
    assert proc.exitcode == 0 and uuid == gpu_uuid()
    for k, v in state.items():
        assert sums[k] == pytest.approx(float(v.double().sum()), rel=1e-6, abs=1e-6)
    del buckets


@pytest.mark.parametrize("sync,staleness", [("object_store", 0), ("cuda_ipc", 0), ("cuda_ipc", 1)])
def test_hf_engine_on_gpu_with_each_weight_sync(ray_cluster, tmp_path, sync, staleness):
    name = f"{sync}_{staleness}"
    cfg = _cfg(tmp_path, name, "trainer.steps=3", "learner.lr=5e-3", f"rollout.weight_sync={sync}",
               f"trainer.max_staleness={staleness}", *SMALL, _digit_reward(tmp_path))
    summary = run(cfg)
    metrics = read_metrics(tmp_path / name)
    assert summary["steps"] == 3
    # fp32 on both sides (TF32 matmuls allowed): the engine samples with the weights the learner scores
    # with; one step stale, it samples with the previous step's weights and the mismatch shows it
    first = metrics[0]["actor/mismatch_abs_diff"]
    assert first < 5e-3
    if staleness == 0:
        assert all(m["actor/mismatch_abs_diff"] < 5e-3 for m in metrics)
    else:
        assert max(m["actor/mismatch_abs_diff"] for m in metrics[1:]) > first
    assert all(m["rollout/weight_load_s"] > 0 for m in metrics[1:])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL broadcast needs rollout workers on other GPUs")
def test_nccl_broadcast_with_split_placement(ray_cluster, tmp_path):
    cfg = _cfg(tmp_path, "nccl", "trainer.steps=3", "learner.lr=5e-3", "rollout.weight_sync=collective",
               "cluster.placement=split", "rollout.sync_bucket_mb=1", *SMALL, _digit_reward(tmp_path))
    assert run(cfg)["steps"] == 3
    assert all(m["actor/mismatch_abs_diff"] < 5e-3 for m in read_metrics(tmp_path / "nccl"))


@pytest.mark.parametrize("sync", ["object_store", "cuda_ipc"])
def test_vllm_on_gpu_with_each_weight_sync(ray_cluster, tmp_path, sync):
    pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm]'")
    cfg = _cfg(tmp_path, sync, "trainer.steps=3", "learner.lr=5e-3", "rollout.engine=vllm",
               "rollout.engine_params={vllm: {gpu_memory_utilization: 0.2}}", f"rollout.weight_sync={sync}",
               *SMALL, _digit_reward(tmp_path))
    assert run(cfg)["steps"] == 3
    assert all(m["actor/mismatch_abs_diff"] < 5e-3 for m in read_metrics(tmp_path / sync))


@pytest.mark.parametrize("engine,zero", [("hf", 2), ("hf", 3), ("vllm", 3)])
def test_colocated_roles_take_turns_on_the_gpu(ray_cluster, tmp_path, engine, zero):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm]'")
    name = f"swap_{engine}_{zero}"
    common = ["trainer.steps=3", "learner.lr=5e-3", f"learner.zero_stage={zero}", f"rollout.engine={engine}",
              "rollout.weight_sync=cuda_ipc", *SMALL, _digit_reward(tmp_path)]
    if engine == "vllm":
        common.append("rollout.engine_params={vllm: {max_model_len: 96}}")
    run(_cfg(tmp_path, name + "_plain", *common))
    run(_cfg(tmp_path, name, *common, "learner.offload_between_phases=true", "rollout.sleep_between_phases=true"))
    plain, swapped = read_metrics(tmp_path / (name + "_plain")), read_metrics(tmp_path / name)
    # the learner's GPU memory while the engines generate: weights, optimizer states and gradients left
    # (what stays: the weight buckets shared with the engine and ZeRO-3's gathered-parameter cache)
    assert all(m["memory/learner_gpu_gib_offloaded"] < 0.6 * m["memory/learner_gpu_gib_loaded"] for m in swapped)
    for a, b in zip(plain, swapped):  # taking turns changes where the states wait, not the run
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], rel=1e-4, abs=1e-6)
        assert a["actor/loss"] == pytest.approx(b["actor/loss"], rel=1e-3, abs=1e-5)


def test_fair_calib_quantizes_a_bfloat16_model_on_the_gpu(tmp_path):
    """The FAIR-Calib stage's task on the device its recipe names: the teacher, the prior's probes and the block
    calibration run on the GPU with the weights in bf16."""
    import json

    from models.diffusion import build_tiny_llada
    from models.tiny import build_tiny_tokenizer
    from rl.methods.fair_calib.stage import quantize_model
    tok = build_tiny_tokenizer(mask_token=True)
    build_tiny_llada(tok, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128).save_pretrained(
        tmp_path / "fp")
    tok.save_pretrained(tmp_path / "fp")
    calib = [(tok(q)["input_ids"], tok(a)["input_ids"]) for q, a in [("12+34=", "046"), ("5+6=", "011")] * 4]
    torch.cuda.reset_peak_memory_stats()
    report = quantize_model(str(tmp_path / "fp"), str(tmp_path / "q"), calib, [c[0] for c in calib[:4]],
                            tok.pad_token_id, tok.mask_token_id, w_bits=4, a_bits=4, weighting="fair", probes=8,
                            window=256, floor_frac=0.01, beta=1.0, lambda1=1.0, gen_length=3, block_length=3,
                            steps=3, epochs=3, lr=1e-2, batch_size=4, seed=0, transform="kron", device="cuda",
                            dtype="bfloat16")
    assert report["device"] == "cuda" and torch.cuda.max_memory_allocated() > 0
    assert all(b["loss_after"] <= b["loss_before"] for b in report["blocks"])
    assert json.loads((tmp_path / "q" / "config.json").read_text())["dtype"] == "bfloat16"
