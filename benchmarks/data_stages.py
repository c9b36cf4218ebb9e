"""The data stages at tiny scale: what BLISS selection and EP-Order ordering change in the SFT that follows.

    python benchmarks/data_stages.py [--seeds 0 1 2] [--out benchmarks/results/data_stages.json] [key=value ...]

Per seed, with tiny models made in code and data built in code (a labelled synthetic harness):

BLISS (`recipes/bliss_select_sft_tiny.yaml`, the noisy_domains pool: 50% of the targets are random letters): the
stage warms up the target and a smaller proxy on random pool rows, runs the bilevel optimisation and keeps the
top 20%; the warmed-up target is then fine-tuned, same budget, on (a) that selection, (b) a random 20%, (c) the
20% of lowest loss under the warmed-up proxy. Recorded: the AUROC of the scores for clean vs corrupted rows, the
clean share of each selection, each arm's held-out loss curve on clean rows, and the steps BLISS takes to reach
the random arm's best held-out loss (the paper's headline, 1.7x fewer steps at 1B scale, in small).

EP-Order (`recipes/ep_order_sft_tiny.yaml`, six string-transformation domains): one SFT epoch from the same base
model in (a) the EP order (clusters chained by centroid proximity, mixed transition regions), (b) the same
clusters as pure blocks in a random order, (c) a full shuffle, (d) the EP order with replay: 30% of each segment's
rows moved to random later positions (`rl.methods.ep_order.core.spread_replay`; the same rows, the same epoch
length), the arm a cluster curriculum needs against forgetting. Recorded: the training-loss jump at cluster
boundaries (mean loss of the first `--window` steps of a segment minus the last `--window` of the one before),
the held-out loss after the epoch on the domains of the first two clusters (forgetting), and the final held-out
loss. These are hypotheses of the reconstruction, not claims of a paper.

The chain (`recipes/data_chain_tiny.yaml`): bliss → ep_order → SFT → GRPO → evaluate in one recipe, against
the same recipe with the selection replaced by a random 20% of the same pool (same warmed-up target, same
ordering stage, SFT and RL budgets). Recorded: greedy held-out exact-match accuracy after SFT (before RL) and
after RL, and the clean share of each selection.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from recipe_runs import run_recipe, seed_sweep_parser, write_report

from rl.methods.ep_order.core import spread_replay

BLISS = "recipes/bliss_select_sft_tiny.yaml"
EP = "recipes/ep_order_sft_tiny.yaml"
CHAIN = "recipes/data_chain_tiny.yaml"
REPLAY = 0.3  # the share of each EP segment moved later in the replay arm (DSR replays 10-30% of earlier phases)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def _write_rows(path: Path, rows: list[dict]) -> Path:
    """Write `rows` as JSONL unless the file already holds exactly them: a rerun keeps the file's modification
    time, so the stages that read it are reused instead of run again."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def _eval_curve(out: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["sft/eval_loss"]) for m in _jsonl(out / "sft_metrics.jsonl") if "sft/eval_loss" in m]


