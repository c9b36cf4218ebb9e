"""The prompts of rubric self-grading (Goel et al., "Training AI Co-Scientists Using Rubric Rewards") and the rule
of the synthetic `plans` task: what the policy and the grader are shown, Ray-free, so that the task generator
(`rl.methods.rubric_self_grade.task`) and the reward (`rl.methods.rubric_self_grade.reward`) write the same text."""

from __future__ import annotations

import re

DESIDERATA = (
    "handles all criteria of the item (lists introduced by 'such as' / 'e.g.' need not be matched exactly)",
    "gives detailed, specific how-to, with no vague or self-proclaimed claims",
    "has no overlooked flaws that invalidate the item",
    "gives a well-justified rationale, compared with simpler alternatives",
    "is cost- and effort-efficient",
    "raises no ethical issues",
    "is consistent with the rest of the plan",
)

POLICY_TEMPLATE = (
    "Research goal:\n{goal}\n\nWrite a research plan that achieves this goal. You may think first; put the "
    "final plan inside <solution>...</solution>."
)

GRADER_TEMPLATE = """You are a skeptical, strict reviewer of research plans.

Research scenario:
{goal}

Rubric items (each must be addressed by the plan):
{rubric}

Reference solution (only one valid approach; the plan need not match its details):
{reference}

Proposed plan:
{plan}

First list the weaknesses of the plan that are specific to this scenario. Then, for every rubric item
k = 1..{k}, write
<item num=k><criteria>the item</criteria><reasoning>your assessment</reasoning><errors>...</errors></item>
where <errors> lists, as comma-separated numbers, every general desideratum below that the plan violates
for this item, or "none". If no part of the plan addresses the item, list all of 1,2,3,4,5,6,7.
General desiderata:
{desiderata}
"""

# [RECONSTRUCTION] A short grader prompt for tiny models with short contexts (the `plans` synthetic task):
# the same goal, rubric, reference and plan, the same XML answer, the desiderata by number only.
COMPACT_GRADER_TEMPLATE = """Goal: {goal}
Rubric:
{rubric}
Reference: {reference}
Plan: {plan}
Errors per item (desiderata 1-7, or none):
"""
GRADER_TEMPLATES = {"full": GRADER_TEMPLATE, "compact": COMPACT_GRADER_TEMPLATE}

def policy_prompt(goal: str) -> str:
    """What the policy sees: the goal only (never the rubric or the reference)."""
    return POLICY_TEMPLATE.format(goal=goal.strip())


def grader_prompt(goal: str, rubric: list[str], reference: str, plan: str, template: str = "full") -> str:
    """What the grader sees: goal, numbered rubric items, reference solution and the plan (`full`: the
    paper's prompt with the 7 desiderata spelled out; `compact`: the short one for tiny models)."""
    if template not in GRADER_TEMPLATES:
        raise ValueError(f"rubric_self_grade: template must be one of {sorted(GRADER_TEMPLATES)}, got {template!r}")
    items = "\n".join(f"{i}. {r}" for i, r in enumerate(rubric, 1))
    desiderata = "\n".join(f"{i}. {d}" for i, d in enumerate(DESIDERATA, 1))
    return GRADER_TEMPLATES[template].format(goal=goal.strip(), rubric=items, reference=reference.strip(), plan=plan.strip(),
                                  k=len(rubric), desiderata=desiderata)


# the rule of the synthetic plans task
def plan_sentences(plan: str) -> set[str]:
    return {s.strip() + "." for s in re.split(r"\.\s*", plan) if s.strip()}


def rule_verdicts(rubric: list[str], plan: str) -> list[bool]:
    """An item passes when the plan states its step as written."""
    said = plan_sentences(plan)
    return [item in said for item in rubric]
