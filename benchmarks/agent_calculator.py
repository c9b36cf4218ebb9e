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
from pathlib import Path

from recipe_runs import heldout_curve, run_recipe, seed_sweep_parser

RECIPE = "recipes/agent_calculator_tiny.yaml"


def run_seed(seed: int, args: argparse.Namespace) -> dict:
    out_dir = Path(args.runs_dir) / f"seed{seed}"
    summary = run_recipe(RECIPE, [f"seed={seed}", *args.overrides], out_dir, f"seed {seed}")
    metrics = summary["metrics"]
    return {"seed": seed, "accuracy_before_rl": summary["accuracy_before_rl"],
            "accuracy_after_rl": summary["accuracy_after_rl"],
            "gain": summary["accuracy_after_rl"] - summary["accuracy_before_rl"], "heldout_curve": heldout_curve(out_dir),
            "train_reward": [m["reward/mean"] for m in metrics], "turns_mean": [m["env/turns_mean"] for m in metrics],
            "failed_turns": sum(m["env/failed_turns"] for m in metrics),
            "step1_mismatch_abs_diff": metrics[0].get("actor/mismatch_abs_diff"),
            "rl_wall_s": summary["rl_wall_s"], "total_wall_s": summary["wall_s"]}


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
    args = seed_sweep_parser("agent_calculator", [0, 1, 2], "recipe overrides").parse_args()
    results = []
    for seed in args.seeds:
        results.append(run_seed(seed, args))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("train_reward", "turns_mean")}),
              flush=True)
    mean = lambda k: statistics.mean(r[k] for r in results)  # noqa: E731
    report = {"recipe": RECIPE, "overrides": args.overrides, "per_seed": results,
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
