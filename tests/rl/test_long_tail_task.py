"""The long_tail_arithmetic task: hand-written work for chains, and the long tail it writes."""

import json
import statistics

import pytest

from rl.registry import lookup
from rl.tasks.arithmetic import chain_prompt, chain_target, chain_value, correct_target, wrong_order_target


def test_a_chain_is_worked_product_by_product_then_summed_left_to_right():
    terms = (12, 34, 7, 56, 3)
    assert chain_prompt(terms) == "12+34*7+56*3="
    assert chain_value(terms) == 12 + 238 + 168 == 418
    assert chain_target(terms, wrong=False) == "34*7=238,56*3=168,12+238=250,250+168=418\\boxed{418}"
    # the wrong order of operations on the first product only: (12+34)*7 + 56*3
    assert chain_target(terms, wrong=True) == "12+34=46,46*7=322,56*3=168,322+168=490\\boxed{490}"


def test_a_chain_of_one_product_is_the_quickstarts_problem():
    assert chain_prompt((12, 34, 7)) == "12+34*7="
    assert chain_target((12, 34, 7), wrong=False) == correct_target(12, 34, 7)
    assert chain_target((12, 34, 7), wrong=True) == wrong_order_target(12, 34, 7)


def _read(path):
    return [json.loads(line) for line in open(path)]


def test_the_task_writes_one_long_problem_in_eight_with_about_six_times_the_work(tmp_path):
    paths = lookup("task", "long_tail_arithmetic")(tmp_path, num_train=1600, num_eval=200, sft_fraction=0.5,
                                                   wrong_order_fraction=0.5, seed=3)
    splits = {name: _read(p) for name, p in paths.items()}
    assert [len(splits[k]) for k in ("sft", "train", "eval")] == [800, 800, 200]
    prompts = [{r["prompt"] for r in splits[k]} for k in ("sft", "train", "eval")]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
    rows = [r for k in ("sft", "train", "eval") for r in splits[k]]
    long = [r for r in rows if r["prompt"].count("*") == 8]
    assert len(long) + sum(r["prompt"].count("*") == 1 for r in rows) == len(rows)
    assert 0.10 < len(long) / len(rows) < 0.15
    for r in rows:  # the answer is the value with the right order of operations
        assert int(r["answer"]) == eval(r["prompt"].rstrip("="))  # noqa: S307 (digits, + and * only)
    sft = splits["sft"]
    right = [r for r in sft if r["target"].endswith(f"\\boxed{{{r['answer']}}}")]
    assert 0.4 < len(right) / len(sft) < 0.6  # wrong_order_fraction 0.5
    length = {n: statistics.median(len(r["target"]) for r in sft if r["prompt"].count("*") == n) for n in (1, 8)}
    assert 5 < length[8] / length[1] < 8


def test_bad_params_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="data.synthetic.params.*long_fraction=1.5"):
        lookup("task", "long_tail_arithmetic")(tmp_path, num_train=10, num_eval=2, sft_fraction=0.5,
                                               wrong_order_fraction=0.5, seed=0, long_fraction=1.5)