def _row_losses(model_path: str, rows: list[dict]) -> list[float]:
    """Token-mean NLL of each row's target under the model at `model_path`."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.tokenizer import load_tokenizer
    from rl.batch import batch_of_examples
    from rl.methods.bliss.core import sequence_stats
    from rl.sft_data import prompt_response_example
    tok = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(rows), 128):
            batch = batch_of_examples([prompt_response_example(tok, r["prompt"], r["target"]) for r in rows[i:i + 128]],
                                      tok.pad_token_id)
            out += sequence_stats(model, batch)[0].tolist()
    return out


def steps_to_reach(curve: list[tuple[int, float]], level: float) -> int | None:
    return next((step for step, loss in curve if loss <= level), None)


def bliss_seed(seed: int, runs: Path, overrides: list[str]) -> dict:
    import pandas as pd
    from sklearn.metrics import roc_auc_score
    base = runs / f"seed{seed}" / "bliss"
    data_seed = f"data.synthetic.seed={1234 + seed}"
    run_recipe(BLISS, [f"seed={seed}", data_seed, *overrides], base / "bliss", f"BLISS seed {seed}")
    stage = base / "bliss" / "stages" / "bliss"
    pool = _jsonl(base / "bliss" / "data" / "sft.jsonl")
    scores = pd.read_parquet(stage / "bliss_scores.parquet").sort_values("row")["score"].tolist()
    clean = [bool(r["clean"]) for r in pool]
    n = len(pool) // 5
    picks = {"bliss": sorted(sum(json.loads((stage / "bliss_selection.json").read_text())["selected_per_round"], [])),
             "random": sorted(random.Random(seed).sample(range(len(pool)), n))}
    proxy_loss = _row_losses(str(stage / "proxy"), pool)
    picks["proxy_loss"] = sorted(sorted(range(len(pool)), key=lambda i: (proxy_loss[i], i))[:n])
    target, val = stage / "target", base / "bliss" / "data" / "sft_val.jsonl"
    curves = {"bliss": _eval_curve(base / "bliss")}
    for arm in ("random", "proxy_loss"):
        subset = _write_rows(base / f"{arm}.jsonl", [{"prompt": pool[i]["prompt"], "target": pool[i]["target"]}
                                                       for i in picks[arm]])
        run_recipe(BLISS, [f"seed={seed}", data_seed, *overrides, f"model.path={target}", f"data.sft_path={subset}",
                           f"sft.eval_path={val}", "stages=[{name: model}, {name: data}, {name: sft}]"],
                   base / arm, f"{arm} seed {seed}")
        curves[arm] = _eval_curve(base / arm)
    # 400 rows overfit within the budget: the held-out loss has a minimum, and the speed-up is measured to the
    # random arm's best loss (the steps it took to reach it over the steps BLISS needs)
    best = {a: min(c, key=lambda x: x[1]) for a, c in curves.items()}
    reach = steps_to_reach(curves["bliss"], best["random"][1])
    return {"auroc": roc_auc_score(clean, scores), "clean_share": {a: sum(clean[i] for i in p) / len(p)
                                                                    for a, p in picks.items()},
            "eval_curves": curves, "final_eval_loss": {a: c[-1][1] for a, c in curves.items()},
            "best_eval_loss": {a: b[1] for a, b in best.items()}, "best_step": {a: b[0] for a, b in best.items()},
            "bliss_steps_to_random_best": reach, "speedup": (best["random"][0] / reach) if reach else None}


def boundary_jump(losses: list[float], boundaries: list[int], window: int) -> float:
    """Mean over boundaries of (mean loss of the `window` steps from it) − (mean of the `window` steps before)."""
    jumps = [statistics.mean(losses[b:b + window]) - statistics.mean(losses[b - window:b])
             for b in boundaries if b >= window and b + window <= len(losses)]
    return statistics.mean(jumps) if jumps else float("nan")


def ep_seed(seed: int, runs: Path, window: int, overrides: list[str]) -> dict:
    base = runs / f"seed{seed}" / "ep"
    common = [f"seed={seed}", f"data.synthetic.seed={1234 + seed}", "sft.eval_fraction=0", "sft.batch_size=16"]
    held_path = base / "ep_order" / "data" / "eval.jsonl"  # written by the first run's data stage
    common.append(f"sft.eval_path={held_path}")
    ep = run_recipe(EP, [*common, *overrides], base / "ep_order", f"EP-Order seed {seed}")
    report = json.loads((base / "ep_order" / "stages" / "ep_order" / "ep_order.json").read_text())
    data = base / "ep_order" / "data"
    rows, held = _jsonl(data / "sft.jsonl"), _jsonl(data / "eval.jsonl")
    labels = report["labels"]  # per source row (no row is dropped here)
    majority = {c: max(set(d for d, lab in zip((r["domain"] for r in rows), labels) if lab == c),
                       key=lambda d: sum(1 for r, lab in zip(rows, labels) if lab == c and r["domain"] == d))
                for c in set(labels)}
    # the same clusters as pure blocks in a random order
    clusters = sorted(set(labels))
    random.Random(seed).shuffle(clusters)
    blocks = [i for c in clusters for i in range(len(rows)) if labels[i] == c]
    blocks_path = _write_rows(base / "cluster_blocks.jsonl",
                              [{"prompt": rows[i]["prompt"], "target": rows[i]["target"]} for i in blocks])
    arms = {"ep_order": (ep, [report["path"][j] for j in range(len(report["path"]))],
                         [s["start"] for s in report["segments"][1:]])}
    shared = [*common, *overrides, "stages=[{name: model}, {name: data}, {name: sft}]"]  # the arms' own stages win
    block_run = run_recipe(EP, [*shared, f"data.sft_path={blocks_path}", "sft.sampler=sequential"],
                           base / "cluster_blocks", f"cluster blocks seed {seed}")
    sizes = [labels.count(c) for c in clusters]
    arms["cluster_blocks"] = (block_run, clusters, [sum(sizes[:j]) for j in range(1, len(sizes))])
    shuffle_run = run_recipe(EP, [*shared, f"data.sft_path={data / 'sft.jsonl'}", "sft.sampler=shuffle"],
                             base / "shuffle", f"shuffle seed {seed}")
    arms["shuffle"] = (shuffle_run, clusters, [])
    # the EP order with a share of each segment moved to random later positions (replay of earlier clusters)
    positions, spans = spread_replay(list(range(len(report["order"]))), report["segments"], REPLAY, seed)
    replay_path = _write_rows(base / "ep_order_replay.jsonl", [
        {k: rows[report["source_rows"][p]][k] for k in ("prompt", "target")} for p in positions])
    replay_run = run_recipe(EP, [*shared, f"data.sft_path={replay_path}", "sft.sampler=sequential"],
                            base / "ep_order_replay", f"EP-Order with replay seed {seed}")
    arms["ep_order_replay"] = (replay_run, arms["ep_order"][1], [s["start"] for s in spans[1:]])
    out = {"k": report["k"], "path_length": report["path_length"],
           "random_path_length_median": report["random_path_length_median"], "arms": {}}
    for name, (run, order, starts) in arms.items():
        folder = base / name
        losses = [m["sft/loss"] for m in _jsonl(folder / "sft_metrics.jsonl")]
        first_domains = {majority[c] for c in order[:2]} if name != "shuffle" else None
        out["arms"][name] = {"train_loss": losses, "boundaries": [s // 16 for s in starts],
                             "boundary_jump": boundary_jump(losses, [s // 16 for s in starts], window),
                             "final_eval_loss": run.get("sft_eval_loss"), "first_domains": sorted(first_domains or [])}
        per_row = _row_losses(str(folder / "sft_model"), held)
        out["arms"][name]["eval_loss_by_domain"] = {
            d: statistics.mean(x for x, r in zip(per_row, held) if r["domain"] == d) for d in sorted({r["domain"] for r in held})}
    for name in ("ep_order", "cluster_blocks", "ep_order_replay"):  # forgetting: the arm's first two domains, against the shuffle
        arm = out["arms"][name]
        arm["early_domains_eval_loss"] = statistics.mean(arm["eval_loss_by_domain"][d] for d in arm["first_domains"])
        arm["early_domains_eval_loss_shuffle"] = statistics.mean(
            out["arms"]["shuffle"]["eval_loss_by_domain"][d] for d in arm["first_domains"])
    return out


def chain_seed(seed: int, runs: Path, overrides: list[str]) -> dict:
    """The whole chain with BLISS's selection, and the same chain on a random 20% of the pool."""
    import yaml
    base = runs / f"seed{seed}" / "chain"
    common = [f"seed={seed}", f"data.synthetic.seed={1234 + seed}", *overrides]
    bliss = run_recipe(CHAIN, common, base / "bliss", f"chain with BLISS seed {seed}")
    pool = _jsonl(base / "bliss" / "data" / "sft.jsonl")
    stage = base / "bliss" / "stages" / "bliss"
    chosen = {"bliss": sorted(sum(json.loads((stage / "bliss_selection.json").read_text())["selected_per_round"], [])),
              "random": sorted(random.Random(seed).sample(range(len(pool)), len(pool) // 5))}
    subset = _write_rows(base / "random.jsonl", [{"prompt": pool[i]["prompt"], "target": pool[i]["target"]}
                                                 for i in chosen["random"]])
    # the recipe's own stages without the selection: ordering, SFT, RL and evaluation as in the BLISS arm
    recipe_stages = yaml.safe_load((Path(__file__).resolve().parents[1] / CHAIN).read_text())["stages"]
    stages = [st for st in recipe_stages if st["name"] != "bliss"]
    rand = run_recipe(CHAIN, [*common, f"model.path={stage / 'target'}", f"data.sft_path={subset}",
                              f"stages={json.dumps(stages)}"], base / "random", f"chain with random 20% seed {seed}")
    return {arm: {"accuracy_after_sft": r["accuracy_before_rl"], "accuracy_after_rl": r["accuracy_after_rl"],
                  "sft_final_loss": r.get("sft_final_loss"),
                  "clean_share": sum(bool(pool[i]["clean"]) for i in chosen[arm]) / len(chosen[arm]),
                  "reward_curve": [m["reward/mean"] for m in r["metrics"]]}
            for arm, r in (("bliss", bliss), ("random", rand))}


def summarize(report: dict) -> dict:
    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None
    b = [r["bliss"] for r in report["per_seed"]]
    e = [r["ep"] for r in report["per_seed"]]
    c = [r["chain"] for r in report["per_seed"]]
    return {
        "chain": {a: {k: [x[a][k] for x in c] for k in ("accuracy_after_sft", "accuracy_after_rl", "clean_share")}
                  for a in ("bliss", "random")},
        "bliss": {"auroc": [x["auroc"] for x in b],
                  "clean_share": {a: [x["clean_share"][a] for x in b] for a in ("bliss", "random", "proxy_loss")},
                  "final_eval_loss": {a: [x["final_eval_loss"][a] for x in b] for a in ("bliss", "random", "proxy_loss")},
                  "best_eval_loss": {a: [x["best_eval_loss"][a] for x in b] for a in ("bliss", "random", "proxy_loss")},
                  # None: the seed never reached the random arm's best loss; the mean is over the seeds that did
                  "speedup": [x["speedup"] for x in b],
                  "seeds_reaching_random_best": f"{sum(x['speedup'] is not None for x in b)} of {len(b)}",
                  "speedup_mean_of_seeds_that_reached": mean(x["speedup"] for x in b)},
        "ep_order": {a: {"boundary_jump": [x["arms"][a]["boundary_jump"] for x in e],
                         "final_eval_loss": [x["arms"][a]["final_eval_loss"] for x in e],
                         "early_domains_eval_loss": [x["arms"][a].get("early_domains_eval_loss") for x in e],
                         "early_domains_eval_loss_shuffle": [x["arms"][a].get("early_domains_eval_loss_shuffle")
                                                             for x in e]}
                     for a in ("ep_order", "ep_order_replay", "cluster_blocks", "shuffle")}}


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right, chain) = plt.subplots(1, 3, figsize=(16, 4))
    colors = {"bliss": "tab:blue", "random": "tab:gray", "proxy_loss": "tab:orange",
              "ep_order": "tab:blue", "ep_order_replay": "tab:green", "cluster_blocks": "tab:red",
              "shuffle": "tab:gray"}
    for i, r in enumerate(report["per_seed"]):
        for arm, curve in r["bliss"]["eval_curves"].items():
            left.plot([s for s, _ in curve], [v for _, v in curve], color=colors[arm], alpha=0.6,
                      label=arm if i == 0 else None)
    left.set_xlabel("SFT step")
    left.set_ylabel("held-out loss (clean rows)")
    left.set_title("BLISS: fine-tuning on a 20% selection")
    left.legend(fontsize=8)
    r = report["per_seed"][0]["ep"]
    for arm, res in r["arms"].items():
        right.plot(res["train_loss"], color=colors[arm], alpha=0.7, label=arm)
        for b in res["boundaries"]:
            right.axvline(b, color=colors[arm], alpha=0.15, linewidth=1)
    right.set_xlabel("SFT step (one epoch)")
    right.set_ylabel("training loss")
    right.set_title(f"EP-Order (seed {report['per_seed'][0]['seed']}), cluster boundaries")
    right.legend(fontsize=8)
    for i, r in enumerate(report["per_seed"]):
        for arm, color in (("bliss", "tab:blue"), ("random", "tab:gray")):
            chain.plot(range(1, len(r["chain"][arm]["reward_curve"]) + 1), r["chain"][arm]["reward_curve"],
                       color=color, alpha=0.6, label=f"{arm} 20%" if i == 0 else None)
    chain.set_xlabel("GRPO step")
    chain.set_ylabel("mean reward (exact match)")
    chain.set_title("select → order → SFT → RL: reward during RL")
    chain.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = seed_sweep_parser("data_stages", [0, 1, 2], "recipe overrides applied to every run")
    p.add_argument("--window", type=int, default=5, help="steps on each side of a cluster boundary")
    p.add_argument("--only", choices=["bliss", "ep", "chain"], default=None, help="run one of the three studies")
    args = p.parse_args()
    runs = Path(args.runs_dir)
    report = {"recipes": [BLISS, EP, CHAIN], "seeds": args.seeds, "per_seed": []}
    for seed in args.seeds:
        row = {"seed": seed}
        if args.only in (None, "bliss"):
            row["bliss"] = bliss_seed(seed, runs, args.overrides)
            print(json.dumps({"seed": seed, "auroc": row["bliss"]["auroc"], "speedup": row["bliss"]["speedup"],
                              "final": row["bliss"]["final_eval_loss"]}), flush=True)
        if args.only in (None, "ep"):
            row["ep"] = ep_seed(seed, runs, args.window, args.overrides)
            print(json.dumps({"seed": seed, **{a: {"jump": v["boundary_jump"], "final": v["final_eval_loss"]}
                                               for a, v in row["ep"]["arms"].items()}}), flush=True)
        if args.only in (None, "chain"):
            row["chain"] = chain_seed(seed, runs, args.overrides)
            print(json.dumps({"seed": seed, **{a: {k: v[k] for k in ("accuracy_after_sft", "accuracy_after_rl")}
                                               for a, v in row["chain"].items()}}), flush=True)
        report["per_seed"].append(row)
        # kept after every seed: a stopped sweep loses no finished seed (its finished stages are reused on rerun)
        partial = Path(args.out).with_suffix(".partial.json")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(report, indent=2))
    report = merged(report, Path(args.out)) if args.only is not None else report
    complete = all(k in r for r in report["per_seed"] for k in ("bliss", "ep", "chain"))
    report["summary"] = summarize(report) if complete else {}
    write_report(report, args.out, _plot if complete else lambda r, p: None)


def merged(report: dict, out: Path) -> dict:
    """With `--only`, the study just run replaces its part of each seed in an earlier report at `out` (the other
    studies' figures are kept)."""
    if not out.exists():
        return report
    old = json.loads(out.read_text())
    rows = {r["seed"]: r for r in old["per_seed"]}
    for row in report["per_seed"]:
        rows.setdefault(row["seed"], {"seed": row["seed"]}).update(row)
    return {**old, "seeds": sorted(rows), "per_seed": [rows[s] for s in sorted(rows)]}


if __name__ == "__main__":
    main()
