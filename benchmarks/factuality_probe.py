"""The factuality reward-hacking probe at tiny scale: which terms of the reward keep answers detailed.

    python benchmarks/factuality_probe.py [--seeds 0 1 2] [--out benchmarks/results/factuality_probe.json] [key=value ...]

Per seed, `recipes/factuality_tiny.yaml` runs the SFT warm-up once; four RL arms then start from that same SFT
checkpoint with the same RL budget and differ only in the reward's weights, `Pre + lam log(1 + F) + mu J`:
  * `released`: lam 0, mu 0.1 — the released configuration (precision and the relevance judge);
  * `precision_only`: lam 0, mu 0 — the hackable baseline;
  * `detail_no_relevance`: lam 0.1, mu 0 — the claim-count term without the relevance judge;
  * `full`: lam 0.1, mu 0.1.
Measured on the held-out prompts (greedy, after RL, and before RL for the SFT policy): claims per answer (T),
supported claims (F), precision (F/T) and relevance (J), per prompt; every pair of interest is compared by a
paired t-test over (seed, prompt) pairs with the 95% interval of the mean difference. The paper's claims, in
direction: precision-only RL shrinks the number of claims; the relevance term alone keeps it up.
Training-sample means over the first and last `--window` RL steps are recorded too.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
from recipe_runs import held_out_report, run_recipe, seed_sweep_parser, window_mean

RECIPE = "recipes/factuality_tiny.yaml"
ARMS = {"released": (0.0, 0.1), "precision_only": (0.0, 0.0), "detail_no_relevance": (0.1, 0.0),
        "full": (0.1, 0.1)}
PAIRS = [("released", "precision_only"), ("full", "detail_no_relevance"), ("released", "full")]
HELD_OUT = ("claims", "supported", "precision", "relevance")
TRAIN_KEYS = {"claims": "reward/factuality/claims", "supported": "reward/factuality/supported",
              "precision": "reward/factuality/precision", "reward": "reward/mean"}


def _reward(corpus: Path, lam: float, mu: float) -> str:
    return (f"reward.functions=[{{name: factuality, params: {{corpus: '{corpus}', lam: {lam}, mu: {mu}, "
            f"min_claim_words: 3}}}}]")


def _held_out(record: Path) -> dict[str, list[float]]:
    """Per held-out prompt: the factuality components of its greedy answer (an invalid answer has no claims)."""
    rows = json.loads(record.read_text())["per_sample"]
    return {k: [float(r["components"].get(f"factuality/{k}", 0.0)) for r in rows] for k in HELD_OUT}


def main() -> None:
    p = seed_sweep_parser("factuality_probe", [0, 1, 2], "recipe overrides applied to every arm")
    p.add_argument("--window", type=int, default=5, help="RL steps averaged at the start and at the end")
    args = p.parse_args()
    per_seed = []
    for seed in args.seeds:
        base = Path(args.runs_dir) / f"seed{seed}"
        first = next(iter(ARMS))
        corpus = base / first / "data" / "corpus.txt"
        runs = {first: run_recipe(RECIPE, [f"seed={seed}", _reward(corpus, *ARMS[first]), *args.overrides],
                                  base / first, f"{first} seed {seed}")}
        data = base / first / "data"
        shared = [f"seed={seed}", f"model.path={base / first / 'sft_model'}", "sft.enabled=false",
                  f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}", *args.overrides]
        for arm, (lam, mu) in ARMS.items():
            if arm != first:
                runs[arm] = run_recipe(RECIPE, [*shared, _reward(corpus, lam, mu)], base / arm, f"{arm} seed {seed}")
        row = {"seed": seed, "held_out": {"before": _held_out(base / first / "eval_before.json")},
               "train": {}, "wall_s": {arm: r["wall_s"] for arm, r in runs.items()}}
        for arm, res in runs.items():
            row["held_out"][arm] = _held_out(base / arm / "eval_after.json")
            row["train"][arm] = {f"{k}_{w}": window_mean(res["metrics"], key, w == "start", args.window)
                                 for k, key in TRAIN_KEYS.items() for w in ("start", "end")}
        print(json.dumps({"seed": seed, "held_out_means": {m: {k: float(np.mean(v)) for k, v in h.items()}
                                                           for m, h in row["held_out"].items()}}), flush=True)
        per_seed.append(row)
    report = {"recipe": RECIPE, "arms": {a: {"lam": lam, "mu": mu} for a, (lam, mu) in ARMS.items()},
              "overrides": args.overrides, "seeds": args.seeds, "window": args.window, "per_seed": per_seed,
              **held_out_report(per_seed, ["before", *ARMS], HELD_OUT, PAIRS),
              "train_mean": {arm: {k: statistics.mean(r["train"][arm][k] for r in per_seed)
                                   for k in per_seed[0]["train"][arm]} for arm in ARMS}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("held_out_mean", "paired")}, indent=1))


if __name__ == "__main__":
    main()
