"""Rubric self-grading for research plans (Goel et al., "Training AI Co-Scientists Using Rubric Rewards"; rl/methods/rubric_self_grade/README.md).

The policy sees only the research goal; a frozen grader (the initial policy) sees the goal, the rubric
items and a reference solution, and for each item lists which of 7 general desiderata the plan
violates. An item passes only with no violation; the reward is the fraction of items that pass.

The reward `rubric_self_grade` asks the judge named by `judge` (`reward.judges`, `model_path: null`
= a frozen copy of the initial policy) for one grading per plan. A plan must sit in
`<solution>...</solution>`; one over `max_words` scores 0 (`over_length: zero`) or is cut to the budget
(`truncate`) [RECONSTRUCTION: the paper's length control was not recovered]. Malformed grader output is
asked again (a new seed; use a grader temperature > 0 for the retry to differ) up to `retries` times,
then the sample is a recorded failure. `template: compact` is a short grader prompt for tiny models
(`data.synthetic.task: rubric_self_grade`, rl/methods/rubric_self_grade/task.py).
"""

from __future__ import annotations

import re
from typing import Any

from rl.methods.rubric_self_grade.prompts import GRADER_TEMPLATES, grader_prompt, policy_prompt, rule_verdicts
from rl.registry import register
from rl.reward import RewardFailure, uses_judges

_ITEM = re.compile(r"<item\s+num\s*=\s*[\"']?(\d+)[\"']?\s*>(.*?)</item>", re.S | re.I)
_ITEM_OPEN = re.compile(r"<item\b", re.I)
_THINK_OPEN, _THINK_CLOSE = re.compile(r"<think>", re.I), re.compile(r"</think>", re.I)
# "none", empty, or the ways a grader writes it ("None.", "N/A", "**none**"): the item has no violation
_NO_ERRORS = ("", "none", "n/a", "na", "no errors", "no violations")
_ERRORS = re.compile(r"<errors>(.*?)</errors>", re.S | re.I)
_SOLUTION = re.compile(r"<solution>(.*?)</solution>", re.S | re.I)


def _item_passes(body: str) -> bool:
    """`<errors>` empty, whitespace or "none" passes; a list of desiderata numbers fails; no `<errors>`
    tag, or anything else in it, fails (a grader that does not answer does not pass the item)."""
    m = _ERRORS.search(body)
    if m is None:
        return False
    errors = m.group(1).strip().strip("*_`'\".").strip().lower()
    return errors in _NO_ERRORS


def strip_reasoning(text: str) -> str | None:
    """The grader's answer without its reasoning: the text after the last `</think>` (a chat template may open
    `<think>` in the prompt, so a closing tag alone counts), or None when a `<think>` block never closes (the
    token limit cut the grader off while it was thinking)."""
    closes = list(_THINK_CLOSE.finditer(text))
    if closes:
        return text[closes[-1].end():]
    return None if _THINK_OPEN.search(text) else text


def parse_grades(text: str, num_items: int) -> list[bool] | None:
    """Pass/fail per rubric item 1..num_items from the grader's XML, or None when the output is malformed (retry
    or record a failure): no item at all, reasoning that never ends, or an `<item>` block cut off by the token
    limit. Reasoning (`<think>…</think>`) is dropped first, so draft items written while thinking never count.
    Items beyond `num_items` are ignored, the first block of a repeated item number is kept, and an item the
    grader skipped fails."""
    answer = strip_reasoning(text)
    if answer is None:
        return None
    complete = list(_ITEM.finditer(answer))
    tail = answer[complete[-1].end():] if complete else answer
    if _ITEM_OPEN.search(tail):  # an item opened after the last closed one: the output was cut off
        return None
    found: dict[int, bool] = {}
    for m in complete:
        num, body = m.group(1), m.group(2)
        k = int(num)
        if 1 <= k <= num_items and k not in found:
            found[k] = _item_passes(body)
    if not found:
        return None
    return [found.get(k, False) for k in range(1, num_items + 1)]


def rubric_score(passes: list[bool]) -> float:
    """Fraction of rubric items that pass (equal weights)."""
    return sum(passes) / len(passes) if passes else 0.0


def extract_plan(response: str, max_words: int | None = None) -> tuple[str | None, bool]:
    """The plan inside the last `<solution>...</solution>` (None when there is none) and whether it is
    over the word budget `max_words`."""
    found = _SOLUTION.findall(response)
    if not found:
        return None, False
    plan = found[-1].strip()
    return plan, max_words is not None and len(plan.split()) > max_words


