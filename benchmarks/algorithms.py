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
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGOS = sorted(p.stem for p in (ROOT / "recipes/algos").glob("*.yaml"))


def _run(recipe: Path, overrides: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "run", str(recipe), "logging.progress_bar=false",
                           "logging.tensorboard=false", *overrides], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{recipe.name} {overrides} failed ({proc.returncode})")


def _tail_mean(rows: list[dict], key: str, k: int = 5) -> float | None:
    vals = [r[key] for r in rows[-k:] if r.get(key) is not None]
    return statistics.mean(vals) if vals else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algos", nargs="+", default=ALGOS, choices=ALGOS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--runs-dir", default=str(ROOT / "runs/algos_bench"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/algorithms.json"))
    p.add_argument("--merge", action="store_true",
                   help="keep the algorithms already recorded in --out (same seeds) and add or replace these")
    args = p.parse_args()
    runs = Path(args.runs_dir)
    results: dict[str, list[dict]] = {a: [] for a in args.algos}
    for seed in args.seeds:
        sft_dir = runs / f"sft_seed{seed}"
        # a finished run left there would be reused: its stages' records match
        shutil.rmtree(sft_dir, ignore_errors=True)
        _run(ROOT / "recipes/quickstart.yaml", [f"seed={seed}", f"output_dir={sft_dir}", "trainer.steps=0",
                                                "trainer.save_hf=false"])
        for algo in args.algos:
            out = runs / f"{algo}_seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            _run(ROOT / f"recipes/algos/{algo}.yaml", [f"seed={seed}", f"output_dir={out}", "sft.enabled=false",
                                                      f"model.path={sft_dir / 'sft_model'}", "trainer.save_hf=false"])
            s = json.loads((out / "summary.json").read_text())
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            row = {"seed": seed, "accuracy_before_rl": s["accuracy_before_rl"], "accuracy_after_rl": s["accuracy_after_rl"],
                   "reward_last5": _tail_mean(rows, "reward/mean"), "entropy_last5": _tail_mean(rows, "actor/entropy"),
                   "kl_to_old_last5": _tail_mean(rows, "actor/approx_kl_old"), "rl_wall_s": s["rl_wall_s"],
                   "run_wall_s": time.perf_counter() - t0, "reward_curve": [r["reward/mean"] for r in rows]}
            results[algo].append(row)
            print(json.dumps({"algo": algo, **{k: v for k, v in row.items() if k != "reward_curve"}}), flush=True)
    if args.merge and Path(args.out).exists():
        previous = json.loads(Path(args.out).read_text())
        if previous["seeds"] != args.seeds:
            raise SystemExit(f"--merge: {args.out} was recorded with seeds {previous['seeds']}, not {args.seeds}")
        results = {**{a: r for a, r in previous["runs"].items() if a not in results}, **results}
        results = dict(sorted(results.items()))
    table = {}
    for algo, rows in results.items():
        def mean(key, rows=rows):
            vals = [r[key] for r in rows if r[key] is not None]
            return statistics.mean(vals) if vals else None
        table[algo] = {"accuracy_before_rl": mean("accuracy_before_rl"), "accuracy_after_rl": mean("accuracy_after_rl"),
                       "gain_points": 100 * (mean("accuracy_after_rl") - mean("accuracy_before_rl")),
                       "reward_last5": mean("reward_last5"), "entropy_last5": mean("entropy_last5"),
                       "kl_to_old_last5": mean("kl_to_old_last5"), "rl_wall_s": mean("rl_wall_s")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seeds": args.seeds, "table": table, "runs": results}, indent=2))
    lines = ["| algorithm | acc before | acc after | gain (pts) | reward (last 5) | entropy | KL to old | RL wall s |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f="{:.3f}": "n/a" if v is None else f.format(v)  # noqa: E731
    for algo, t in table.items():
        lines.append(f"| {algo} | {fmt(t['accuracy_before_rl'])} | {fmt(t['accuracy_after_rl'])} | "
                     f"{fmt(t['gain_points'], '{:+.1f}')} | {fmt(t['reward_last5'])} | {fmt(t['entropy_last5'])} | "
                     f"{fmt(t['kl_to_old_last5'], '{:.2e}')} | {fmt(t['rl_wall_s'], '{:.0f}')} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for algo, rows in results.items():
        curves = [r["reward_curve"] for r in rows]
        n = min(len(c) for c in curves)
        ax.plot(range(1, n + 1), [statistics.mean(c[i] for c in curves) for i in range(n)], label=algo)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train reward (mean over seeds {args.seeds})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=90)


if __name__ == "__main__":
    main()
