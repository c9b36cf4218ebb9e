"""`looprl plot RUN_DIR`: reward, KL, response length and the step-time breakdown as one PNG."""

from __future__ import annotations

from pathlib import Path

from rl.loop.tracking import read_metrics

PHASES = ("generate", "reward", "logprobs", "train", "sync", "other")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl with any step to plot")
    steps = [r["step"] for r in rows]

    def series(key):
        return [r.get(key) if r.get(key) is not None else float("nan") for r in rows]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0, 0]
    ax.plot(steps, series("reward/mean"), label="train reward")
    if any("eval/accuracy" in r for r in rows):
        ev = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
        ax.plot(*zip(*ev), "o-", label="held-out accuracy")
    ax.set_title("reward")
    ax.legend()
    ax = axes[0, 1]
    # KL to the reference when one is loaded (kl_coef > 0), else the policy entropy
    kl_key = "actor/kl" if any("actor/kl" in r for r in rows) else "actor/entropy"
    ax.plot(steps, series(kl_key))
    ax.set_title(kl_key)
    ax = axes[1, 0]
    ax.plot(steps, series("response/length_mean"))
    ax.set_title("response length (tokens)")
    ax = axes[1, 1]
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        vals = [v if v == v else 0.0 for v in series(f"time/{phase}")]
        ax.bar(steps, vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("step time breakdown (s)")
    ax.legend(fontsize=8)
    for a in axes.flat:
        a.set_xlabel("step")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out_path = Path(out) if out else run_dir / "metrics.png"
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path
