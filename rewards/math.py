"""Rule-based math reward: 1.0 when the last `\\boxed{}` answer is math-equivalent to the ground truth.

Uses math-verify. math-verify's own timeouts rely on `signal.alarm`, which only works in a main
thread: the reward service therefore runs this in worker processes, never in threads.
"""

from __future__ import annotations

import logging
from typing import Any

from rl.answers import last_boxed
from rl.registry import register

# Our reward service enforces the per-sample timeout itself; silence the "timeout disabled" notice.
logging.getLogger("math_verify").setLevel(logging.ERROR)


@register("reward", "math")
def math_reward(prompt: str, response: str, *, ground_truth: Any = None, metadata: dict | None = None,
                require_boxed: bool = True, **_: Any) -> float | None:
    """1.0 if the response's boxed answer equals `ground_truth` under math-verify, else 0.0.

    Returns None (not applicable) when the sample has no ground truth. With `require_boxed`
    (default) a response without `\\boxed{` scores 0 even if a bare number matches.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if ground_truth is None or str(ground_truth).strip() == "":
        return None
    boxed = last_boxed(response)
    if require_boxed and boxed is None:
        return 0.0
    # Timeouts off: math-verify's signal.alarm would cancel the reward service's own per-sample timer.
    gold = parse(str(ground_truth), extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=None)
    if not gold:
        gold = parse(f"${ground_truth}$", parsing_timeout=None)
    # Grade the last boxed answer (the common convention): math-verify alone would take the first.
    answer = parse(boxed or response, extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                   parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0


@register("reward", "digit_credit")
def digit_credit_reward(prompt: str, response: str, *, ground_truth: Any = None, **_: Any) -> float | None:
    """Partial credit for an integer answer: the share of the answer's digits the last `\\boxed{}` gets right in
    place, aligned from the units digit (a wrong length loses the unmatched places). 1.0 only when exact, 0.0
    without a boxed integer. The partial-credit setting of TGPO (rl/methods/tgpo/README.md), where an imperfect trajectory
    still carries signal; None without a ground truth."""
    if ground_truth is None or str(ground_truth).strip() == "":
        return None
    boxed = last_boxed(response)
    said = boxed[len("\\boxed{"):-1].strip() if boxed else ""
    truth = str(ground_truth).strip()
    if not said.lstrip("-").isdigit() or not truth.lstrip("-").isdigit():
        return 0.0
    if said == truth:
        return 1.0
    places = max(len(said), len(truth))
    same = sum(a == b for a, b in zip(reversed(said), reversed(truth)))
    return same / places
