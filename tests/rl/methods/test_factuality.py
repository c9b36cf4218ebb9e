"""Factuality reward (rl/methods/factuality/README.md): the arithmetic, the hacking probes, the verdict cache, the service path."""

import math

import pytest

from rewards.service import RewardService, RewardSpec
from rl.methods.factuality import reward as factuality
from rl.methods.factuality.reward import (
    answer_part,
    factuality_reward,
    factuality_score,
    parse_claim_lines,
    says_yes,
    sentence_claims,
    verify_claims,
)

FACTS = [f"The river {name} flows through the valley of {place} in spring." for name, place in
         [("Alder", "Brenn"), ("Birch", "Corva"), ("Cedar", "Dalm"), ("Elm", "Fenn"), ("Fir", "Gorse"),
          ("Hazel", "Ivra"), ("Juniper", "Kell"), ("Larch", "Morra"), ("Maple", "Nerr"), ("Oak", "Pell")]]
FALSE = "The river Willow flows through the valley of Zanth in winter."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "passages.txt"
    path.write_text("\n".join(FACTS + ["Mountains surround the northern valleys.", "Snow falls in Morra."]))
    return str(path)


def test_component_arithmetic():
    assert factuality_score(8, 10, 1.0, lam=0.1, mu=0.1) == pytest.approx(0.8 + 0.1 * math.log(9) + 0.1)
    assert factuality_score(8, 10, 1.0, lam=0.1, mu=0.1) == pytest.approx(1.11972, abs=1e-5)
    assert factuality_score(8, 10, 1.0, lam=0.0, mu=0.1) == pytest.approx(0.9)
    assert factuality_score(0, 0, 0.0, lam=0.1, mu=0.1) == 0.0  # no claims: precision 0


def test_format():
    assert answer_part("<think>plan</think> Answer.") == "Answer."
    assert answer_part("no think block") is None
    assert answer_part("<think>x</think>   ") is None
    assert answer_part("<think>x</think> Answer.", truncated=True) is None
    assert answer_part("reasoning without an opening tag</think> Answer.") is None  # no think/answer structure
    # a chat template that opens the reasoning in the prompt (Qwen3, DeepSeek-R1): the response starts inside it
    assert answer_part("reasoning</think> Answer.", prompt="<|im_start|>assistant\n<think>\n") == "Answer."
    assert sentence_claims("Short. The river Alder flows north! Is it cold?") == ["The river Alder flows north!"]


def _score(corpus, answers, lam, mu, reference=None):
    responses = [f"<think>recall the rivers</think> {a}" for a in answers]
    out = factuality_reward(["Tell me about rivers."] * len(answers), responses,
                            ground_truth=[reference] * len(answers), corpus=corpus, lam=lam, mu=mu)
    return [o["score"] for o in out], out


def test_invalid_format_scores_minus_one(corpus):
    out = factuality_reward(["q", "q"], ["no think tag at all", "<think>x</think> " + FACTS[0]],
                            truncated=[False, True], corpus=corpus, lam=0.1, mu=0.1)
    assert [o["score"] for o in out] == [-1.0, -1.0]


def test_hacking_probes(corpus):
    one = FACTS[0]
    ten = " ".join(FACTS[:9] + [FALSE])  # 10 claims, 9 supported
    (r1, r10), comps = _score(corpus, [one, ten], lam=0.0, mu=0.0)
    assert comps[1]["claims"] == 10 and comps[1]["supported"] == 9 and comps[0]["supported"] == 1
    assert (r1, r10) == (pytest.approx(1.0), pytest.approx(0.9))  # precision only: the short answer wins
    (r1, r10), _ = _score(corpus, [one, ten], lam=0.1, mu=0.0)
    assert r10 == pytest.approx(0.9 + 0.1 * math.log(10), abs=1e-9) and r10 == pytest.approx(1.1303, abs=1e-4)
    assert r1 == pytest.approx(1.0 + 0.1 * math.log(2), abs=1e-9) and r1 == pytest.approx(1.0693, abs=1e-4)
    assert r10 > r1  # detail is now rewarded
    # same facts, one answer on topic (shares the reference's words) and one padded off topic: μ breaks the tie
    reference = "The river Alder flows through the valley of Brenn in spring."
    on, off = FACTS[0], "Mountains surround the northern valleys."
    (r_on, r_off), _ = _score(corpus, [on, off], lam=0.1, mu=0.0, reference=reference)
    assert r_on == r_off
    (r_on, r_off), comps = _score(corpus, [on, off], lam=0.1, mu=0.1, reference=reference)
    assert comps[0]["relevance"] == 1.0 and comps[1]["relevance"] == 0.0 and r_on - r_off == pytest.approx(0.1)


