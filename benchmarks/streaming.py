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
length, the mean token age. Results:
`benchmarks/results/streaming.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    cmd = [sys.executable, "-m", "cluster.cli", "run", str(ROOT / "recipes/quickstart.yaml"), f"seed={seed}",
           f"output_dir={out}", f"trainer.steps={args.steps}", reward, *WORKLOAD, *ARMS[arm]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{arm} seed {seed} failed")
    # every step, the first too: partial rollouts open twice the groups a step takes at their first step, and
    # leaving that step out would credit them with the work it did ahead
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = sum(m["perf/step_s"] for m in metrics)
    samples = sum(m["batch/samples"] for m in metrics)
    tokens = sum(m["perf/tokens"] for m in metrics)
    return {"arm": arm, "seed": seed, "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
            "step_s_mean": seconds / len(metrics),
            "length_mean": statistics.mean(m["response/length_mean"] for m in metrics),
            "token_age_mean": statistics.mean(m.get("rollout/token_staleness_mean", m["rollout/staleness"])
                                              for m in metrics),
            "reward_last": metrics[-1]["reward/mean"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--runs-dir", default=str(ROOT / "runs/streaming"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/streaming.json"))
    args = p.parse_args()
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
    report = {"cpu": cpu_kind(), "workload": WORKLOAD, "arms": ARMS, "rows": rows, "summary": summary}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