def research_plan_rows(rows: list[dict[str, Any]], goal_column: str = "Goal", rubric_column: str = "Rubric",
                       reference_column: str = "Reference solution") -> list[dict[str, Any]]:
    """ResearchPlanGen rows (Goal, Rubric list, Reference solution) → looprl rows: `prompt` is the goal
    only; the rubric and reference travel as `ground_truth` for the grader."""
    out = []
    for i, row in enumerate(rows):
        rubric = row[rubric_column]
        if isinstance(rubric, str):
            rubric = [r.strip() for r in rubric.splitlines() if r.strip()]
        if not rubric:
            raise ValueError(f"research-plan row {i}: column {rubric_column!r} is empty")
        out.append({"prompt": policy_prompt(str(row[goal_column])),
                    "ground_truth": {"goal": str(row[goal_column]), "rubric": [str(r) for r in rubric],
                                     "reference": str(row[reference_column])}})
    return out


@register("reward", "rubric_self_grade")
@uses_judges
def rubric_self_grade(prompts: list[str], responses: list[str], *, ground_truth: list[dict], judges: dict[str, Any],
                      judge: str = "grader", max_words: int | None = None, over_length: str = "zero",
                      retries: int = 2, template: str = "full", **_: Any) -> list[Any]:
    """Fraction of rubric items the frozen grader passes, per plan (components: `items_passed`,
    `no_solution`, `over_length`, `grader_attempts`)."""
    if judge not in judges:
        raise ValueError(f"rubric_self_grade needs reward.judges.{judge} (have {sorted(judges)})")
    if over_length not in ("zero", "truncate"):
        raise ValueError(f"rubric_self_grade: over_length must be zero or truncate, got {over_length!r}")
    if template not in GRADER_TEMPLATES:
        raise ValueError(f"rubric_self_grade: template must be one of {sorted(GRADER_TEMPLATES)}, got {template!r}")
    grader = judges[judge]
    results: list[Any] = [None] * len(responses)
    pending = []  # (sample, grader prompt, number of items)
    for i, (response, task) in enumerate(zip(responses, ground_truth)):
        plan, over = extract_plan(response, max_words)
        # every sample carries both flags, so that their logged means are the fractions of the batch
        if plan is None:
            results[i] = {"score": 0.0, "no_solution": 1.0, "over_length": 0.0}
        elif over and over_length == "zero":
            results[i] = {"score": 0.0, "no_solution": 0.0, "over_length": 1.0}
        else:
            if over:
                plan = " ".join(plan.split()[:max_words])
            pending.append((i, grader_prompt(task["goal"], task["rubric"], task["reference"], plan, template),
                            len(task["rubric"])))
    for attempt in range(retries + 1):
        if not pending:
            break
        graded = grader.generate([p for _, p, _ in pending], seed=attempt)
        still = []
        for (i, p, k), text in zip(pending, graded):
            passes = parse_grades(text, k)
            if passes is None:
                still.append((i, p, k))
            else:
                results[i] = {"score": rubric_score(passes), "items_passed": float(sum(passes)),
                              "grader_attempts": float(attempt + 1), "no_solution": 0.0, "over_length": float(over)}
        pending = still
    for i, _, _ in pending:
        results[i] = RewardFailure(f"grader output malformed after {retries + 1} attempts (no <item> block, reasoning "
                                     f"that never closed, or an <item> cut off by the token limit)")
    return results


def write_research_plan_jsonl(src: str, dst: str, goal_column: str = "Goal", rubric_column: str = "Rubric",
                              reference_column: str = "Reference solution") -> int:
    """Convert a ResearchPlanGen split (JSONL/Parquet/`load_from_disk`) into looprl rows (`prompt`,
    `answer` = {goal, rubric, reference}) for `data.train_path`; returns the number of rows."""
    import json
    from pathlib import Path

    from rl.data import load_rows
    rows = research_plan_rows(load_rows(src, [goal_column, rubric_column, reference_column], "research plans"),
                              goal_column, rubric_column, reference_column)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "answer": r["ground_truth"]}) + "\n")
    return len(rows)


if __name__ == "__main__":
    import sys
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m rl.methods.rubric_self_grade.reward SRC DST.jsonl  (ResearchPlanGen split -> looprl rows)")
    print(f"wrote {write_research_plan_jsonl(sys.argv[1], sys.argv[2])} rows to {sys.argv[2]}")


@register("reward", "plan_rubric_check")
def plan_rubric_check(prompt: str, response: str, ground_truth: dict[str, Any], **_: Any) -> float:
    """The rule the SFT grader was taught: share of rubric steps the `<solution>` states as written (0
    without a solution). Log it at weight 0 beside `rubric_self_grade`."""
    plan, _over = extract_plan(response)
    if plan is None:
        return 0.0
    verdicts = rule_verdicts(ground_truth["rubric"], plan)
    return sum(verdicts) / len(verdicts)
