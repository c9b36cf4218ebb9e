"""Shared by the benchmark scripts: run one recipe as `looprl run` in a subprocess and read its outputs."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(recipe: str, overrides: list[str], out_dir: Path, name: str) -> dict:
    """`looprl run ROOT/recipe output_dir=out_dir *overrides`; exits with its stderr tail if the run fails.
    Returns `summary.json` plus `metrics` (the rows of `metrics.jsonl`) and `wall_s`. Every stage runs: the stage
    records an earlier run left in `out_dir` (`stages/NAME.json`) are removed first (the stage runner would reuse a
    stage whose record matches the recipe and its inputs, and the code is not part of that record: a rerun after a
    code change would report the earlier run's results); the stages' artifacts stay, for runs that name them."""
    for record in (out_dir / "stages").glob("*.json"):
        record.unlink()
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "cluster.cli", "run", str(ROOT / recipe), f"output_dir={out_dir}",
           "logging.progress_bar=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{name} failed with exit code {proc.returncode}")
    summary = json.loads((out_dir / "summary.json").read_text())
    metrics = out_dir / "metrics.jsonl"  # none when the run trained no RL step (e.g. an SFT-only run)
    summary["metrics"] = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    summary["wall_s"] = time.perf_counter() - t0
    return summary


def heldout_curve(out_dir: Path) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of a run: before RL, every evaluation during it, after the last step."""
    summary = json.loads((out_dir / "summary.json").read_text())
    points = [(0, summary["accuracy_before_rl"])]
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "eval/accuracy" in m:
            points.append((int(m["step"]), m["eval/accuracy"]))
    points.append((int(summary["steps"]), summary["accuracy_after_rl"]))
    return sorted(dict(points).items())


def seed_sweep_parser(name: str, seeds: list[int], overrides_help: str) -> argparse.ArgumentParser:
    """The options every recipe benchmark takes: `--seeds`, `--out` (benchmarks/results/NAME.json),
    `--runs-dir` (runs/NAME) and recipe overrides; a script adds its own."""
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=seeds)
    p.add_argument("--out", default=str(ROOT / f"benchmarks/results/{name}.json"))
    p.add_argument("--runs-dir", default=str(ROOT / f"runs/{name}"))
    p.add_argument("overrides", nargs="*", help=overrides_help)
    return p


def window_mean(rows: list[dict], key: str, first: bool, n: int) -> float:
    """Mean of `key` over the first (or last) `n` metric rows that have it (NaN when none does)."""
    part = rows[:n] if first else rows[-n:]
    vals = [r[key] for r in part if key in r]
    return statistics.mean(vals) if vals else float("nan")


def held_out_report(per_seed: list[dict], models: list[str], measures, pairs: list[tuple[str, str]]) -> dict:
    """Held-out measures of several policies on the same prompts, each seed's `row["held_out"][model][measure]`
    a per-prompt list: means pooled over (seed, prompt), means per seed, and each pair (a, b) compared over the
    (seed, prompt) pairs (`rl.evaluate.paired_comparison`: mean difference, 95% interval, paired t-test)."""
    import numpy as np

    from rl.evaluate import paired_comparison
    pooled = {m: {k: np.concatenate([np.asarray(r["held_out"][m][k]) for r in per_seed])[None, :] for k in measures}
              for m in models}
    return {"held_out_mean": {m: {k: float(pooled[m][k].mean()) for k in measures} for m in models},
            "held_out_mean_per_seed": {m: {k: [float(np.mean(r["held_out"][m][k])) for r in per_seed]
                                           for k in measures} for m in models},
            "paired": {f"{a}_vs_{b}": {k: paired_comparison(pooled[a][k], pooled[b][k]) for k in measures}
                       for a, b in pairs}}



def method_figures(path: Path, data: dict, drawers: dict) -> list[Path]:
    """One PNG per method beside `path` (`<stem>_<method>.png`), at most three panels a row, so that each reads on
    a page. `drawers` maps a method to `(panels, draw)`; `draw(data, axes)` fills its panels and titles them."""
    import math

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    for name, (panels, draw) in drawers.items():
        cols = 2 if panels == 4 else min(panels, 3)
        rows = math.ceil(panels / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 4.2 * rows), squeeze=False)
        draw(data, list(axes.ravel()))
        for ax in list(axes.ravel())[panels:]:
            ax.set_visible(False)
        fig.tight_layout()
        written.append(path.with_name(f"{path.stem}_{name}.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def write_report(report: dict, out: str, plot) -> None:
    """Write `report` as JSON to `out`, its figure (`plot(report, path)`) beside it as PNG, and print its summary."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    plot(report, path.with_suffix(".png"))
    print(json.dumps(report["summary"], indent=1))
