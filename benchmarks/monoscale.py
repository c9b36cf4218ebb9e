"""MonoScale at tiny scale: J per onboarding round as a pool grows from 3 to 10 agents, for MonoScale's
trust-region memory updates, naive growth and the fixed pool, with a router model taught in code.

    python benchmarks/monoscale.py [--seeds 0 1 2] [--out benchmarks/results/monoscale.json] [key=value ...]

A labelled synthetic harness: `recipes/monoscale_tiny.yaml` teaches a tiny model to route a task by reading the
agent cards and the router memory (`rl/methods/monoscale/task.py`; its fidelity, greedy agreement with the rule it
was taught on fresh contexts, is recorded). The pool is `rl.methods.monoscale.core.make_growing_pool`: three generalists,
then seven specialists that each claim one or two of six task types, about a third of them unreliable (the
claim does not hold). Per seed the same pool grows under the three modes (`rl.methods.monoscale.core.grow_pool`), the router
model routing every task; J is the judged success rate on 300 held-out tasks after each round. The same runs
with the rule itself as the router are recorded beside them. The paper's claims, in direction: naive growth
can lower J; MonoScale's J does not fall and ends above both.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from recipe_runs import run_recipe, seed_sweep_parser, write_report

RECIPE = "recipes/monoscale_tiny.yaml"
MODES = ("monoscale", "naive", "fixed")


def main() -> None:
    from rl.methods.monoscale.core import LMRouter, grow_pool, make_growing_pool
    from rl.methods.monoscale.task import router_rows, teacher_route
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    p = seed_sweep_parser("monoscale", [0, 1, 2], "recipe overrides")
    p.add_argument("--delta", type=float, default=0.2, help="trust region: routing-change rate on replay tasks")
    args = p.parse_args()
    runs = Path(args.runs_dir)
    run_recipe(RECIPE, ["stages=[{name: model}, {name: data}, {name: sft}]", *args.overrides], runs / "sft",
               "router SFT")
    engine = HFEngine(str(runs / "sft" / "sft_model"), attn_implementation="eager")

    def generate(prompts: list[str]) -> list[str]:
        out: list[str] = []
        for i in range(0, len(prompts), 256):
            out += engine.generate(prompts[i:i + 256], SamplingParams(temperature=0.0, max_new_tokens=3)).responses
        return out
    router = LMRouter(generate)
    fresh = router_rows(500, 4242)
    said = generate([r["prompt"] for r in fresh])
    fidelity = sum(s.strip() == r["target"] for s, r in zip(said, fresh)) / len(fresh)
    print(json.dumps({"router_fidelity": fidelity}), flush=True)

    def rule(tasks, memory, cards):
        return [teacher_route(t, memory, cards) for t in tasks]
    report = {"recipe": RECIPE, "seeds": args.seeds, "delta": args.delta, "router_fidelity": fidelity, "per_seed": []}
    for seed in args.seeds:
        pool, cards, kinds = make_growing_pool(seed)
        row = {"seed": seed, "probs": pool.probs, "model": {}, "rule": {}}
        for mode in MODES:
            row["model"][mode] = grow_pool(mode, router, pool, cards, kinds, seed=seed, delta=args.delta)
            row["rule"][mode] = grow_pool(mode, rule, pool, cards, kinds, seed=seed, delta=args.delta)
        report["per_seed"].append(row)
        print(json.dumps({"seed": seed, **{m: [round(j, 3) for j in row["model"][m]["j"]] for m in MODES}}), flush=True)
    report["summary"] = summarize(report)
    write_report(report, args.out, _plot)


def summarize(report: dict) -> dict:
    out = {}
    for router in ("model", "rule"):
        out[router] = {}
        for mode in MODES:
            curves = [r[router][mode]["j"] for r in report["per_seed"]]
            drops = [min(b - a for a, b in zip(c, c[1:])) for c in curves]
            out[router][mode] = {
                "mean_by_round": [statistics.mean(c[k] for c in curves) for k in range(len(curves[0]))],
                "final_mean": statistics.mean(c[-1] for c in curves),
                "final_per_seed": [c[-1] for c in curves],
                "largest_drop_per_seed": drops,
                "accepted_updates": [sum(u["accepted"] for u in r[router][mode]["updates"]) for r in report["per_seed"]]}
    return out


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"monoscale": "tab:blue", "naive": "tab:red", "fixed": "tab:gray"}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in MODES:
        for r in report["per_seed"]:
            js = r["model"][mode]["j"]
            ax.plot(range(3, 3 + len(js)), js, color=colors[mode], alpha=0.3, linewidth=1)
        mean = report["summary"]["model"][mode]["mean_by_round"]
        ax.plot(range(3, 3 + len(mean)), mean, color=colors[mode], linewidth=2.5, label=f"{mode} (mean)")
    ax.set_xlabel("agents in the pool")
    ax.set_ylabel("J (held-out success)")
    ax.set_title(f"MonoScale, tiny router model ({len(report['per_seed'])} seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
