"""A synthetic research-plan task for rubric self-grading at tiny scale (`data.synthetic.task: rubric_self_grade`, registry kind `task`).

A goal names a factor and an outcome ("Find how salt changes growth."). Its rubric has four items,
each one step a sound plan takes (`Vary salt.`, `Measure growth.`, `Keep a control.`,
`Repeat it 3 times.`); the reference solution states all four. The policy sees only the goal
(`rl.methods.rubric_self_grade.prompts.policy_prompt`).

The SFT warm-up teaches the one model both roles that rubric self-grading needs:
- as the policy, `<solution>` plans that take each step with probability `p_step`, and name the wrong
  factor or outcome with probability `p_wrong` (a half-remembered plan);
- as the grader, for a plan drawn the same way, the XML verdicts of `rl.methods.rubric_self_grade.reward` in the `compact`
  grader prompt: `<item num=k><errors>none</errors></item>` when the plan takes step k as written,
  `<errors>1</errors>` (desideratum 1: the item is not handled) otherwise.

The frozen initial policy is then a grader that reads plans the way the rule does, more or less: RL with
`rubric_self_grade` should raise the share of steps the plans take, and `plan_rubric_check`, the rule
itself (`rl.methods.rubric_self_grade.reward.plan_rubric_check`), logged beside it at weight 0, tells a real gain from a fooled
grader.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rl.methods.rubric_self_grade.prompts import grader_prompt, policy_prompt, rule_verdicts
from rl.registry import register, register_alias

FACTORS = ("heat", "light", "salt", "noise", "water", "dust", "wind", "sugar")
OUTCOMES = ("growth", "speed", "yield", "sleep", "rust", "color", "weight", "taste")


def plan_steps(factor: str, outcome: str) -> list[str]:
    """The four rubric items of a goal, each written as the plan step that meets it."""
    return [f"Vary {factor}.", f"Measure {outcome}.", "Keep a control.", "Repeat it 3 times."]


def grades_xml(passes: list[bool]) -> str:
    return "".join(f"<item num={k}><errors>{'none' if ok else '1'}</errors></item>" for k, ok in enumerate(passes, 1))


def write_plans_task(out_dir: str | Path, num_sft: int = 4000, num_train: int = 2000, num_eval: int = 100,
                     grader_fraction: float = 0.5, p_step: float = 0.5, p_wrong: float = 0.3,
                     seed: int = 1234) -> dict[str, str]:
    """Write `sft.jsonl` (prompt, target: policy and grader rows mixed), `train.jsonl` and `eval.jsonl`
    (prompt = goal only, answer = {goal, rubric, reference})."""
    rng = random.Random(seed)

    def task() -> dict[str, Any]:
        factor, outcome = rng.choice(FACTORS), rng.choice(OUTCOMES)
        steps = plan_steps(factor, outcome)
        return {"goal": f"Find how {factor} changes {outcome}.", "rubric": steps, "reference": " ".join(steps),
                "factor": factor, "outcome": outcome}

    def sample_plan(t: dict[str, Any]) -> str:
        wrong_factor = rng.choice([f for f in FACTORS if f != t["factor"]])
        wrong_outcome = rng.choice([o for o in OUTCOMES if o != t["outcome"]])
        steps = []
        for k, step in enumerate(t["rubric"]):
            if rng.random() >= p_step:
                continue
            if k < 2 and rng.random() < p_wrong:
                step = f"Vary {wrong_factor}." if k == 0 else f"Measure {wrong_outcome}."
            steps.append(step)
        return " ".join(steps)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("sft", num_sft), ("train", num_train), ("eval", num_eval)):
        path = out / f"{split}.jsonl"
        with path.open("w") as f:
            for _ in range(n):
                t = task()
                answer = {k: t[k] for k in ("goal", "rubric", "reference")}
                if split != "sft":
                    row = {"prompt": policy_prompt(t["goal"]), "answer": answer}
                elif rng.random() < grader_fraction:
                    plan = sample_plan(t)
                    row = {"prompt": grader_prompt(t["goal"], t["rubric"], t["reference"], plan, template="compact"),
                           "target": grades_xml(rule_verdicts(t["rubric"], plan)), "answer": answer}
                else:
                    row = {"prompt": policy_prompt(t["goal"]), "target": f"<solution>{sample_plan(t)}</solution>",
                           "answer": answer}
                f.write(json.dumps(row) + "\n")
        paths[split] = str(path)
    return paths


@register("task", "rubric_self_grade")
def plans_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float, seed: int,
               **_: Any) -> dict[str, str]:
    """`data.synthetic`: `num_train` problems, `sft_fraction` of them SFT rows, the rest RL prompts."""
    n_sft = int(num_train * sft_fraction)
    return write_plans_task(out_dir, num_sft=n_sft, num_train=num_train - n_sft, num_eval=num_eval, seed=seed)

register_alias("task", "plans", "rubric_self_grade")
