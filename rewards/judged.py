"""`judge_correctness`: a frozen judge model rates an answer against the reference answer, as LongBench-Cite scores
correctness (its answers with citations stripped, rated by a judge against the reference, LongBench-Chat's 1-10
scale read as a share of 10). [RECONSTRUCTION]: the wording of the judge's instruction (LongCite's evaluation asks
GPT-4o in its own words; the scale and the `[[rating]]` format are LongBench-Chat's)."""

from __future__ import annotations

import re
from typing import Any

from rl.registry import register
from rl.reward import RewardFailure, uses_judges

TEMPLATE = ("[Instruction]\nPlease act as an impartial judge and evaluate the quality of the response provided by an "
            "AI assistant to the user question. Your evaluation should consider correctness and helpfulness. You "
            "will be given a reference answer and the assistant's answer. Compare the assistant's answer with the "
            "reference answer, identify any mistakes, and then rate the response on a scale of 1 to 10 by strictly "
            "following this format: \"[[rating]]\", for example: \"Rating: [[5]]\".\n\n[Question]\n{question}\n\n"
            "[The Start of Reference Answer]\n{reference}\n[The End of Reference Answer]\n\n"
            "[The Start of Assistant's Answer]\n{answer}\n[The End of Assistant's Answer]")


def parse_rating(text: str) -> float | None:
    """The last `[[N]]` of the judge's answer as N / 10 (N in 1..10), or None when there is none."""
    found = [int(m) for m in re.findall(r"\[\[\s*(\d+)\s*\]\]", text) if 1 <= int(m) <= 10]
    return found[-1] / 10 if found else None


@register("reward", "judge_correctness")
@uses_judges
def judge_correctness(prompts: list[str], responses: list[str], *, ground_truth: list[Any], judges: dict[str, Any],
                      judge: str = "correctness_judge", retries: int = 1, **_: Any) -> list[Any]:
    """The judge `reward.judges.<judge>`'s rating of each response against its reference (`ground_truth`), in
    [0.1, 1]; a sample whose judge gives no rating after `retries` more tries (other seeds) fails with the reason."""
    if judge not in judges:
        raise ValueError(f"judge_correctness needs reward.judges.{judge} (have {sorted(judges)})")
    results: list[Any] = [None] * len(responses)
    pending = [(i, TEMPLATE.format(question=p, reference=g, answer=r))
               for i, (p, r, g) in enumerate(zip(prompts, responses, ground_truth))]
    for attempt in range(retries + 1):
        if not pending:
            break
        rated = judges[judge].generate([q for _, q in pending], seed=attempt)
        still = []
        for (i, q), text in zip(pending, rated):
            rating = parse_rating(text)
            if rating is None:
                still.append((i, q))
            else:
                results[i] = rating
        pending = still
    for i, _ in pending:
        results[i] = RewardFailure(f"judge {judge!r} gave no [[rating]] in {retries + 1} tries")
    return results
