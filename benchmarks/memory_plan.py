"""The memory plan (`looprl plan`, `cluster/plan.py`) for two published models on 80 GiB GPUs, from their released
`config.json` values alone, beside published figures.

    python benchmarks/memory_plan.py [--out benchmarks/results/memory_plan.json]

Scenarios (GRPO, bf16, prompts of 1,024 and responses of 3,072 tokens, 4 sequences a micro-batch, gradient
checkpointing, colocated learner and vLLM engine at 40% of the device, as OpenRLHF's colocated examples run):
Qwen2.5-7B full fine-tuning at ZeRO 1/2/3 on 8 GPUs; Llama-3.1-70B full fine-tuning at ZeRO-3 on 8, 32 and 64
GPUs, and with tensor-parallel engines (32 learner GPUs beside 4 engines of 8 GPUs, split placement); Qwen2.5-7B
with 16k-token responses without and with sequence parallelism over 4 ranks. Recorded: each role's items and each device's peak, whether it fits, and the change `looprl plan` names.
Published figures to compare with: 16 bytes a trained parameter for mixed-precision Adam (the ZeRO paper, Rajbhandari
et al. 2020), the models' parameter counts and their KV cache per token (bf16).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "Qwen2.5-7B": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "Llama-3.1-70B": {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
                      "tie_word_embeddings": False},
}
PUBLISHED = {"Qwen2.5-7B": {"params": 7.61e9, "kv_bytes_per_token_bf16": 57344},
             "Llama-3.1-70B": {"params": 70.6e9, "kv_bytes_per_token_bf16": 327680}}
COMMON = ["model.dtype=bfloat16", "model.gradient_checkpointing=true", "rollout.engine=vllm",
          "rollout.max_new_tokens=3072", "learner.micro_batch_size=4", "algorithm.kl_coef=0.001",
          "rollout.engine_params={vllm: {gpu_memory_utilization: 0.4}}"]
LONG = ["rollout.max_new_tokens=16384", "learner.micro_batch_size=1", "learner.attn_implementation=sdpa"]
# (model, GPUs, ZeRO stage, overrides beyond COMMON); colocated unless the overrides say split
SCENARIOS = [("Qwen2.5-7B", 8, 1, []), ("Qwen2.5-7B", 8, 2, []), ("Qwen2.5-7B", 8, 3, []),
             ("Llama-3.1-70B", 8, 3, []), ("Llama-3.1-70B", 32, 3, []), ("Llama-3.1-70B", 64, 3, []),
             # 70B with tensor-parallel engines: 32 learner GPUs and 4 engines of 8 GPUs each, split placement
             ("Llama-3.1-70B", 64, 3, ["cluster.placement=split", "learner.world_size=32", "rollout.num_workers=4",
                                       "rollout.tensor_parallel_size=8",
                                       "rollout.engine_params={vllm: {gpu_memory_utilization: 0.9}}"]),
             # 7B with 16k-token responses, one sequence a micro-batch: without and with sequence parallelism
             ("Qwen2.5-7B", 8, 3, LONG), ("Qwen2.5-7B", 8, 3, [*LONG, "learner.sequence_parallel_size=4"])]


def main() -> None:
    from cluster.plan import GIB, Devices, make_plan, suggest_fix
    from models.memory import kv_bytes_per_token
    from rl import config
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/memory_plan.json"))
    args = p.parse_args()
    report = {"published": PUBLISHED, "models": {}, "scenarios": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in CONFIGS.items():
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(cfg))
        for name, gpus, zero, extra in SCENARIOS:
            folder = Path(tmp) / name
            recipe = config.load(ROOT / "recipes/quickstart.yaml", [
                f"model.path={folder}", *COMMON, f"learner.world_size={gpus}", f"rollout.num_workers={gpus}",
                f"learner.zero_stage={zero}", *extra])
            devices = Devices(gpus // 8, 8, 80.0)
            plan = make_plan(recipe, devices, 1024)
            report["models"][name] = {"params": plan.shape.params, "counted": plan.shape.counted,
                                      "kv_bytes_per_token_bf16": kv_bytes_per_token(plan.shape, 2)}
            row = {"model": name, "gpus": gpus, "zero_stage": zero, "overrides": extra,
                   "roles": {r.role: {k: round(v / GIB, 2) for k, v in r.items.items()} for r in plan.roles},
                   "device_peak_gib": {what: round(need / GIB, 1) for what, need in plan.loads},
                   "problems": plan.problems,
                   "fix": suggest_fix(recipe, devices, 1024, plan.shape) if plan.problems else None}
            report["scenarios"].append(row)
            print(json.dumps({k: row[k] for k in ("model", "gpus", "zero_stage", "overrides", "device_peak_gib", "problems",
                                                  "fix")}), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
