"""Shared by the benchmark scripts: run one recipe as `looprl run` in a subprocess and read its outputs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(recipe: str, overrides: list[str], out_dir: Path, name: str) -> dict:
    """`looprl run ROOT/recipe output_dir=out_dir *overrides`; exits with its stderr tail if the run fails.
    Returns `summary.json` plus `metrics` (the rows of `metrics.jsonl`) and `wall_s`."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "rl.cli", "run", str(ROOT / recipe), f"output_dir={out_dir}",
           "logging.progress_bar=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{name} failed with exit code {proc.returncode}")
    summary = json.loads((out_dir / "summary.json").read_text())
    summary["metrics"] = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    summary["wall_s"] = time.perf_counter() - t0
    return summary
