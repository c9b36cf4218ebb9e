"""RL driven by an agent program written outside looprl learns the calculator task: three seeds.

    python benchmarks/agent_calculator.py [--seeds 0 1 2] [overrides ...]

Each seed is a full `looprl run recipes/agent_calculator_tiny.yaml seed=S`: a tiny model built in code is taught
calculator-tool conversations (half of them write the wrong order of operations), then GRPO runs with every
episode driven by `recipes/extending/agent.py` over plain HTTP against the rollout worker's OpenAI-compatible
endpoint; the agent computes the policy's expression, the policy boxes the tool's value and the agent reports
the reward. Held-out accuracy (greedy, through the same agent, 100 problems) before RL and every 5 steps, the
training reward per step, and the endpoint's check that the learner's logprobs of the served tokens are the
engine's (`actor/mismatch_abs_diff`, step 1). Results: `benchmarks/results/agent_calculator.json` and `.png`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/agent_calculator_tiny.yaml"


def run_seed(seed: int, args: argparse.Namespace) -> dict:
    out_dir = Path(args.runs_dir) / f"seed{seed}"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "cluster.cli", "run", str(RECIPE), f"seed={seed}", f"output_dir={out_dir}",
           "logging.progress_bar=false", *args.overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"seed {seed} failed with exit code {proc.returncode}")
    summary = json.loads((out_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    heldout = [(0, summary["accuracy_before_rl"])] + [(int(m["step"]), m["eval/accuracy"]) for m in metrics
                                                       if "eval/accuracy" in m]
    heldout = sorted(dict(heldout + [(int(summary["steps"]), summary["accuracy_after_rl"])]).items())
    return {"seed": seed, "accuracy_before_rl": summary["accuracy_before_rl"],
            "accuracy_after_rl": summary["accuracy_after_rl"],
            "gain": summary["accuracy_after_rl"] - summary["accuracy_before_rl"], "heldout_curve": heldout,
            "train_reward": [m["reward/mean"] for m in metrics], "turns_mean": [m["env/turns_mean"] for m in metrics],
            "failed_turns": sum(m["env/failed_turns"] for m in metrics),
            "step1_mismatch_abs_diff": metrics[0].get("actor/mismatch_abs_diff"),
            "rl_wall_s": summary["rl_wall_s"], "total_wall_s": time.perf_counter() - t0}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        steps, acc = zip(*r["heldout_curve"])
        left.plot(steps, acc, marker="o", label=f"seed {r['seed']}")
        right.plot(range(1, len(r["train_reward"]) + 1), r["train_reward"], label=f"seed {r['seed']}")
    left.set(xlabel="RL step", ylabel="held-out accuracy (greedy, via the agent)", ylim=(0, 1.02))
    right.set(xlabel="RL step", ylabel="training reward (agent-reported, T=1)", ylim=(0, 1.02))
    left.legend()
    fig.suptitle("GRPO driven by an outside agent program over the OpenAI-compatible endpoint (calculator task)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/agent_calculator.json"))
    p.add_argument("--runs-dir", default=str(ROOT / "runs/agent_calculator"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    results = []
    for seed in args.seeds:
        results.append(run_seed(seed, args))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("train_reward", "turns_mean")}),
              flush=True)
    mean = lambda k: statistics.mean(r[k] for r in results)  # noqa: E731
    report = {"recipe": str(RECIPE.relative_to(ROOT)), "overrides": args.overrides, "per_seed": results,
              "mean_accuracy_before_rl": mean("accuracy_before_rl"), "mean_accuracy_after_rl": mean("accuracy_after_rl"),
              "mean_gain_points": 100 * mean("gain"), "seeds_improved": sum(r["gain"] > 0 for r in results),
              "mean_total_wall_s": mean("total_wall_s")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(results, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "per_seed"}))


if __name__ == "__main__":
    main()
