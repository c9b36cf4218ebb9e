"""Compare the policy-optimization recipes in recipes/algos/ on the quickstart task, over several seeds.

    python benchmarks/algorithms.py [--algos grpo dr_grpo ...] [--seeds 0 1 2]

For each seed the SFT warm-up runs once (the quickstart recipe with no RL steps); every algorithm then
starts from that same warmed-up model with the same budget (steps, prompts, group size). Writes
benchmarks/results/algorithms.json, a markdown table (algorithms.md) and reward curves (algorithms.png).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from recipe_runs import run_recipe

ROOT = Path(__file__).resolve().parents[1]
ALGOS = sorted(p.stem for p in (ROOT / "recipes/algos").glob("*.yaml"))


def _tail_mean(rows: list[dict], key: str, k: int = 5) -> float | None:
    vals = [r[key] for r in rows[-k:] if r.get(key) is not None]
    return statistics.mean(vals) if vals else None


def run_algorithm(algo: str, seed: int, sft_dir: Path, runs: Path) -> dict:
    """One algorithm's recipe from the seed's warmed-up model: accuracy before and after RL, the last 5 steps'
    reward, entropy and KL to the old policy, wall times and the reward curve."""
    out = runs / f"{algo}_seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    run = run_recipe(f"recipes/algos/{algo}.yaml", [f"seed={seed}", "sft.enabled=false", "logging.tensorboard=false",
                                                    f"model.path={sft_dir / 'sft_model'}", "trainer.save_hf=false"],
                     out, f"{algo} (seed {seed})")
    rows = run["metrics"]
    return {"seed": seed, "accuracy_before_rl": run["accuracy_before_rl"], "accuracy_after_rl": run["accuracy_after_rl"],
            "reward_last5": _tail_mean(rows, "reward/mean"), "entropy_last5": _tail_mean(rows, "actor/entropy"),
            "kl_to_old_last5": _tail_mean(rows, "actor/approx_kl_old"), "rl_wall_s": run["rl_wall_s"],
            "run_wall_s": run["wall_s"], "reward_curve": [r["reward/mean"] for r in rows]}


def with_previous(results: dict, out: Path, seeds: list[int]) -> dict:
    """`--merge`: the algorithms recorded in `out` (with the same seeds) that this run did not measure, added."""
    previous = json.loads(out.read_text())
    if previous["seeds"] != seeds:
        raise SystemExit(f"--merge: {out} was recorded with seeds {previous['seeds']}, not {seeds}")
    return dict(sorted({**{a: r for a, r in previous["runs"].items() if a not in results}, **results}.items()))


def summary_table(results: dict) -> dict:
    """Each algorithm's means over seeds."""
    table = {}
    for algo, rows in results.items():
        def mean(key, rows=rows):
            vals = [r[key] for r in rows if r[key] is not None]
            return statistics.mean(vals) if vals else None
        table[algo] = {"accuracy_before_rl": mean("accuracy_before_rl"), "accuracy_after_rl": mean("accuracy_after_rl"),
                       "gain_points": 100 * (mean("accuracy_after_rl") - mean("accuracy_before_rl")),
                       "reward_last5": mean("reward_last5"), "entropy_last5": mean("entropy_last5"),
                       "kl_to_old_last5": mean("kl_to_old_last5"), "rl_wall_s": mean("rl_wall_s")}
    return table


def markdown(table: dict) -> str:
    lines = ["| algorithm | acc before | acc after | gain (pts) | reward (last 5) | entropy | KL to old | RL wall s |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f="{:.3f}": "n/a" if v is None else f.format(v)  # noqa: E731
    for algo, t in table.items():
        lines.append(f"| {algo} | {fmt(t['accuracy_before_rl'])} | {fmt(t['accuracy_after_rl'])} | "
                     f"{fmt(t['gain_points'], '{:+.1f}')} | {fmt(t['reward_last5'])} | {fmt(t['entropy_last5'])} | "
                     f"{fmt(t['kl_to_old_last5'], '{:.2e}')} | {fmt(t['rl_wall_s'], '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def _plot(report: dict, png: Path) -> None:
    """The train reward by step of each algorithm, mean over seeds (`benchmarks/replot.py algorithms`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for algo, rows in report["runs"].items():
        curves = [r["reward_curve"] for r in rows]
        n = min(len(c) for c in curves)
        ax.plot(range(1, n + 1), [statistics.mean(c[i] for c in curves) for i in range(n)], label=algo)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train reward (mean over seeds {report['seeds']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algos", nargs="+", default=ALGOS, choices=ALGOS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--runs-dir", default=str(ROOT / "runs/algos_bench"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/algorithms.json"))
    p.add_argument("--merge", action="store_true",
                   help="keep the algorithms already recorded in --out (same seeds) and add or replace these")
    args = p.parse_args()
    runs, out = Path(args.runs_dir), Path(args.out)
    results: dict[str, list[dict]] = {a: [] for a in args.algos}
    for seed in args.seeds:
        sft_dir = runs / f"sft_seed{seed}"
        # a finished run left there would be reused: its stages' records match
        shutil.rmtree(sft_dir, ignore_errors=True)
        run_recipe("recipes/quickstart.yaml", [f"seed={seed}", "trainer.steps=0", "trainer.save_hf=false",
                                               "logging.tensorboard=false"], sft_dir, f"SFT warm-up (seed {seed})")
        for algo in args.algos:
            row = run_algorithm(algo, seed, sft_dir, runs)
            results[algo].append(row)
            print(json.dumps({"algo": algo, **{k: v for k, v in row.items() if k != "reward_curve"}}), flush=True)
    if args.merge and out.exists():
        results = with_previous(results, out, args.seeds)
    report = {"seeds": args.seeds, "table": summary_table(results), "runs": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report["table"]))
    print(markdown(report["table"]))
    _plot(report, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
