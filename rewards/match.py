"""String-match reward: 1.0 when the response states the ground truth exactly (after light normalisation)."""

from __future__ import annotations

from typing import Any

from rl.registry import register


@register("reward", "exact_match")
def exact_match_reward(prompt: str, response: str, *, ground_truth: Any = None, first_line: bool = True,
                       ignore_case: bool = False, **_: Any) -> float | None:
    """1.0 if the response equals `ground_truth` after stripping whitespace (with `first_line`, only the
    response's first line counts; with `ignore_case`, case is ignored), else 0.0; None without a ground truth."""
    if ground_truth is None or str(ground_truth).strip() == "":
        return None
    said = response.strip().split("\n", 1)[0].strip() if first_line else response.strip()
    truth = str(ground_truth).strip()
    if ignore_case:
        said, truth = said.lower(), truth.lower()
    return 1.0 if said == truth else 0.0
