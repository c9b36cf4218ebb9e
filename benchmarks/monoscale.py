"""MonoScale at tiny scale: J per onboarding round as a pool grows from 3 to 10 agents, for MonoScale's
trust-region memory updates, the same updates all accepted (`accept_all`: what the trust region adds), naive growth
and the fixed pool, with a router model taught in code.

    python benchmarks/monoscale.py [--seeds 0 .. 29] [--rule-seeds 100] [--out benchmarks/results/monoscale.json]
                                   [key=value ...]

A labelled synthetic harness: `recipes/monoscale_tiny.yaml` teaches a tiny model to route a task by reading the
agent cards and the router memory (`rl/methods/monoscale/task.py`; its fidelity, greedy agreement with the rule it
was taught on fresh contexts, is recorded). Two pools:
* simulated (`rl.methods.monoscale.core.make_growing_pool`): three generalists, then seven specialists that each
  claim one or two of six task types, about a third of them unreliable (the claim does not hold); per seed a new
  pool. J is the judged success rate on 300 held-out tasks after each round. The same runs with the taught rule as
  the router are recorded over `--rule-seeds` seeds;
* real agents (`recipes/monoscale_tiny_agents.json`: python tools in the sandbox and one model agent, the taught
  router's weights, which cannot do arithmetic) on the recipe's typed arithmetic tasks, judged by math-verify
  equivalence; per seed a new split of the train rows into replay and familiarization tasks and new draws.
Per arm: the final J with its 95% interval over seeds, the seeds with a drop of more than 0.05 from one round to the
next (with Wilson intervals), and paired differences of the final J between arms. What MonoScale guarantees is
no drop; the paper also reports a higher end point than naive growth, which this harness tests rather than assumes.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from recipe_runs import run_recipe, seed_sweep_parser, write_report

RECIPE = "recipes/monoscale_tiny.yaml"
MODES = ("monoscale", "accept_all", "naive", "fixed")
EPS = 0.05  # a drop: J falls by more than this from one round to the next (about 2 standard errors at 300 tasks)


def main() -> None:
    p = seed_sweep_parser("monoscale", list(range(30)), "recipe overrides")
    p.add_argument("--rule-seeds", type=int, default=100, help="seeds of the simulated pool with the rule router")
    p.add_argument("--delta", type=float, default=0.2, help="trust region: routing-change rate on replay tasks")
    args = p.parse_args()
    runs = Path(args.runs_dir)
    run_recipe(RECIPE, ["stages=[{name: model}, {name: data}, {name: sft}]", *args.overrides], runs / "sft",
               "router SFT")
    generate, answer = engines(runs / "sft" / "sft_model")
    report = {"recipe": RECIPE, "seeds": args.seeds, "rule_seeds": args.rule_seeds, "delta": args.delta, "eps": EPS,
              "router_fidelity": fidelity(generate)}
    print(json.dumps({"router_fidelity": report["router_fidelity"]}), flush=True)
    report["simulated"] = simulated_runs(generate, args.seeds, args.rule_seeds, args.delta)
    report["real_agents"] = real_agent_runs(generate, answer, runs / "sft" / "data", args.seeds, args.delta)
    report["summary"] = {
        "simulated_model": summarize(report["simulated"]["model"]),
        "simulated_rule": summarize(report["simulated"]["rule"]),
        "real_agents_model": summarize(report["real_agents"]["model"])}
    write_report(report, args.out, _plot)


def engines(model: Path):
    """The taught router (greedy, 3 tokens) and the same weights as the pool's model agent (8 tokens)."""
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    engine = HFEngine(str(model), attn_implementation="eager")

    def run(prompts: list[str], tokens: int) -> list[str]:
        out: list[str] = []
        for i in range(0, len(prompts), 256):
            out += engine.generate(prompts[i:i + 256], SamplingParams(temperature=0.0, max_new_tokens=tokens)).responses
        return out
    return (lambda prompts: run(prompts, 3)), (lambda prompts: run(prompts, 8))


def fidelity(generate) -> float:
    from rl.methods.monoscale.task import router_rows
    fresh = router_rows(500, 4242)
    said = generate([r["prompt"] for r in fresh])
    return sum(s.strip() == r["target"] for s, r in zip(said, fresh)) / len(fresh)


def simulated_runs(generate, seeds: list[int], rule_seeds: int, delta: float) -> dict:
    from rl.methods.monoscale.core import LMRouter, grow_pool, make_growing_pool
    from rl.methods.monoscale.task import teacher_route

    def rule(tasks, memory, cards):
        return [teacher_route(t, memory, cards) for t in tasks]
    out = {"model": [], "rule": []}
    for name, route, sweep in (("model", LMRouter(generate), seeds), ("rule", rule, range(rule_seeds))):
        for seed in sweep:
            pool, cards, kinds = make_growing_pool(seed)
            row = {"seed": seed, **{m: compact(grow_pool(m, route, pool, cards, kinds, seed=seed, delta=delta))
                                    for m in MODES}}
            out[name].append(row)
            if name == "model":
                print(json.dumps({"simulated": seed, **{m: [round(j, 3) for j in row[m]["j"]] for m in MODES}}),
                      flush=True)
    return out


