"""TGPO against GSPO and GRPO where rewards give partial credit (the setting of rl/methods/tgpo/README.md), several seeds.

    python benchmarks/tgpo_partial_credit.py [--seeds 0 1 2] [--out benchmarks/results/tgpo_partial_credit.json]

Per seed the quickstart's SFT warm-up runs once; every arm then starts from that checkpoint with the same budget
and trains on `digit_credit` (the share of the answer's digits right in place, 1 only when exact), with exact
`math` correctness logged at weight 0:
  * `tgpo`: recipes/algos/tgpo.yaml (geometric-mean anchor, Gaussian trust gate, trust-weighted negatives);
  * `tgpo_no_trust`: the same with `w_min: 1` (every trajectory fully trusted) — isolates the trust weighting;
  * `gspo`: recipes/algos/gspo.yaml (the sequence-level ratio TGPO anchors on);
  * `grpo`: recipes/algos/grpo.yaml.
Measured on the held-out problems (greedy): exact accuracy and mean digit credit per problem, compared pairwise
over (seed, problem) pairs (paired t-test, 95% interval of the mean difference). TGPO is a reconstruction
(rl/methods/tgpo/README.md: no primary source could be read), so the direction it should show is the spec's design intent:
keeping imperfect trajectories, down-weighted, should not do worse than GSPO/GRPO on partial-credit rewards.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from recipe_runs import held_out_report, run_recipe, seed_sweep_parser

REWARD = "reward.functions=[{name: digit_credit, weight: 1.0}, {name: math, weight: 0.0}]"
ARMS = {"tgpo": ("recipes/algos/tgpo.yaml", []),
        "tgpo_no_trust": ("recipes/algos/tgpo.yaml", ["algorithm.loss_params.w_min=1.0"]),
        "gspo": ("recipes/algos/gspo.yaml", []),
        "grpo": ("recipes/algos/grpo.yaml", [])}
PAIRS = [("tgpo", "gspo"), ("tgpo", "grpo"), ("tgpo", "tgpo_no_trust")]
HELD_OUT = {"exact": "math", "credit": "digit_credit"}


def _held_out(record: Path) -> dict[str, list[float]]:
    rows = json.loads(record.read_text())["per_sample"]
    return {k: [float(r["components"].get(c, 0.0)) for r in rows] for k, c in HELD_OUT.items()}


def main() -> None:
    p = seed_sweep_parser("tgpo_partial_credit", [0, 1, 2], "recipe overrides applied to every arm")
    args = p.parse_args()
    per_seed = []
    for seed in args.seeds:
        base = Path(args.runs_dir) / f"seed{seed}"
        # the SFT policy is evaluated with the arms' reward functions, so "before" has both held-out measures
        sft = run_recipe("recipes/quickstart.yaml", [f"seed={seed}", "trainer.steps=0", "trainer.save_hf=false",
                                                     REWARD, *args.overrides], base / "sft", f"sft seed {seed}")
        row = {"seed": seed, "sft_wall_s": sft["wall_s"], "held_out": {"before": _held_out(base / "sft" /
                                                                                         "eval_before.json")}}
        for arm, (recipe, extra) in ARMS.items():
            run_recipe(recipe, [f"seed={seed}", f"model.path={base / 'sft' / 'sft_model'}", "sft.enabled=false",
                                "trainer.save_hf=false", REWARD, *extra, *args.overrides], base / arm,
                       f"{arm} seed {seed}")
            row["held_out"][arm] = _held_out(base / arm / "eval_after.json")
        print(json.dumps({"seed": seed, "means": {m: {k: float(np.mean(v)) for k, v in h.items()}
                                                  for m, h in row["held_out"].items()}}), flush=True)
        per_seed.append(row)
    report = {"reward": REWARD, "arms": {a: {"recipe": r, "overrides": e} for a, (r, e) in ARMS.items()},
              "seeds": args.seeds, "overrides": args.overrides, "per_seed": per_seed,
              **held_out_report(per_seed, ["before", *ARMS], HELD_OUT, PAIRS)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("held_out_mean", "paired")}, indent=1))


if __name__ == "__main__":
    main()
