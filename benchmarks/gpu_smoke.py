"""A few GRPO steps on one GPU with each rollout engine and weight-sync path, timings as JSON.

    python benchmarks/gpu_smoke.py [--steps 6] [--out benchmarks/results/gpu_smoke.json]

Needs a CUDA device and `pip install -e ".[dev,gpu]"` (plus `.[vllm]` for the vLLM runs, which are
recorded as skipped without it). Colocated placement (learner and rollout engine share the GPU; vLLM is
capped at `gpu_memory_utilization`), bf16, the quickstart's tiny model widened to a ~85M-parameter one
so the GPU has work to do; synchronous and one-step-off rollout; weights through the object store and
by CUDA IPC (`rollout.weight_sync=cuda_ipc`; NCCL broadcast needs a second GPU, see
tests/cluster/test_gpu.py); the `hf` decode step compiled as one CUDA graph over a static KV cache
(`engine_params.hf.compiled_decode`) against the eager loop and vLLM (`decode_tokens_per_s_vs_eager_hf`); ZeRO-2
with and without the roles taking turns (learner states offloaded while
the engine generates, the engine asleep while the learner trains). Each run's per-phase medians, the weight sync's share of the step, peak
memory per actor and the engine/learner logprob mismatch are recorded; the script exits non-zero if any
run that could run failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model.tiny.hidden_size=768", "model.tiny.num_layers=14", "model.tiny.num_heads=12",
         "model.tiny.intermediate_size=1536", "model.tiny.max_position_embeddings=256"]
VLLM = ["rollout.engine=vllm", "rollout.engine_params={vllm: {gpu_memory_utilization: 0.3}}"]
ASYNC = ["trainer.max_staleness=1", "algorithm.is_correction=token"]
# colocated roles take turns: learner states to host while generating, engine asleep while training
SWAP = ["learner.zero_stage=2", "learner.offload_between_phases=true", "rollout.sleep_between_phases=true"]
RUNS = {
    "hf_sync_object_store": ["rollout.engine=hf"],
    "hf_sync_cuda_ipc": ["rollout.engine=hf", "rollout.weight_sync=cuda_ipc"],
    # the decode step as one compiled graph over a static KV cache, replayed as a CUDA graph (rollout.compiled_decode)
    "hf_sync_cuda_ipc_compiled_decode": ["rollout.engine=hf", "rollout.weight_sync=cuda_ipc",
                                         "rollout.engine_params.hf.compiled_decode=true"],
    "hf_one_step_off_cuda_ipc": ["rollout.engine=hf", "rollout.weight_sync=cuda_ipc", *ASYNC],
    "vllm_sync_cuda_ipc": [*VLLM, "rollout.weight_sync=cuda_ipc"],
    "vllm_one_step_off_cuda_ipc": [*VLLM, "rollout.weight_sync=cuda_ipc", *ASYNC],
    "hf_sync_cuda_ipc_zero2": ["rollout.engine=hf", "rollout.weight_sync=cuda_ipc", "learner.zero_stage=2"],
    "hf_sync_cuda_ipc_swap": ["rollout.engine=hf", "rollout.weight_sync=cuda_ipc", *SWAP],
    "vllm_sync_cuda_ipc_swap": [*VLLM, "rollout.weight_sync=cuda_ipc", *SWAP],
}


def decode_ratios(runs: dict) -> dict[str, float]:
    """Rollout tokens/s of the compiled decode and of vLLM over the eager `hf` loop's, same weight-sync path."""
    base = runs.get("hf_sync_cuda_ipc", {}).get("tokens_per_s_median")
    if not base:
        return {}
    return {name: runs[name]["tokens_per_s_median"] / base
            for name in ("hf_sync_cuda_ipc_compiled_decode", "vllm_sync_cuda_ipc")
            if runs.get(name, {}).get("tokens_per_s_median")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_smoke.json"))
    args = p.parse_args()
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_smoke.py needs a CUDA device")
    report: dict = {"device": torch.cuda.get_device_name(0), "steps": args.steps, "runs": {}}
    failed = False
    for name in args.runs:
        extra = RUNS[name]
        if "rollout.engine=vllm" in extra and importlib.util.find_spec("vllm") is None:
            report["runs"][name] = {"skipped": "vllm is not installed"}
            print(json.dumps({name: report["runs"][name]}), flush=True)
            continue
        out = ROOT / "runs" / "gpu_smoke" / name
        # a finished run left there would be reused (its stages' records match) and report its metrics again
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "run", "recipes/quickstart.yaml", f"output_dir={out}",
             "sft.enabled=false", f"trainer.steps={args.steps}", "trainer.prompts_per_step=16", "rollout.n=8",
             "rollout.max_new_tokens=64", "model.dtype=bfloat16", "trainer.save_hf=false",
             "logging.progress_bar=false", "logging.tensorboard=false", "trainer.eval_max_prompts=32", *MODEL,
             *extra], cwd=ROOT, capture_output=True, text=True)
        entry: dict = {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0}
        if proc.returncode != 0:
            failed = True
            entry["stderr_tail"] = proc.stderr[-3000:]
        else:
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            steady = rows[1:] or rows
            entry.update({
                "step_s_median": statistics.median(r["perf/step_s"] for r in steady),
                "phase_s_median": {k[5:]: statistics.median(r[k] for r in steady)
                                   for k in rows[0] if k.startswith("time/")},
                "weight_load_s_median": statistics.median(r["rollout/weight_load_s"] for r in steady),
                "sync_share_of_step": statistics.median(r["time/sync"] / r["perf/step_s"] for r in steady),
                "mismatch_abs_diff_first_step": rows[0]["actor/mismatch_abs_diff"],
                "tokens_per_s_median": statistics.median(r["perf/tokens_per_s"] for r in steady),
                "peak_rss_gib": json.loads((out / "summary.json").read_text()).get("peak_rss_gib"),
            })
            if "rollout/sync_bytes" in rows[0]:  # the transfer's rate, beside benchmarks/weight_sync.py's CPU figures
                entry["sync_gib_per_s"] = rows[0]["rollout/sync_bytes"] / (1 << 30) / entry["weight_load_s_median"]
            if "time/swap" in rows[0]:  # what the learner keeps on the GPU while the engine generates
                entry["learner_gpu_gib_loaded_offloaded"] = [rows[-1]["memory/learner_gpu_gib_loaded"],
                                                             rows[-1]["memory/learner_gpu_gib_offloaded"]]
        report["runs"][name] = entry
        print(json.dumps({name: entry}, indent=1), flush=True)
    report["decode_tokens_per_s_vs_eager_hf"] = decode_ratios(report["runs"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
