"""`reward_model`: the score of a frozen reward model served by a judge group (engine `hf_classifier`,
e.g. one trained by the `reward_model` stage), batched across the group's workers."""

from __future__ import annotations

from typing import Any

from rewards.base import uses_judges
from rl.registry import register


@register("reward", "reward_model")
@uses_judges
def reward_model(prompts: list[str], responses: list[str], *, judges: dict[str, Any], judge: str = "reward_model",
                 scale: float = 1.0, shift: float = 0.0, **_columns: Any) -> list[float]:
    """`scale * (RM(prompt, response) + shift)` from the judge group `judge` (`reward.judges.<judge>`)."""
    if judge not in judges:
        raise KeyError(f"reward_model: no judge group {judge!r} in reward.judges (have {sorted(judges)})")
    return [scale * (s + shift) for s in judges[judge].score(prompts, responses)]
