"""Long-tailed response lengths: synchronous, one-step-off and partial rollouts, samples trained per second.

    python benchmarks/streaming.py [--seeds 0 1 2] [--steps 8]

A labelled synthetic throughput harness: the quickstart recipe on a tiny model made in code without SFT, whose
responses end at a stop string (`7` or `8`, about one token in fifty), so lengths are geometric with a long tail up
to `rollout.max_new_tokens` 192 (the mean near 45, a few percent of responses at the cap): a synchronous step waits
for its longest response. Reward: the share of digits in the response (a dense signal; no accuracy is claimed).
Arms, at equal cores (2 threads per role, the roles taking turns or overlapping as each mode does):

* `sync`: every response generated to its end within its step (`trainer.max_staleness: 0`);
* `one_step_off`: the next step's rollout generated while this one trains (`max_staleness: 1`);
* `partial`: `rollout.partial_tokens: 24`, a pool of 16 open groups, tokens at most 2 versions old.

Recorded per arm and seed: samples trained per second and response tokens per second over all N steps (the work
a partial run leaves in its pool at the end is counted in its time, not in its samples), the mean response
length, the mean token age.

    python benchmarks/streaming.py --workload long_tail [--seeds 0 1 2] [--steps 40] [--sft-run DIR]

The same arms on a task whose long answers are needed, with held-out accuracy against wall time:
`recipes/streaming_long_tail_tiny.yaml` (the quickstart's a+b*c= task where one problem in eight chains eight
products and needs about six times the work; math-verify reward). Every arm and seed starts from one SFT
checkpoint (the recipe's SFT warm-up with seed 0, made first unless `--sft-run` names a run that has one) on
that run's RL and held-out splits; the seed varies the RL sampling. Arms: `sync`, `one_step_off`, `in_flight`
(one-step-off with weights swapped in between decode steps, `rollout.in_flight_updates`) and `partial` (the
recipe's partial rollouts: 64 tokens a round, 32 open groups, tokens at most 2 versions old). Held-out accuracy
(greedy, 200 problems) every `--eval-every` steps against the run's elapsed wall time (`perf/elapsed_s`,
evaluations included: every arm runs the same evaluations); samples trained per second over the steps' own
time (`perf/step_s`, as above; for the one-step-off arms the generation that runs during an evaluation is not in
it, a credit of at most one step's generation per evaluation; sync and partial submit nothing ahead), the mean
response length of the trained samples (partial rollouts train the short answers first), the mean token age.

Results: `benchmarks/results/streaming.json` (one section per workload) and `streaming.png` (long_tail).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.recipe_runs import run_recipe  # noqa: E402
from benchmarks.weight_sync import cpu_kind  # noqa: E402

WORKLOAD = ["sft.enabled=false", "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
            "model.tiny.intermediate_size=128", "model.tiny.max_position_embeddings=256", "rollout.n=4",
            "trainer.prompts_per_step=8", "rollout.max_new_tokens=192", "rollout.stop=['7','8']",
            "learner.micro_batch_size=32", "learner.lr=1e-3", "algorithm.is_correction=token",
            "data.synthetic.num_train=400", "data.synthetic.num_eval=8", "trainer.save_hf=false",
            "logging.progress_bar=false", "logging.tensorboard=false"]
ARMS = {"sync": ["trainer.max_staleness=0"], "one_step_off": ["trainer.max_staleness=1"],
        "partial": ["rollout.partial_tokens=24", "rollout.partial_groups=16", "trainer.max_staleness=2"]}


def run_arm(arm: str, seed: int, args: argparse.Namespace, reward: str) -> dict:
    out = Path(args.runs_dir) / f"{arm}_seed{seed}"
    shutil.rmtree(out, ignore_errors=True)  # a finished run in place would be reused, not timed again
    metrics = run_recipe("recipes/quickstart.yaml", [f"seed={seed}", f"trainer.steps={args.steps}", reward,
                                                     *WORKLOAD, *ARMS[arm]], out, f"{arm} seed {seed}")["metrics"]
    # every step, the first too: partial rollouts open twice the groups a step takes at their first step, and
    # leaving that step out would credit them with the work it did ahead
    seconds = sum(m["perf/step_s"] for m in metrics)
    samples = sum(m["batch/samples"] for m in metrics)
    tokens = sum(m["perf/tokens"] for m in metrics)
    return {"arm": arm, "seed": seed, "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
            "step_s_mean": seconds / len(metrics),
            "length_mean": statistics.mean(m["response/length_mean"] for m in metrics),
            "token_age_mean": statistics.mean(m.get("rollout/token_staleness_mean", m["rollout/staleness"])
                                              for m in metrics),
            "reward_last": metrics[-1]["reward/mean"]}


LONG_TAIL_RECIPE = "recipes/streaming_long_tail_tiny.yaml"
LONG_TAIL_ARMS = {"sync": ["rollout.partial_tokens=0", "trainer.max_staleness=0"],
                  "one_step_off": ["rollout.partial_tokens=0", "trainer.max_staleness=1"],
                  "in_flight": ["rollout.partial_tokens=0", "trainer.max_staleness=1",
                                "rollout.in_flight_updates=true"],
                  "partial": []}  # the recipe's partial rollouts


def sft_checkpoint(args: argparse.Namespace) -> Path:
    """The run whose SFT checkpoint every long-tail arm starts from: `--sft-run`, made (seed 0, the recipe's SFT
    and one RL step) when it has none."""
    run = Path(args.sft_run)
    if not (run / "sft_model").exists():
        print(f"SFT warm-up into {run} (about 15 min on 2 cores)", flush=True)
        run_recipe(LONG_TAIL_RECIPE, ["seed=0", "trainer.steps=1", "trainer.save_hf=false"], run, "SFT warm-up")
    return run


def long_tail_row(arm: str, seed: int, summary: dict) -> dict:
    """One long-tail run's figures (from `run_recipe`'s summary and metrics): its accuracy curve against steps and
    elapsed wall time, its throughput."""
    metrics = summary["metrics"]
    curve = [{"step": 0, "elapsed_s": 0.0, "accuracy": summary["accuracy_before_rl"]}]
    curve += [{"step": m["step"], "elapsed_s": m["perf/elapsed_s"], "accuracy": m["eval/accuracy"]}
              for m in metrics if "eval/accuracy" in m]
    # the last step: evaluated after the stage (accuracy_after_rl), after its elapsed time
    curve.append({"step": metrics[-1]["step"], "elapsed_s": metrics[-1]["perf/elapsed_s"],
                  "accuracy": summary["accuracy_after_rl"]})
    step_s = sum(m["perf/step_s"] for m in metrics)
    return {"arm": arm, "seed": seed, "curve": curve, "samples_per_s": sum(m["batch/samples"] for m in metrics) / step_s,
            "tokens_per_s": sum(m["perf/tokens"] for m in metrics) / step_s, "train_s": step_s, "elapsed_s": metrics[-1]["perf/elapsed_s"],
            "eval_s": sum(m.get("time/eval", 0.0) for m in metrics),
            "length_mean": statistics.mean(m["response/length_mean"] for m in metrics),
            "token_age_mean": statistics.mean(m.get("rollout/token_staleness_mean", m["rollout/staleness"])
                                              for m in metrics),
            "stale_tokens_dropped": sum(m.get("rollout/stale_tokens_dropped", 0.0) for m in metrics),
            "accuracy_final": summary["accuracy_after_rl"], "reward_last": metrics[-1]["reward/mean"]}


def accuracy_by(curve: list[dict], seconds: float) -> float:
    """The accuracy of the last evaluation a run had made within `seconds` of wall time."""
    return [p["accuracy"] for p in curve if p["elapsed_s"] <= seconds + 1e-9][-1]


def run_long_tail(args: argparse.Namespace) -> dict:
    sft = sft_checkpoint(args)
    start = [f"model.path={sft / 'sft_model'}", "sft.enabled=false", f"data.train_path={sft / 'data/train.jsonl'}",
             f"data.eval_path={sft / 'data/eval.jsonl'}", f"trainer.steps={args.steps}",
             f"trainer.eval_every={args.eval_every}", "trainer.save_hf=false", "logging.tensorboard=false"]
    rows = []
    for seed in args.seeds:
        for arm, overrides in LONG_TAIL_ARMS.items():  # alternating within each seed, as above
            out = Path(args.runs_dir) / f"long_tail_{arm}_seed{seed}"
            shutil.rmtree(out, ignore_errors=True)  # a finished run in place would be reused, not timed again
            summary = run_recipe(LONG_TAIL_RECIPE, [f"seed={seed}", *start, *overrides], out, f"{arm} seed {seed}")
            rows.append(long_tail_row(arm, seed, summary))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    summary = {}
    sync = {r["seed"]: r for r in rows if r["arm"] == "sync"}
    # accuracy at equal wall time: each seed's shortest run, so that every arm has got that far
    shortest = {s: min(r["elapsed_s"] for r in rows if r["seed"] == s) for s in args.seeds}
    for arm in LONG_TAIL_ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        summary[arm] = {"samples_per_s": statistics.mean(r["samples_per_s"] for r in mine),
                        "vs_sync": statistics.mean(r["samples_per_s"] / sync[r["seed"]]["samples_per_s"] for r in mine),
                        "tokens_vs_sync": statistics.mean(r["tokens_per_s"] / sync[r["seed"]]["tokens_per_s"]
                                                          for r in mine),
                        "elapsed_vs_sync": statistics.mean(r["elapsed_s"] / sync[r["seed"]]["elapsed_s"] for r in mine),
                        "accuracy_final": statistics.mean(r["accuracy_final"] for r in mine),
                        "accuracy_at_equal_wall": statistics.mean(accuracy_by(r["curve"], shortest[r["seed"]])
                                                                  for r in mine),
                        "length_mean": statistics.mean(r["length_mean"] for r in mine),
                        "token_age_mean": statistics.mean(r["token_age_mean"] for r in mine)}
    return {"cpu": cpu_kind(), "recipe": LONG_TAIL_RECIPE, "sft_run": str(sft), "steps": args.steps,
            "arms": LONG_TAIL_ARMS, "rows": rows, "summary": summary}


def plot_long_tail(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11.2, 4.2))
    for i, arm in enumerate(report["arms"]):
        for r in (r for r in report["rows"] if r["arm"] == arm):
            first = r["seed"] == report["rows"][0]["seed"]
            for ax, x in zip(axes, ("elapsed_s", "step")):
                ax.plot([p[x] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], "o-", color=f"C{i}",
                        alpha=0.75, label=arm if first else None)
    axes[0].set(title="held-out accuracy against wall time (3 seeds)", xlabel="seconds (evaluations included)",
                ylabel="held-out accuracy")
    axes[1].set(title="held-out accuracy against RL steps", xlabel="step", ylabel="held-out accuracy")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_synthetic(args: argparse.Namespace) -> dict:
    Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
    plugin = Path(args.runs_dir) / "digits.py"
    plugin.write_text("def digits(prompt, response, **kw):\n"
                      "    return sum(c.isdigit() for c in response) / max(1, len(response))\n")
    reward = f"reward.functions=[{{name: '{plugin}:digits'}}]"
    rows = []
    for seed in args.seeds:
        for arm in ARMS:  # the arms alternate within each seed, so drift of the machine shows in every arm
            rows.append(run_arm(arm, seed, args, reward))
            print(json.dumps(rows[-1]), flush=True)
    summary = {arm: {"samples_per_s": statistics.mean(r["samples_per_s"] for r in rows if r["arm"] == arm),
                     "vs_sync": statistics.mean(r["samples_per_s"] / s["samples_per_s"] for r in rows
                                                if r["arm"] == arm for s in rows
                                                if s["arm"] == "sync" and s["seed"] == r["seed"])}
               for arm in ARMS}
    return {"cpu": cpu_kind(), "workload": WORKLOAD, "arms": ARMS, "rows": rows, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=["synthetic", "long_tail"], default="synthetic")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="RL steps a run (synthetic 8, long_tail 40)")
    p.add_argument("--eval-every", type=int, default=10, help="long_tail: steps between held-out evaluations")
    p.add_argument("--runs-dir", default=str(ROOT / "runs/streaming"))
    p.add_argument("--sft-run", default=str(ROOT / "runs/streaming/long_tail_sft"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/streaming.json"))
    args = p.parse_args()
    args.steps = args.steps or (8 if args.workload == "synthetic" else 40)
    section = run_synthetic(args) if args.workload == "synthetic" else run_long_tail(args)
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    report[args.workload] = section
    out.write_text(json.dumps(report, indent=1))
    if args.workload == "long_tail":
        plot_long_tail(section, out.with_suffix(".png"))
    print(json.dumps(section["summary"], indent=1))


if __name__ == "__main__":
    main()
