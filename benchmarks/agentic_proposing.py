"""Agentic Proposing at tiny scale: does MGPO make the proposer's problems more often valid and more often
solvable-but-hard, do its problems train a better solver, and do step rewards help over trajectory rewards alone?

    python benchmarks/agentic_proposing.py [--seeds 0 1 2] [--out benchmarks/results/agentic_proposing.json] [key=value ...]

A labelled synthetic harness (`rl/methods/agentic_proposing/task.py`): `recipes/agentic_proposer_tiny.yaml` teaches one tiny model
made in code to propose arithmetic compositions of skills with tools, to solve them and to verify them. The SFT
runs once (seed 0); every seed then runs, from that model, with the same RL budget:
  * `mgpo`: MGPO (lambda_step 0.5), trajectory and step rewards;
  * `grpo`: lambda_step 0, the trajectory reward alone (the same estimator, so the same validity gate);
and the untrained proposer (the SFT model). Each proposer then feeds the `agentic_proposing` stage:
`--proposals` episodes, the valid problems solved by rejection sampling, the first `--solver-rows` of them
fine-tune the same base solver (the SFT model), evaluated on the task's held-out solver set.
Recorded per seed and arm: per RL step the share of valid problems (`verified`), the share of valid problems in
the solvable-but-hard band (`in_band`, rho in [0.125, 0.875]), the prober's pass rate; per proposer the valid
share of its proposals and the solver's held-out accuracy before and after fine-tuning. The paper's claims, in
direction: validity and the hard-band share rise over RL steps; a solver trained on the RL-trained proposer's
problems beats one trained on as many problems from the untrained proposer.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from recipe_runs import run_recipe, seed_sweep_parser, window_mean, write_report

RECIPE = "recipes/agentic_proposer_tiny.yaml"
ARMS = {"mgpo": 0.5, "grpo": 0.0}
KEYS = {"verified": "reward/agentic_proposing/verified", "in_band": "reward/agentic_proposing/in_band",
        "pass_rate": "reward/agentic_proposing/pass_rate", "reward": "reward/mean"}


def _solver_stage(args, seed: int) -> str:
    return ("{name: agentic_proposing, params: {"
            f"proposals: {args.proposals}, k: 8, max_rows: {args.solver_rows}, steps: {args.solver_steps}, "
            f"batch_size: 16, lr: 5.0e-4, seed: {seed}}}}}")


def main() -> None:
    p = seed_sweep_parser("agentic_proposing", [0, 1, 2], "recipe overrides applied to every run")
    p.add_argument("--proposals", type=int, default=256, help="episodes per proposer for the solver set")
    p.add_argument("--solver-rows", type=int, default=48, help="problems each solver is fine-tuned on")
    p.add_argument("--solver-steps", type=int, default=60, help="fine-tuning steps of each solver")
    p.add_argument("--window", type=int, default=5, help="RL steps averaged at the start and the end")
    args = p.parse_args()
    runs = Path(args.runs_dir)
    first = runs / "sft"
    run_recipe(RECIPE, ["stages=[{name: model}, {name: data}, {name: sft}]", *args.overrides], first, "SFT")
    model = first / "sft_model"
    report = {"recipe": RECIPE, "seeds": args.seeds, "overrides": args.overrides, "sft_model": str(model),
              "proposals": args.proposals, "solver_rows": args.solver_rows, "per_seed": []}
    common = [f"model.path={model}", "sft.enabled=false"]
    for seed in args.seeds:
        row: dict = {"seed": seed, "arms": {}}
        untrained = run_recipe(RECIPE, [*common, f"seed={seed}", *args.overrides,
                                        f"stages=[{{name: model}}, {{name: data}}, {_solver_stage(args, seed)}]"],
                               runs / f"seed{seed}" / "untrained", f"untrained proposer, seed {seed}")
        row["untrained"] = untrained["agentic_proposing"]
        for arm, lam in ARMS.items():
            res = run_recipe(RECIPE, [*common, f"seed={seed}", f"algorithm.advantage_params.lambda_step={lam}",
                                      *args.overrides,
                                      "stages=[{name: model}, {name: data}, {name: rl}, {name: export}, "
                                      f"{_solver_stage(args, seed)}]"],
                             runs / f"seed{seed}" / arm, f"{arm}, seed {seed}")
            m = res["metrics"]
            row["arms"][arm] = {"curves": {k: [r.get(key) for r in m] for k, key in KEYS.items()},
                                "first": {k: window_mean(m, key, True, args.window) for k, key in KEYS.items()},
                                "last": {k: window_mean(m, key, False, args.window) for k, key in KEYS.items()},
                                "solver": res["agentic_proposing"], "wall_s": res["wall_s"]}
        report["per_seed"].append(row)
        print(json.dumps({"seed": seed, "untrained_solver": row["untrained"]["solver_accuracy_after"],
                          **{a: {"first": v["first"], "last": v["last"],
                                 "solver": v["solver"]["solver_accuracy_after"]} for a, v in row["arms"].items()}}),
              flush=True)
    report["summary"] = summarize(report)
    write_report(report, args.out, _plot)


def summarize(report: dict) -> dict:
    rows = report["per_seed"]

    def mean_sd(values: list[float]) -> dict:
        values = [v for v in values if v == v]
        return {"mean": statistics.mean(values) if values else float("nan"),
                "sd": statistics.stdev(values) if len(values) > 1 else 0.0, "per_seed": values}
    out = {"untrained": {"valid_frac": mean_sd([r["untrained"]["valid_frac"] for r in rows]),
                         "solver_before": mean_sd([r["untrained"]["solver_accuracy_before"] for r in rows]),
                         "solver_after": mean_sd([r["untrained"]["solver_accuracy_after"] for r in rows]),
                         "sft_rows": [r["untrained"]["sft_rows"] for r in rows]}}
    for arm in ARMS:
        a = [r["arms"][arm] for r in rows]
        out[arm] = {**{f"{k}_first": mean_sd([x["first"][k] for x in a]) for k in KEYS},
                    **{f"{k}_last": mean_sd([x["last"][k] for x in a]) for k in KEYS},
                    "valid_frac": mean_sd([x["solver"]["valid_frac"] for x in a]),
                    "solver_after": mean_sd([x["solver"]["solver_accuracy_after"] for x in a]),
                    "solver_gain_over_untrained": mean_sd([x["solver"]["solver_accuracy_after"] -
                                                           r["untrained"]["solver_accuracy_after"]
                                                           for x, r in zip(a, rows)]),
                    "sft_rows": [x["solver"]["sft_rows"] for x in a]}
    return out


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"mgpo": "tab:blue", "grpo": "tab:orange"}
    for ax, key, label in ((axes[0], "verified", "share of valid problems"),
                           (axes[1], "in_band", "valid problems with 0.125 <= rho <= 0.875")):
        for arm in ARMS:
            for r in report["per_seed"]:
                ys = r["arms"][arm]["curves"][key]
                ax.plot(range(1, len(ys) + 1), [y if y is not None else float("nan") for y in ys],
                        color=colors[arm], alpha=0.35, linewidth=1)
            ax.plot([], [], color=colors[arm], label=f"{arm} (one line per seed)")
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"Agentic Proposing, tiny model ({len(report['per_seed'])} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