def real_agent_runs(generate, answer, data: Path, seeds: list[int], delta: float) -> dict:
    """The tiny recipe's pool of real agents, one `AgentPool` for every seed (each task meets each agent once)."""
    import random

    from rl.methods.monoscale.core import AgentCard, AgentPool, LMRouter, Task, answer_matches, grow_pool
    from rl.methods.monoscale.env import load_pool, run_tool_agent
    from rl.methods.monoscale.task import KINDS
    agents = load_pool(Path(__file__).resolve().parents[1] / "recipes/monoscale_tiny_agents.json")

    def rows(split: str) -> list[Task]:
        lines = (data / f"monoscale_tasks_{split}.jsonl").read_text().splitlines()
        return [Task(f"{split}-{i}", r["kind"], r["prompt"], r["answer"]) for i, r in enumerate(map(json.loads, lines))]

    def answering(agent):
        if agent["kind"] == "python":
            return lambda texts: [run_tool_agent(agent, t) for t in texts]
        return answer
    pool = AgentPool({a["name"]: answering(a) for a in agents}, answer_matches)
    cards = [AgentCard(a["name"], a["description"]) for a in agents]
    test, train, out = rows("eval"), rows("train"), []
    for seed in seeds:
        shuffled = random.Random(seed).sample(train, len(train))
        bank: dict[str, list[Task]] = {}
        for task in shuffled[24:]:
            bank.setdefault(task.kind, []).append(task)
        row = {"seed": seed, **{m: compact(grow_pool(m, LMRouter(generate), pool, cards, KINDS, seed=seed,
                                                     delta=delta, test=test, replay=shuffled[:24], bank=bank,
                                                     n_familiarization=8)) for m in MODES}}
        out.append(row)
        print(json.dumps({"real_agents": seed, **{m: [round(j, 3) for j in row[m]["j"]] for m in MODES}}), flush=True)
    outcomes = {}
    for (_, agent), (_, score) in pool.seen.items():
        outcomes.setdefault(agent, []).append(score)
    return {"model": out, "agent_success": {a: statistics.mean(s) for a, s in sorted(outcomes.items())}}


def compact(result: dict) -> dict:
    """A grown pool's record without every candidate tried (the stage's report keeps those)."""
    keep = ("agent", "accepted", "j_before", "j_after", "change_rate")
    return {"j": result["j"], "updates": [{k: u[k] for k in keep} | {"added": u["diff"].get("added", [])}
                                          for u in result["updates"]], "memory": result["memory"]}


def wilson(k: int, n: int) -> list[float]:
    """The 95% Wilson interval of a proportion k/n."""
    z, phat = 1.96, k / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [centre - half, centre + half]


def mean_ci(values: list[float]) -> dict:
    from scipy.stats import t as student_t
    n, mean = len(values), statistics.mean(values)
    half = student_t.ppf(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n) if n > 1 else float("nan")
    return {"mean": mean, "ci95": [mean - half, mean + half]}


def summarize(rows: list[dict]) -> dict:
    """Per arm: final J (mean, 95% t interval over seeds), seeds with a drop (Wilson interval), the largest drop;
    MonoScale against each other arm: the paired difference of final J and the seeds where MonoScale ends below."""
    n, out = len(rows), {"seeds": len(rows)}
    for mode in MODES:
        curves = [r[mode]["j"] for r in rows]
        steps = [[b - a for a, b in zip(c, c[1:])] for c in curves]
        dropped = sum(min(s) < -EPS for s in steps)
        out[mode] = {"final": mean_ci([c[-1] for c in curves]),
                     "mean_by_round": [statistics.mean(c[k] for c in curves) for k in range(len(curves[0]))],
                     "seeds_with_a_drop": dropped, "drop_share_ci95": wilson(dropped, n),
                     "largest_drop": min(min(s) for s in steps),
                     "ends_below_start": sum(c[-1] < c[0] - EPS for c in curves),
                     "accepted_updates_mean": statistics.mean(sum(u["accepted"] for u in r[mode]["updates"])
                                                              for r in rows)}
    for other in ("accept_all", "naive", "fixed"):
        diffs = [r["monoscale"]["j"][-1] - r[other]["j"][-1] for r in rows]
        out[f"monoscale_minus_{other}"] = {**mean_ci(diffs), "seeds_monoscale_below": sum(d < 0 for d in diffs)}
    return out


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"monoscale": "tab:blue", "accept_all": "tab:orange", "naive": "tab:red", "fixed": "tab:gray"}
    panels = (("simulated_model", "simulated pool, router model"), ("simulated_rule", "simulated pool, rule router"),
              ("real_agents_model", "real agents, router model"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, panels):
        summary = report["summary"][key]
        for mode in MODES:
            mean = summary[mode]["mean_by_round"]
            lo, hi = summary[mode]["final"]["ci95"]
            ax.plot(range(3, 3 + len(mean)), mean, color=colors[mode], linewidth=2,
                    label=f"{mode} (drops on {summary[mode]['seeds_with_a_drop']}/{summary['seeds']})")
            ax.errorbar([2 + len(mean) + 0.15 * MODES.index(mode)], [summary[mode]["final"]["mean"]],
                        yerr=[[summary[mode]["final"]["mean"] - lo], [hi - summary[mode]["final"]["mean"]]],
                        color=colors[mode], capsize=3)
        ax.set_xlabel("agents in the pool")
        ax.set_ylabel("J (held-out success), mean over seeds")
        ax.set_title(f"{title} ({summary['seeds']} seeds)", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
