"""Rubric self-grading at tiny scale: does RL against a frozen self-grader improve plans by the rubric?

    python benchmarks/rubric_self_grade.py [--seeds 0 1 2] [--out benchmarks/results/rubric_self_grade.json] [key=value ...]

Per seed, `recipes/research_plans_tiny.yaml` runs the SFT warm-up (plans and grading) and RL with
`rubric_self_grade`, the grader being a frozen copy of the initial policy (arm `self_grade`). The control arm
(`rule`) starts from the same SFT checkpoint with the same RL budget and trains on the rule the grader was
taught (`plan_rubric_check` at weight 1; the self-grade is logged at weight 0): what plain optimisation of
the true score reaches, so that the self-grader's exploitation is told apart from over-optimisation.
Recorded per run:
- the grader's item-level agreement with the rule it was taught (`rl.methods.rubric_self_grade.prompts.rule_verdicts`), on
  200 fresh grader prompts (new goals and plans, greedy);
- the self-grade and the rule's score of the training samples, averaged over the first and the last
  `--window` RL steps; the held-out self-grade and rule score (greedy) before and after RL, and every
  10 steps (the recipe's `eval_every`), where checkpoint selection by a held-out judge would look;
- per rubric item, on the final policy's held-out plans: how often the plan states the step (the rule) and
  how often the frozen grader passes it — which items make the self-grade's ceiling.
The paper's claim, in direction: the self-grade rises and so does the score by the rubric, until the grader
is exploited (after ~120 steps at full scale).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from recipe_runs import run_recipe, seed_sweep_parser, window_mean

SELF, RULE = "reward/rubric_self_grade", "reward/plan_rubric_check"


def grader_agreement(model: Path, num: int = 200, seed: int = 98765) -> dict[str, float]:
    """Item-level agreement of the greedy grader with the rule, on grader prompts it never saw."""
    import tempfile

    from rl.methods.rubric_self_grade.reward import parse_grades
    from rl.methods.rubric_self_grade.task import write_plans_task
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_plans_task(tmp, num_sft=4 * num, num_train=1, num_eval=1, grader_fraction=1.0, seed=seed)
        rows = [json.loads(x) for x in open(paths["sft"])][:num]
    engine = HFEngine(str(model))
    said = engine.generate([r["prompt"] for r in rows], SamplingParams(temperature=0.0, max_new_tokens=170)).responses
    agree = items = malformed = 0
    for r, text in zip(rows, said):
        truth = parse_grades(r["target"], 4)
        got = parse_grades(text, 4)
        if got is None:
            malformed += 1
            got = [None] * 4
        agree += sum(a == b for a, b in zip(truth, got))
        items += 4
    return {"item_agreement": agree / items, "malformed_frac": malformed / len(rows),
            "rule_pass_rate": sum(sum(parse_grades(r["target"], 4)) for r in rows) / items}


def heldout_rule_score(model: Path, eval_path: Path) -> float:
    """Greedy plans for the held-out goals, scored by the rule (what the self-grade stands for)."""
    from rl.methods.rubric_self_grade.reward import plan_rubric_check
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    rows = [json.loads(x) for x in open(eval_path)]
    said = HFEngine(str(model)).generate([r["prompt"] for r in rows],
                                         SamplingParams(temperature=0.0, max_new_tokens=80)).responses
    return statistics.mean(plan_rubric_check(r["prompt"], s, r["answer"]) for r, s in zip(rows, said))


def item_pass_rates(grader_model: Path, policy_model: Path, eval_path: Path) -> dict[str, list[float]]:
    """Per rubric item, on the policy's greedy held-out plans: the share that state the step as written (the
    rule) and the share the frozen grader passes."""
    from rl.methods.rubric_self_grade.prompts import grader_prompt, rule_verdicts
    from rl.methods.rubric_self_grade.reward import extract_plan, parse_grades
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    rows = [json.loads(x) for x in open(eval_path)]
    plans = HFEngine(str(policy_model)).generate([r["prompt"] for r in rows],
                                                 SamplingParams(temperature=0.0, max_new_tokens=80)).responses
    plans = [extract_plan(p)[0] or "" for p in plans]
    tasks = [r["answer"] for r in rows]
    said = HFEngine(str(grader_model)).generate(
        [grader_prompt(t["goal"], t["rubric"], t["reference"], p, "compact") for t, p in zip(tasks, plans)],
        SamplingParams(temperature=0.0, max_new_tokens=170)).responses
    rule = [rule_verdicts(t["rubric"], p) for t, p in zip(tasks, plans)]
    grades = [parse_grades(s, len(t["rubric"])) or [False] * len(t["rubric"]) for t, s in zip(tasks, said)]
    k = len(tasks[0]["rubric"])
    return {"rule": [statistics.mean(r[i] for r in rule) for i in range(k)],
            "grader": [statistics.mean(g[i] for g in grades) for i in range(k)],
            "example_plans": plans[:3]}


ARMS = {"self_grade": [],
        "rule": ["reward.functions=[{name: rubric_self_grade, weight: 0.0, params: {judge: grader, template: compact, "
                 "retries: 0}}, {name: plan_rubric_check, weight: 1.0}]"]}


def main() -> None:
    p = seed_sweep_parser("rubric_self_grade", [0, 1, 2], "recipe overrides")
    p.add_argument("--window", type=int, default=5, help="RL steps averaged at the start and at the end")
    args = p.parse_args()
    table = []
    for seed in args.seeds:
        for arm, extra in ARMS.items():
            table.append(_run_arm(args, seed, arm, extra))
    keys = ("self_grade_start", "self_grade_end", "rule_start", "rule_end", "heldout_self_grade_before",
            "heldout_self_grade_after", "heldout_rule_before", "heldout_rule_after")
    summary = {arm: {k: statistics.mean(r[k] for r in table if r["arm"] == arm) for k in keys} for arm in ARMS}
    for arm in ARMS:
        summary[arm]["grader_item_agreement"] = statistics.mean(r["grader"]["item_agreement"] for r in table
                                                                if r["arm"] == arm)
    result = {"recipe": "recipes/research_plans_tiny.yaml", "arms": ARMS, "window": args.window,
              "overrides": args.overrides, "runs": table, "mean": summary}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


def _run_arm(args, seed: int, arm: str, extra: list[str]) -> dict:
    base = Path(args.runs_dir) / f"seed{seed}"
    out = base / arm
    sft_model = base / "self_grade" / "sft_model"
    common = [f"seed={seed}", *args.overrides]
    if arm != "self_grade":  # the same SFT checkpoint, data and RL budget as the self-grade arm
        data = base / "self_grade" / "data"
        common += [f"model.path={sft_model}", "sft.enabled=false", f"data.train_path={data / 'train.jsonl'}",
                   f"data.eval_path={data / 'eval.jsonl'}", *extra]
    res = run_recipe("recipes/research_plans_tiny.yaml", common, out, f"{arm} seed {seed}")
    m = res["metrics"]
    eval_path = base / "self_grade" / "data" / "eval.jsonl"
    row = {"seed": seed, "arm": arm, "steps": len(m), "wall_s": res["wall_s"],
           "grader": grader_agreement(sft_model),
           "self_grade_start": window_mean(m, SELF, True, args.window),
           "self_grade_end": window_mean(m, SELF, False, args.window),
           "rule_start": window_mean(m, RULE, True, args.window),
           "rule_end": window_mean(m, RULE, False, args.window),
           "heldout_self_grade_before": res["heldout_rewards_before_rl"]["rubric_self_grade"],
           "heldout_self_grade_after": res["heldout_rewards_after_rl"]["rubric_self_grade"],
           "heldout_rule_before": heldout_rule_score(sft_model, eval_path),
           "heldout_rule_after": heldout_rule_score(out / "hf_model", eval_path),
           # the recipe evaluates every 10 steps: held-out self-grade and rule side by side
           "heldout_curve": [{"step": r["step"], "self_grade": r[f"eval/{SELF}"], "rule": r[f"eval/{RULE}"]}
                             for r in m if f"eval/{SELF}" in r],
           "items_after": item_pass_rates(sft_model, out / "hf_model", eval_path),
           "reward_failures": sum(r["reward/failures"] for r in m),
           "judge_digest_unchanged": all(j["weights_sha256_start"] == j["weights_sha256_end"]
                                         for j in res["judges"].values())}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
