"""On-policy distillation against GRPO from the same start: held-out accuracy per step, three seeds.

    python benchmarks/distillation.py [--seeds 0 1 2] [--steps 60] [--eval-every 10] [--teacher-run DIR]

The teacher is the quickstart run of seed 0 (`recipes/quickstart.yaml`: SFT warm-up, then 60 GRPO steps; made
first unless `--teacher-run` names one): its exported policy (`hf_model`). Every arm starts from that run's SFT
checkpoint (`sft_model`, the student) on that run's RL and held-out splits, with the quickstart's RL settings:

* `grpo`: the quickstart's GRPO on the math reward;
* `distill`: the teacher's per-token log-probabilities of the student's samples alone
  (`algorithm.teacher_path`, `distill_reward_weight: 0`: the reward is computed and logged, not trained on);
* `distill_reward`: both (`distill_reward_weight: 1`).

Held-out accuracy (greedy, the 200-problem held-out split the teacher was measured on) every `--eval-every`
steps; recorded per arm and seed: the curve, the first evaluated step at which the student reaches the
teacher's accuracy (and 90 % of it), and the final accuracy. Results: `benchmarks/results/distillation.json`
and `distillation.png`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from recipe_runs import heldout_curve

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"grpo": [], "distill": ["algorithm.distill_reward_weight=0"], "distill_reward": []}


def looprl_run(overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "cluster.cli", "run", str(ROOT / "recipes/quickstart.yaml"),
           "logging.progress_bar=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"looprl run {' '.join(overrides)} failed with exit code {proc.returncode}")


def first_reaching(points: list[tuple[int, float]], level: float) -> int | None:
    return next((step for step, acc in points if acc >= level), None)


def run_arm(arm: str, seed: int, teacher_run: Path, args: argparse.Namespace) -> dict:
    out_dir = Path(args.runs_dir) / f"{arm}_seed{seed}"
    teacher = ["algorithm.teacher_path=" + str(teacher_run / "hf_model")] if arm != "grpo" else []
    looprl_run([f"seed={seed}", f"output_dir={out_dir}", f"model.path={teacher_run / 'sft_model'}",
                "sft.enabled=false", f"data.train_path={teacher_run / 'data/train.jsonl'}",
                f"data.eval_path={teacher_run / 'data/eval.jsonl'}", f"trainer.steps={args.steps}",
                f"trainer.eval_every={args.eval_every}", "trainer.save_hf=false", *teacher, *ARMS[arm]])
    return {"arm": arm, "seed": seed, "curve": heldout_curve(out_dir)}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in ARMS:
        runs = [r["curve"] for r in report["runs"] if r["arm"] == arm]
        steps = [s for s, _ in runs[0]]
        means = [statistics.mean(dict(c)[s] for c in runs) for s in steps]
        ax.plot(steps, means, marker="o", label=f"{arm} (mean of {len(runs)} seeds)")
    ax.axhline(report["teacher_accuracy"], color="grey", ls="--", label="teacher")
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("on-policy distillation vs GRPO from the same SFT start")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--teacher-run", default=None, help="a finished quickstart run (hf_model, sft_model, data/)")
    p.add_argument("--runs-dir", default=str(ROOT / "runs/distillation"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/distillation.json"))
    args = p.parse_args()
    teacher_run = Path(args.teacher_run) if args.teacher_run else Path(args.runs_dir) / "teacher"
    if not (teacher_run / "hf_model").is_dir():
        looprl_run(["seed=0", f"output_dir={teacher_run}"])
    teacher_acc = json.loads((teacher_run / "summary.json").read_text())["accuracy_after_rl"]
    runs = []
    for seed in args.seeds:
        for arm in ARMS:
            row = run_arm(arm, seed, teacher_run, args)
            row.update(reaches_teacher_at=first_reaching(row["curve"], teacher_acc),
                       reaches_90pct_at=first_reaching(row["curve"], 0.9 * teacher_acc), final=row["curve"][-1][1])
            runs.append(row)
            print(json.dumps(row), flush=True)
    report = {"teacher_accuracy": teacher_acc, "student_start": "quickstart seed 0 sft_model",
              "steps": args.steps, "eval_every": args.eval_every, "runs": runs,
              "final_mean": {arm: statistics.mean(r["final"] for r in runs if r["arm"] == arm) for arm in ARMS}}
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, Path(args.out).with_suffix(".png"))
    print(json.dumps(report["final_mean"]))


if __name__ == "__main__":
    main()
