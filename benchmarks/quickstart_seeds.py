"""Held-out accuracy before and after RL for the quickstart recipe over several seeds.

    python benchmarks/quickstart_seeds.py [--seeds 0 1 2] [--out benchmarks/results/quickstart_seeds.json]

Each seed is a full `looprl run recipes/quickstart.yaml seed=S` (tiny model built in code, SFT
warm-up, GRPO on held-apart problems); the JSON records accuracy before/after per seed and the mean gain.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/quickstart_seeds.json"))
    p.add_argument("--runs-dir", default=str(ROOT / "runs/quickstart_seeds"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    results = []
    for seed in args.seeds:
        out_dir = Path(args.runs_dir) / f"seed{seed}"
        # a finished run left there would be reused (its stages' records match) and report its metrics again
        shutil.rmtree(out_dir, ignore_errors=True)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "cluster.cli", "run", str(ROOT / "recipes/quickstart.yaml"), f"seed={seed}",
               f"output_dir={out_dir}", "logging.progress_bar=false", *args.overrides]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"seed {seed} failed with exit code {proc.returncode}")
        s = json.loads((out_dir / "summary.json").read_text())
        row = {"seed": seed, "accuracy_before_rl": s["accuracy_before_rl"], "accuracy_after_rl": s["accuracy_after_rl"],
               "gain": s["accuracy_after_rl"] - s["accuracy_before_rl"], "final_train_reward": s["reward/mean"],
               "sft_wall_s": s.get("sft_wall_s"), "rl_wall_s": s["rl_wall_s"], "total_wall_s": time.perf_counter() - t0}
        print(json.dumps(row), flush=True)
        results.append(row)
    mean = lambda k: sum(r[k] for r in results) / len(results)  # noqa: E731
    report = {"recipe": "recipes/quickstart.yaml", "overrides": args.overrides, "per_seed": results,
              "mean_accuracy_before_rl": mean("accuracy_before_rl"), "mean_accuracy_after_rl": mean("accuracy_after_rl"),
              "mean_gain_points": 100 * mean("gain"), "mean_total_wall_s": mean("total_wall_s")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "per_seed"}))


if __name__ == "__main__":
    main()
