"""RLTT vs GRPO on a tiny looped model, identical budgets, several seeds: final-loop and per-loop accuracy.

    python benchmarks/rltt_vs_grpo.py [--seeds 0 1 2] [--out benchmarks/results/rltt_vs_grpo.json] [key=value ...]

Per seed: `recipes/rltt_tiny.yaml` runs the SFT warm-up (which trains the final loop's readout) and then
three arms from that same SFT checkpoint with the same RL budget (steps, prompts, samples, learning rate, KL
coefficient):
  * `rltt`: RLTT with exit-pdf loop weights (KL k3 in the loss);
  * `rltt_last`: the same loss, the same KL placement, loop weights one-hot on the final loop — the arm that
    isolates loop credit (everything else is RLTT's);
  * `grpo`: the released baseline, crediting the final loop only (`ppo_clip`, KL k1 in the reward).
Afterwards the SFT checkpoint and the final policies are read out greedily after every loop t on the held-out
problems (`cluster.math_eval`, `exit_at_step=t`); per-problem correctness is kept, and every pair of arms is
compared per loop by a paired t-test over (seed, problem) pairs with the 95% interval of the mean difference.
The paper's claims, in direction: RLTT >= GRPO on final-loop accuracy, and RLTT raises intermediate-loop
accuracy more. The JSON records every number; a PNG shows per-loop accuracy averaged over seeds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from omegaconf import OmegaConf
from recipe_runs import run_recipe, seed_sweep_parser

RECIPE = "recipes/rltt_tiny.yaml"
ARMS = {
    "rltt": [],
    "rltt_last": ["algorithm.loss_params={loop_weighting: last}"],
    "grpo": ["algorithm.loss=ppo_clip", "algorithm.loss_params={eps_low: 0.2, eps_high: 0.2}",
             "algorithm.kl_in_reward=true", "algorithm.kl_estimator=k1"],
}
PAIRS = [("rltt", "grpo"), ("rltt", "rltt_last"), ("rltt_last", "grpo")]


def _per_loop(model: Path, data: Path, loops: int, max_new_tokens: int) -> dict[str, list[float]]:
    """Greedy per-problem correctness after each loop t (`exit_at_step=t`)."""
    from cluster.math_eval import MathEvalConfig, MathEvaluator
    cfg = MathEvalConfig(problem_column="prompt", answer_column="answer", max_new_tokens=max_new_tokens,
                         device="cpu", batch_size=256)
    ev = MathEvaluator(str(model), cfg, str(data))
    try:
        return {str(t): ev.run(temperature=0.0, top_p=1.0, seed=0, exit_at_step=t).tolist()
                for t in range(1, loops + 1)}
    finally:
        ev.close()


def main() -> None:
    import numpy as np

    from rl.evaluate import paired_comparison
    p = seed_sweep_parser("rltt_vs_grpo", [0, 1, 2], "recipe overrides applied to every arm")
    p.add_argument("--loops", type=int, default=4, help="model.tiny.loops of the recipe")
    args = p.parse_args()
    rows = []
    for seed in args.seeds:
        base = Path(args.runs_dir) / f"seed{seed}"
        common = [f"seed={seed}", f"model.tiny.loops={args.loops}", *args.overrides]
        runs = {"rltt": run_recipe(RECIPE, common, base / "rltt", f"rltt seed {seed}")}
        sft_model = base / "rltt" / "sft_model"
        for arm in ("rltt_last", "grpo"):
            runs[arm] = run_recipe(RECIPE, [*common, f"model.path={sft_model}", "sft.enabled=false", *ARMS[arm]],
                                   base / arm, f"{arm} seed {seed}")
        data = base / "rltt" / "data" / "eval.jsonl"
        max_new = int(OmegaConf.load(base / "rltt" / "config.yaml").rollout.max_new_tokens)
        correct = {"before": _per_loop(sft_model, data, args.loops, max_new)}
        correct.update({arm: _per_loop(Path(r["hf_model"]), data, args.loops, max_new) for arm, r in runs.items()})
        row = {"seed": seed, "correct": correct,
               "per_loop": {m: {t: float(np.mean(v)) for t, v in c.items()} for m, c in correct.items()},
               "final_before": runs["rltt"]["accuracy_before_rl"],
               **{f"final_{arm}": r["accuracy_after_rl"] for arm, r in runs.items()},
               **{f"{arm}_wall_s": r["wall_s"] for arm, r in runs.items()}}
        print(json.dumps({k: v for k, v in row.items() if k != "correct"}), flush=True)
        rows.append(row)
    loops = [str(t) for t in range(1, args.loops + 1)]
    models = ["before", *ARMS]
    mean = {m: {t: statistics.mean(r["per_loop"][m][t] for r in rows) for t in loops} for m in models}
    # paired over (seed, problem): the same held-out problems, each arm read out greedily
    pooled = {m: {t: np.concatenate([np.asarray(r["correct"][m][t]) for r in rows])[None, :] for t in loops}
              for m in models}
    paired = {f"{a}_vs_{b}": {t: paired_comparison(pooled[a][t], pooled[b][t]) for t in loops} for a, b in PAIRS}
    report = {"recipe": RECIPE, "overrides": args.overrides, "seeds": args.seeds, "arms": ARMS,
              "per_seed": rows, "mean_per_loop": mean,
              "mean_final": {k: statistics.mean(r[k] for r in rows)
                             for k in ("final_before", *(f"final_{a}" for a in ARMS))},
              "mean_gain_per_loop": {m: {t: mean[m][t] - mean["before"][t] for t in loops} for m in ARMS},
              "paired": paired}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    _plot(report, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "per_seed"}, indent=1))


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for key, label in [("before", "before RL (SFT)"), ("grpo", "GRPO (released baseline)"),
                       ("rltt_last", "RLTT loss, final loop only"), ("rltt", "RLTT (exit pdf)")]:
        xs = sorted(report["mean_per_loop"][key], key=int)
        ax.plot([int(x) for x in xs], [report["mean_per_loop"][key][x] for x in xs], marker="o", label=label)
    ax.set_xticks(sorted(int(t) for t in report["mean_per_loop"]["before"]))
    ax.set_xlabel("readout after loop t (greedy)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"tiny looped model, mean over seeds {report['seeds']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
