"""The synthetic research-plan task: rubric rule, grader targets in the XML protocol, no rubric leak."""

import json

import pytest

from rl.methods.rubric_self_grade.prompts import COMPACT_GRADER_TEMPLATE, grader_prompt, rule_verdicts
from rl.methods.rubric_self_grade.reward import parse_grades, plan_rubric_check, rubric_self_grade
from rl.methods.rubric_self_grade.task import grades_xml, plan_steps, write_plans_task

RUBRIC = plan_steps("salt", "growth")
TASK = {"goal": "Find how salt changes growth.", "rubric": RUBRIC, "reference": " ".join(RUBRIC)}


def test_the_rule_passes_steps_stated_as_written():
    assert RUBRIC == ["Vary salt.", "Measure growth.", "Keep a control.", "Repeat it 3 times."]
    assert rule_verdicts(RUBRIC, "Vary salt. Keep a control.") == [True, False, True, False]
    assert rule_verdicts(RUBRIC, "Vary heat. Measure growth.  Repeat it 3 times.") == [False, True, False, True]
    assert rule_verdicts(RUBRIC, "") == [False] * 4
    assert plan_rubric_check("p", "<solution>Vary salt. Measure growth.</solution>", TASK) == 0.5
    assert plan_rubric_check("p", "Vary salt. Measure growth.", TASK) == 0.0  # no <solution>


def test_grader_targets_parse_back_to_the_rule():
    for verdicts in ([True] * 4, [False] * 4, [True, False, False, True]):
        assert parse_grades(grades_xml(verdicts), 4) == verdicts


def test_written_splits(tmp_path):
    paths = write_plans_task(tmp_path, num_sft=400, num_train=20, num_eval=10, seed=3)
    sft = [json.loads(x) for x in open(paths["sft"])]
    grader_rows = [r for r in sft if r["prompt"].startswith("Goal: ")]
    policy_rows = [r for r in sft if not r["prompt"].startswith("Goal: ")]
    assert 150 < len(grader_rows) < 250 and len(grader_rows) + len(policy_rows) == 400
    for r in grader_rows:  # every grader target is the rule's verdict on the plan in its prompt
        a = r["answer"]
        plan = r["prompt"].split("\nPlan: ")[1].split("\n")[0]
        assert r["prompt"] == grader_prompt(a["goal"], a["rubric"], a["reference"], plan, template="compact")
        assert parse_grades(r["target"], 4) == rule_verdicts(a["rubric"], plan)
    passed = [sum(parse_grades(r["target"], 4)) for r in grader_rows]
    assert 0.3 < sum(passed) / (4 * len(passed)) < 0.7  # the grader sees both passing and failing items
    assert len(set(passed)) >= 4
    for r in policy_rows:
        assert r["target"].startswith("<solution>") and r["target"].endswith("</solution>")
    for split in ("train", "eval"):
        for r in (json.loads(x) for x in open(paths[split])):
            assert r["answer"]["goal"] in r["prompt"]
            assert not any(item in r["prompt"] for item in r["answer"]["rubric"])  # the policy sees the goal only


class RuleGrader:
    """A test double: grades by the rule, so the reward's compact path can be checked end to end."""

    def generate(self, prompts, **sampling):
        out = []
        for p in prompts:
            rubric = [line.split(". ", 1)[1] for line in p.split("Rubric:\n")[1].split("\nReference:")[0].splitlines()]
            out.append(grades_xml(rule_verdicts(rubric, p.split("\nPlan: ")[1].split("\n")[0])))
        return out


def test_compact_template_through_the_reward():
    assert "Errors per item" in COMPACT_GRADER_TEMPLATE
    out = rubric_self_grade(["p"], ["<solution>Vary salt. Keep a control. Repeat it 3 times.</solution>"],
                            ground_truth=[TASK], judges={"grader": RuleGrader()}, template="compact")
    assert out[0]["score"] == 0.75
    with pytest.raises(ValueError, match="template"):
        rubric_self_grade(["p"], ["x"], ground_truth=[TASK], judges={"grader": RuleGrader()}, template="short")