def test_verdict_cache_checks_each_claim_once(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(f'{{"text": "{f}"}}\n' for f in FACTS))
    factuality._VERDICTS.clear()
    verdicts, checked = verify_claims([FACTS[0], FACTS[0], FALSE, FACTS[1]], str(path))
    assert verdicts == [True, True, False, True] and checked == 3  # the duplicate is checked once
    again, checked = verify_claims([FALSE, FACTS[1]], str(path))
    assert again == [False, True] and checked == 0  # later steps: all from the cache
    assert _score(str(path), [FACTS[2]], 0.1, 0.1)[0] == _score(str(path), [FACTS[2]], 0.1, 0.1)[0]


def test_verdicts_are_cached_per_configuration_and_bounded(tmp_path):
    """Two configurations in one process (different support thresholds, retrieval depth or judge) never share
    a verdict; the cache keeps at most `cache_size` verdicts."""
    path = tmp_path / "c.txt"
    path.write_text("\n".join(FACTS))
    half = "The river Alder flows through the valley of Zanth."  # 5 of its 6 content words are in FACTS[0]
    factuality._VERDICTS.clear()
    assert verify_claims([half], str(path), support_overlap=0.8) == ([True], 1)
    assert verify_claims([half], str(path), support_overlap=0.9) == ([False], 1)  # before: True from the cache
    assert verify_claims([half], str(path), support_overlap=0.8, top_k=1) == ([True], 1)
    assert verify_claims([half], str(path), support_overlap=0.8) == ([True], 0)
    factuality._VERDICTS.clear()
    verify_claims(FACTS[:6], str(path), cache_size=4)
    assert len(factuality._VERDICTS) == 6  # one call's claims all stay
    verify_claims(FACTS[6:8], str(path), cache_size=4)
    assert len(factuality._VERDICTS) == 4
    assert verify_claims(FACTS[6:8], str(path), cache_size=4)[1] == 0  # the most recent survive
    assert verify_claims(FACTS[:1], str(path), cache_size=4)[1] == 1  # the oldest were evicted


def test_judge_answers_are_parsed_like_a_reader_would():
    assert [says_yes(a) for a in ("**Yes**", '"Yes."', "- yes, it is", " Yes", "No.", "yesterday", "**No**")] == \
        [True, True, True, True, False, False, False]
    listed = "Here are the claims:\n1. The river Alder flows north.\n- **Snow falls in Morra.**\n\nSure, that is all."
    assert parse_claim_lines(listed) == ["The river Alder flows north.", "Snow falls in Morra."]
    assert parse_claim_lines("The following year the river flooded.") == ["The following year the river flooded."]


def test_through_the_reward_service_with_components(corpus):
    service = RewardService([RewardSpec("factuality", 1.0, {"corpus": corpus, "lam": 0.1, "mu": 0.0})], num_workers=2)
    try:
        items = [{"prompt": "q", "response": f"<think>t</think> {a}", "ground_truth": None, "metadata": {},
                  "truncated": t} for a, t in [(FACTS[0], False), (FALSE, False), (FACTS[1], True)]]
        scored = service.score(items)
    finally:
        service.close()
    assert [s["score"] for s in scored] == [pytest.approx(1.0 + 0.1 * math.log(2)), 0.0, -1.0]
    assert scored[0]["components"]["factuality/supported"] == 1.0 and scored[1]["components"]["factuality/claims"] == 1.0
