"""MEMO at tiny scale: does the best prompt's win rate rise over generations, and is the run-to-run spread
lower with the memory and prefix replay than without each of them?

    python benchmarks/memo.py [--seeds 0 1 2] [--out benchmarks/results/memo.json] [key=value ...]

A labelled synthetic harness (`rl/methods/memo/task.py`): `recipes/memo_tiny.yaml` teaches a tiny model made
in code to play TicTacToe and Kuhn poker by the strategy hint in its context and to act as the analyzer. The
SFT runs once (seed 0); every seed then runs the recipe's `memo` stages on that model with its own stage
seed: per game, MEMO (memory fed by the games and the replay buffer's decisive positions, prefix replay), the
arm without memory and the arm without prefix replay; replayed games are played beside the schedule, so every
arm rates the same fresh games. Recorded per game,
seed, arm and generation: the best candidate's win rate against the baseline in the evaluation games
(`eval_rounds` × 2 seats, fresh games), its tournament fitness, and the hints in the population. A
calibration run per game plays every hint against the baseline (one generation, the six hints given as
`initial_prompts`), so the table says how good the prompts MEMO found are; the taught model's fidelity
(greedy exact match on fresh rows whose answer the prompt fixes) says how well it does what it was taught. The paper's claims, in direction: the win rate rises over generations; the
run-to-run spread is lower with the memory than without.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import yaml
from recipe_runs import run_recipe, seed_sweep_parser

RECIPE = "recipes/memo_tiny.yaml"
ARM_STYLE = {"no_memory": ("tab:orange", "without memory"), "no_replay": ("tab:green", "without prefix replay"),
             "": ("tab:blue", "MEMO (memory + replay)")}  # by the arm label's ending; "" matches the full arm


def _arms(recipe: dict) -> list[str]:
    return [s["label"] for s in recipe["stages"] if s.get("name") == "memo"]


def _stages(recipe: dict, seed: int) -> list[dict]:
    memo = [s for s in recipe["stages"] if s.get("name") == "memo"]
    for s in memo:
        s["params"] = {**s["params"], "seed": seed}
    return [{"name": "model"}, *memo]


def _calibration_stages(recipe: dict) -> list[dict]:
    """Per game: the six hints as generation 0 against the baseline, one generation, no memory or replay."""
    from rl.methods.memo.task import GAMES
    out = []
    for s in recipe["stages"]:
        if s.get("name") == "memo" and not s["params"].get("memory", True):
            hints = list(GAMES[s["params"]["game"]].hints)
            params = {**s["params"], "replay": False, "generations": 1, "population": len(hints) + 1, "rounds": 20,
                      "initial_prompts": hints, "seed": 99}
            out.append({"name": "memo", "label": f"calibration_{s['params']['game']}", "params": params})
    return out


def sft_fidelity(model: Path, num: int = 300, seed: int = 777) -> dict[str, dict[str, float]]:
    """How well the taught model does what the harness says it does: greedy answers to fresh rows whose
    taught answer the prompt fixes, exact-match rate per kind (player moves; analyzer copies)."""
    import tempfile

    from rl.methods.memo.task import write_memo_task
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    with tempfile.TemporaryDirectory() as tmp:
        rows = [json.loads(x) for x in open(write_memo_task(tmp, num_player=num, num_analyzer=num, seed=seed)["sft"])]
    rows = [r for r in rows if r["determined"]]
    engine = HFEngine(str(model), attn_implementation="eager")
    said = engine.generate([r["prompt"] for r in rows], SamplingParams(temperature=0.0, max_new_tokens=140)).responses
    out: dict[str, dict[str, float]] = {}
    for r, text in zip(rows, said):
        k = out.setdefault(r["kind"], {"rows": 0, "exact": 0})
        k["rows"] += 1
        k["exact"] += float(text.strip() == r["target"])
    return {k: {"rows": v["rows"], "exact_match": v["exact"] / v["rows"]} for k, v in sorted(out.items())}


def _generations(run_dir: Path, arm: str, game: str) -> list[dict]:
    from rl.methods.memo.task import first_hint
    rows = [json.loads(x) for x in (run_dir / "stages" / arm / "metrics.jsonl").read_text().splitlines()]
    return [{"generation": r["generation"], "best_eval_win_rate": r["eval"]["baseline"]["win_rate"],
             "best_eval_loss_rate": r["eval"]["baseline"]["loss_rate"], "best_fitness": r["best"]["fitness"],
             "best_hint": first_hint(r["best"]["prompt"], game),
             "population_hints": [first_hint(c["prompt"], game) for c in r["candidates"]],
             "memory": r["memory"]["bank"], "replayed_games": r["replayed_games"],
             "rated_games": r["games"] - r["replayed_games"] - r["failed_games"],
             "analyzer_malformed_total": r["memory"]["analyzer_malformed_total"]} for r in rows]


def main() -> None:
    p = seed_sweep_parser("memo", [0, 1, 2], "recipe overrides applied to every run")
    args = p.parse_args()
    runs = Path(args.runs_dir)
    root = Path(__file__).resolve().parents[1]
    recipe = yaml.safe_load((root / RECIPE).read_text())
    first = runs / "sft"
    arms = _arms(recipe)
    games = {s["label"]: s["params"]["game"] for s in recipe["stages"] if s.get("name") == "memo"}
    calib = {**recipe, "stages": [{"name": "model"}, {"name": "data"}, {"name": "sft"}, *_calibration_stages(recipe)]}
    (runs / "recipes").mkdir(parents=True, exist_ok=True)
    path = runs / "recipes" / "calibration.yaml"
    path.write_text(yaml.safe_dump(calib, sort_keys=False))
    run_recipe(str(path), list(args.overrides), first, "SFT and calibration")
    model = first / "sft_model"
    hint_rates, games_per_hint = {}, 0
    for stage in _calibration_stages(recipe):
        row = json.loads((first / "stages" / stage["label"] / "metrics.jsonl").read_text().splitlines()[0])
        hint_rates[stage["params"]["game"]] = {c["prompt"]: c["win_rate"] for c in row["candidates"]}
        games_per_hint = row["games"] // len(row["candidates"])
    fidelity = sft_fidelity(model)
    print(json.dumps({"sft_fidelity": fidelity}), flush=True)
    report = {"recipe": RECIPE, "seeds": args.seeds, "overrides": args.overrides, "sft_model": str(model),
              "sft_fidelity": fidelity,
              "games": games, "calibration": {"games_per_hint": games_per_hint, "win_rate_vs_baseline": hint_rates},
              "per_seed": []}
    print(json.dumps({"calibration": hint_rates}), flush=True)
    for seed in args.seeds:
        spec = {**recipe, "seed": seed, "stages": _stages(recipe, seed)}
        path = runs / "recipes" / f"seed{seed}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        out = runs / f"seed{seed}"
        res = run_recipe(str(path), [f"model.path={model}", "sft.enabled=false", *args.overrides], out,
                         f"memo seed {seed}")
        row = {"seed": seed, "wall_s": res["wall_s"], "arms": {a: _generations(out, a, games[a]) for a in arms}}
        report["per_seed"].append(row)
        print(json.dumps({"seed": seed, **{a: [g["best_eval_win_rate"] for g in row["arms"][a]] for a in arms}}),
              flush=True)
    gens = len(report["per_seed"][0]["arms"][arms[0]])
    summary = {}
    for arm in arms:
        curves = [[g["best_eval_win_rate"] for g in r["arms"][arm]] for r in report["per_seed"]]
        finals = [c[-1] for c in curves]
        summary[arm] = {"mean_by_generation": [statistics.mean(c[g] for c in curves) for g in range(gens)],
                        "rated_games_per_generation": statistics.mean(
                            g["rated_games"] for r in report["per_seed"] for g in r["arms"][arm]),
                        "replayed_games_per_generation": statistics.mean(
                            g["replayed_games"] for r in report["per_seed"] for g in r["arms"][arm]),
                        "final_mean": statistics.mean(finals),
                        "final_std_over_seeds": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                        "gain_first_to_last": [c[-1] - c[0] for c in curves],
                        "best_hint_last": [r["arms"][arm][-1]["best_hint"] for r in report["per_seed"]]}
    report["summary"] = summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    _plot(report, Path(args.out).with_suffix(".png"))
    print(json.dumps(summary, indent=1))


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    games = sorted(set(report["games"].values()))
    fig, axes = plt.subplots(1, len(games), figsize=(6.0 * len(games), 4.0), squeeze=False)
    for ax, game in zip(axes[0], games):
        for arm in (a for a, g in report["games"].items() if g == game):
            color, label = ARM_STYLE[next(k for k in ARM_STYLE if arm.endswith(k))]
            for r in report["per_seed"]:
                ys = [g["best_eval_win_rate"] for g in r["arms"][arm]]
                ax.plot(range(len(ys)), ys, color=color, alpha=0.3, linewidth=1)
            mean = report["summary"][arm]["mean_by_generation"]
            ax.plot(range(len(mean)), mean, color=color, linewidth=2.5, label=f"{label} (mean)")
        best = max(report["calibration"]["win_rate_vs_baseline"][game].values())
        ax.axhline(best, color="gray", linestyle="--", linewidth=1, label="best single hint (calibration)")
        ax.set_xlabel("generation")
        ax.set_ylabel("best candidate's win rate vs baseline")
        ax.set_title(f"{game}, tiny model ({len(report['per_seed'])} seeds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
