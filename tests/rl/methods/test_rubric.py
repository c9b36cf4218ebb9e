"""Rubric self-grading protocol (rl/methods/rubric_self_grade/README.md): the parser, robustness, the information gap, the word budget."""

import pytest

from rl.methods.rubric_self_grade.prompts import DESIDERATA, grader_prompt, policy_prompt
from rl.methods.rubric_self_grade.reward import extract_plan, parse_grades, research_plan_rows, rubric_score


def _xml(errors: dict[int, str], k: int = 10) -> str:
    return "Weaknesses: vague budget.\n" + "\n".join(
        f"<item num={i}><criteria>c{i}</criteria><reasoning>r</reasoning><errors>{errors.get(i, 'none')}</errors></item>"
        for i in range(1, k + 1))


def test_parser_case_of_the_spec():
    passes = parse_grades(_xml({3: "2,4", 7: "1,2,3,4,5,6,7", 9: "5"}), 10)
    assert passes == [True, True, False, True, True, True, False, True, False, True]
    assert rubric_score(passes) == pytest.approx(0.7)


def test_robustness():
    missing = _xml({}).replace("<item num=4><criteria>c4</criteria><reasoning>r</reasoning><errors>none</errors>",
                               "<item num=4><criteria>c4</criteria><reasoning>r</reasoning>")
    assert parse_grades(missing, 10)[3] is False  # no <errors>: fails
    assert parse_grades(_xml({}, k=12), 10) == [True] * 10  # more than K items: truncated to K
    dup = _xml({2: "3"}) + "<item num=2><criteria>c</criteria><errors>none</errors></item>"
    assert parse_grades(dup, 10)[1] is False  # a repeated item number keeps the first block
    assert parse_grades(_xml({5: " None "}), 10)[4] is True and parse_grades(_xml({5: ""}), 10)[4] is True
    two_items = _xml({}, k=2)  # a grader that stopped after two items: the ones it skipped fail
    assert parse_grades(two_items, 10) == [True, True] + [False] * 8
    assert parse_grades(_xml({})[:200], 10) is None  # an item cut off by the token limit: retried like malformed
    assert parse_grades("I refuse to grade.", 10) is None  # malformed: nothing to score
    for written in ("None.", "N/A", "**none**", "n/a"):  # "none" as graders write it
        assert parse_grades(_xml({5: written}), 10)[4] is True


def test_reasoning_is_stripped_before_parsing():
    """A thinking grader (Qwen3's template) drafts items while it thinks; only the answer after `</think>` counts,
    also when the template opened `<think>` in the prompt; reasoning cut off by the token limit is malformed."""
    draft = "<item num=1><criteria>c1</criteria><errors>none</errors></item>"
    final = _xml({1: "2"})
    assert parse_grades(f"<think>first pass: {draft}</think>{final}", 10)[0] is False  # before: the draft's pass
    assert parse_grades(f"first pass: {draft}</think>\n{final}", 10)[0] is False
    assert parse_grades(f"<think>still weighing item 1: {draft}", 10) is None


def test_information_gap_and_prompts():
    rows = research_plan_rows([{"Goal": "Reduce label noise in crowd-sourced medical images.",
                                "Rubric": ["Uses a held-out expert-labelled set", "Reports inter-rater agreement"],
                                "Reference solution": "Collect 500 expert labels; estimate a noise transition matrix."}])
    prompt = rows[0]["prompt"]
    assert "Reduce label noise" in prompt
    for secret in ["held-out expert-labelled", "inter-rater", "noise transition", "500 expert"]:
        assert secret not in prompt
    assert rows[0]["ground_truth"]["rubric"] == ["Uses a held-out expert-labelled set", "Reports inter-rater agreement"]
    g = grader_prompt(rows[0]["ground_truth"]["goal"], rows[0]["ground_truth"]["rubric"],
                      rows[0]["ground_truth"]["reference"], "My plan.")
    assert "inter-rater" in g and "noise transition" in g and "My plan." in g and "k = 1..2" in g
    assert all(d in g for d in DESIDERATA)
    assert policy_prompt("G") != g


def test_plan_extraction_and_word_budget():
    assert extract_plan("thinking... <solution> a b c </solution>", max_words=5) == ("a b c", False)
    assert extract_plan("<solution>" + "w " * 6 + "</solution>", max_words=5) == ("w " * 5 + "w", True)
    assert extract_plan("no solution tags", max_words=5) == (None, False)
    assert extract_plan("<solution>draft</solution> <solution>final plan</solution>")[0] == "final plan"


def test_research_plan_split_converts_to_looprl_rows(tmp_path):
    import json

    from rl.data import load_rows
    from rl.methods.rubric_self_grade.reward import write_research_plan_jsonl
    src = tmp_path / "ml_train.jsonl"
    src.write_text(json.dumps({"Goal": "Find G.", "Rubric": ["r1", "r2"], "Reference solution": "Ref.",
                               "article_id": "a1"}) + "\n")
    assert write_research_plan_jsonl(str(src), str(tmp_path / "rows.jsonl")) == 1
    rows = load_rows(str(tmp_path / "rows.jsonl"), ["prompt", "answer"], "test")
    assert rows[0]["answer"] == {"goal": "Find G.", "rubric": ["r1", "r2"], "reference": "Ref."}
    assert "r1" not in rows[0]["prompt"] and "Find G." in rows[0]["prompt"]
