"""The learner's attention kernel on CPU: one GRPO training step of the ~85M model under `sdpa` and `eager`
(`learner.attn_implementation`), alternated in one process so that both see the same machine.

    python benchmarks/learner_attention.py [--rows 64] [--steps 4] [--threads 2] [--dtype bfloat16]

Workload: the race's shapes (prompts of 30 tokens, 64 response tokens, the 85M model of
`benchmarks/grpo_step.py`), one micro-batch of `--rows` sequences, the `ppo_clip` loss, DeepSpeed ZeRO-0 on
one rank. Reports the median step time of each kernel (after one warm-up step) and the ratio.
Results: benchmarks/results/learner_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 768, "num_layers": 14, "num_heads": 12, "intermediate_size": 1536}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/learner_attention.json"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    from cluster.learner import LearnerWorker, free_port
    from models.tiny import save_tiny
    from rl.batch import Batch
    torch.manual_seed(0)
    P, L = 30, 64
    batch = Batch(prompt_ids=torch.randint(5, 100, (args.rows, P)), prompt_mask=torch.ones(args.rows, P, dtype=torch.long),
                  response_ids=torch.randint(5, 100, (args.rows, L)), response_mask=torch.ones(args.rows, L),
                  group_id=torch.arange(args.rows) // 8, advantages=torch.randn(args.rows, L))
    params = {"num_tokens": float(args.rows * L), "num_seqs": float(args.rows)}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny(Path(tmp) / "m", max_position_embeddings=128, **SHAPE)
        worker = LearnerWorker(0, 1, "127.0.0.1", free_port(), str(path), lr=1e-5, dtype=args.dtype,
                               micro_batch_size=args.rows, threads=args.threads)
        times: dict[str, list[float]] = {"sdpa": [], "eager": []}
        for step in range(args.steps + 1):
            for kernel in times:  # alternated: both kernels see the same machine load
                worker.engine.module.set_attn_implementation(kernel)
                t0 = time.perf_counter()
                worker.train_step([batch], "ppo_clip", params)
                if step > 0:  # the first step of each kernel warms up
                    times[kernel].append(time.perf_counter() - t0)
                print(json.dumps({"step": step, "kernel": kernel, "s": time.perf_counter() - t0}), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {"workload": {"rows": args.rows, "prompt_tokens": P, "response_tokens": L, "model": SHAPE,
                           "dtype": args.dtype, "threads": args.threads, "steps": args.steps},
              "step_s": times, "median_step_s": med, "sdpa_over_eager": med["sdpa"] / med["eager"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({"median_step_s": med, "sdpa_over_eager": report["sdpa_over_eager"]}))


if __name__ == "__main__":
    main()
