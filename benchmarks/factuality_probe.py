"""The factuality reward-hacking probe at tiny scale: precision-only vs the full reward.

    python benchmarks/factuality_probe.py [--seeds 0 1] [--out benchmarks/results/factuality_probe.json] [key=value ...]

Per seed, `recipes/factuality_tiny.yaml` (lam 0.1, mu 0.1) runs the SFT warm-up and RL; the precision-only
run (`recipes/factuality_tiny_precision_only.yaml`, lam 0, mu 0) starts from the same SFT checkpoint with
the same RL budget. Recorded per run, from the reward's logged components: claims per answer (T),
supported claims (F) and precision (F/T), averaged over the first and the last `--window` RL steps. The
paper's claim, in direction: precision-only RL shrinks the number of claims; the full reward keeps it up.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from recipe_runs import run_recipe, seed_sweep_parser, window_mean

KEYS = {"claims": "reward/factuality/claims", "supported": "reward/factuality/supported",
        "precision": "reward/factuality/precision", "format_ok": "reward/factuality/format_ok",
        "reward": "reward/mean"}


def main() -> None:
    p = seed_sweep_parser("factuality_probe", [0, 1], "recipe overrides applied to both runs")
    p.add_argument("--window", type=int, default=5, help="RL steps averaged at the start and at the end")
    args = p.parse_args()
    table = []
    for seed in args.seeds:
        base = Path(args.runs_dir) / f"seed{seed}"
        full = run_recipe("recipes/factuality_tiny.yaml", [f"seed={seed}", *args.overrides], base / "full",
                          f"full reward seed {seed}")
        sft = base / "full" / "sft_model"
        data = base / "full" / "data"
        shared = [f"seed={seed}", f"model.path={sft}", "sft.enabled=false", f"data.train_path={data / 'train.jsonl'}",
                  f"data.eval_path={data / 'eval.jsonl'}", *args.overrides]
        prec = run_recipe("recipes/factuality_tiny_precision_only.yaml",
                    [*shared, f"reward.functions=[{{name: factuality, params: {{corpus: '{data / 'corpus.txt'}', "
                              f"lam: 0.0, mu: 0.0, min_claim_words: 3}}}}]"], base / "precision_only",
                          f"precision-only seed {seed}")
        for name, res in (("full (lam 0.1, mu 0.1)", full), ("precision only", prec)):
            row = {"seed": seed, "reward": name, "wall_s": res["wall_s"]}
            for k, key in KEYS.items():
                row[f"{k}_start"] = window_mean(res["metrics"], key, True, args.window)
                row[f"{k}_end"] = window_mean(res["metrics"], key, False, args.window)
            print(json.dumps(row), flush=True)
            table.append(row)
    summary = {}
    for name in sorted({r["reward"] for r in table}):
        rows = [r for r in table if r["reward"] == name]
        summary[name] = {f"{k}_{w}": statistics.mean(r[f"{k}_{w}"] for r in rows) for k in KEYS for w in ("start", "end")}
    report = {"recipes": ["recipes/factuality_tiny.yaml", "recipes/factuality_tiny_precision_only.yaml"],
              "overrides": args.overrides, "seeds": args.seeds, "window": args.window, "per_run": table,
              "mean": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
