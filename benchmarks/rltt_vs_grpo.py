"""RLTT vs GRPO on a tiny looped model, identical budgets, several seeds: final-loop and per-loop accuracy.

    python benchmarks/rltt_vs_grpo.py [--seeds 0 1 2] [--out benchmarks/results/rltt_vs_grpo.json] [key=value ...]

Per seed: `recipes/rltt_tiny.yaml` runs the SFT warm-up (which trains the final loop's readout) and then
RLTT (exit-pdf loop weights); the GRPO run starts from that same SFT checkpoint with the same RL budget
(steps, prompts, samples, learning rate, KL coefficient) and credits the final loop only (`ppo_clip`,
KL in the reward, as the released baseline). Afterwards the SFT checkpoint and both final policies are
read out greedily after every loop t on the held-out problems (`rl.math_eval`, `exit_at_step=t`).
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
GRPO = ["algorithm.loss=ppo_clip", "algorithm.loss_params={eps_low: 0.2, eps_high: 0.2}",
        "algorithm.kl_in_reward=true", "algorithm.kl_estimator=k1"]


def _per_loop(model: Path, data: Path, loops: int, max_new_tokens: int) -> dict[str, float]:
    from rl.math_eval import MathEvalConfig, MathEvaluator
    cfg = MathEvalConfig(problem_column="prompt", answer_column="answer", max_new_tokens=max_new_tokens,
                         device="cpu", batch_size=256)
    ev = MathEvaluator(str(model), cfg, str(data))
    try:
        return ev.per_loop(list(range(1, loops + 1)))
    finally:
        ev.close()


def main() -> None:
    p = seed_sweep_parser("rltt_vs_grpo", [0, 1, 2], "recipe overrides applied to both methods")
    p.add_argument("--loops", type=int, default=4, help="model.tiny.loops of the recipe")
    args = p.parse_args()
    rows = []
    for seed in args.seeds:
        base = Path(args.runs_dir) / f"seed{seed}"
        common = [f"seed={seed}", f"model.tiny.loops={args.loops}", *args.overrides]
        rltt = run_recipe(RECIPE, common, base / "rltt", f"rltt seed {seed}")
        sft_model = base / "rltt" / "sft_model"
        grpo = run_recipe(RECIPE, [*common, f"model.path={sft_model}", "sft.enabled=false", *GRPO], base / "grpo",
                          f"grpo seed {seed}")
        data = base / "rltt" / "data" / "eval.jsonl"
        max_new = int(OmegaConf.load(base / "rltt" / "config.yaml").rollout.max_new_tokens)
        row = {"seed": seed,
               "per_loop_before": _per_loop(sft_model, data, args.loops, max_new),
               "per_loop_rltt": _per_loop(Path(rltt["hf_model"]), data, args.loops, max_new),
               "per_loop_grpo": _per_loop(Path(grpo["hf_model"]), data, args.loops, max_new),
               "final_before": rltt["accuracy_before_rl"], "final_rltt": rltt["accuracy_after_rl"],
               "final_grpo": grpo["accuracy_after_rl"], "rltt_wall_s": rltt["wall_s"], "grpo_wall_s": grpo["wall_s"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    loops = [str(t) for t in range(1, args.loops + 1)]
    mean = {k: {t: statistics.mean(r[k][t] for r in rows) for t in loops}
            for k in ("per_loop_before", "per_loop_rltt", "per_loop_grpo")}
    report = {"recipe": RECIPE, "overrides": args.overrides, "seeds": args.seeds,
              "per_seed": rows, "mean_per_loop": mean,
              "mean_final": {k: statistics.mean(r[k] for r in rows) for k in ("final_before", "final_rltt", "final_grpo")},
              "mean_gain_per_loop": {m: {t: mean[f"per_loop_{m}"][t] - mean["per_loop_before"][t] for t in loops}
                                     for m in ("rltt", "grpo")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    _plot(report, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "per_seed"}, indent=1))


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for key, label in [("per_loop_before", "before RL (SFT)"), ("per_loop_grpo", "GRPO"), ("per_loop_rltt", "RLTT")]:
        xs = sorted(report["mean_per_loop"][key], key=int)
        ax.plot([int(x) for x in xs], [report["mean_per_loop"][key][x] for x in xs], marker="o", label=label)
    ax.set_xticks(sorted(int(t) for t in report["mean_per_loop"]["per_loop_before"]))
    ax.set_xlabel("readout after loop t (greedy)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"tiny looped model, mean over seeds {report['seeds']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
