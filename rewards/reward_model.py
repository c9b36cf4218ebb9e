"""`reward_model`: the score of a frozen reward model served by a judge group (engine `hf_classifier`,
e.g. one trained by the `reward_model` stage), batched across the group's workers."""

from __future__ import annotations

from typing import Any

from rl.registry import register
from rl.reward import uses_judges


@register("reward", "reward_model")
@uses_judges
def reward_model(prompts: list[str], responses: list[str], *, judges: dict[str, Any], judge: str = "reward_model",
                 scale: float = 1.0, shift: float = 0.0, **_columns: Any) -> list[float]:
    """`scale * (RM(prompt, response) + shift)` from the judge group `judge` (`reward.judges.<judge>`)."""
    if judge not in judges:
        raise KeyError(f"reward_model: no judge group {judge!r} in reward.judges (have {sorted(judges)})")
    return [scale * (s + shift) for s in judges[judge].score(prompts, responses)]


@register("reward", "process_reward_model")
@uses_judges
def process_reward_model(prompts: list[str], responses: list[str], *, judges: dict[str, Any],
                         judge: str = "reward_model", delimiter: str = "\n", aggregate: str = "last",
                         **_columns: Any) -> list[dict]:
    """Step rewards from a reward model scored at the end of every step (a step ends after each `delimiter`,
    the last one at the response's end): step k's reward is `RM(prompt, response[:end_k])`, all prefixes of
    the batch scored in one batched call. The sample's score is the last step's (`aggregate: last`) or the
    lowest (`min`). The steps reach the batch as `step_rewards` and `token_step` (for `mgpo`'s step
    advantages). [Design choice: an outcome-trained model read on prefixes; a model trained on step labels
    plugs in the same way.]"""
    import re
    if judge not in judges:
        raise KeyError(f"process_reward_model: no judge group {judge!r} in reward.judges (have {sorted(judges)})")
    if aggregate not in ("last", "min"):
        raise ValueError(f"process_reward_model: aggregate must be last or min, got {aggregate!r}")
    ends_per_row, queries = [], []
    for prompt, response in zip(prompts, responses):
        ends = [m.end() for m in re.finditer(re.escape(delimiter), response)] if delimiter else []
        if not ends or ends[-1] != len(response):
            ends.append(len(response))
        ends_per_row.append(ends)
        queries += [(prompt, response[:e]) for e in ends]
    scores = judges[judge].score([q[0] for q in queries], [q[1] for q in queries])
    out, k = [], 0
    for ends in ends_per_row:
        steps = scores[k:k + len(ends)]
        k += len(ends)
        out.append({"score": steps[-1] if aggregate == "last" else min(steps), "step_rewards": steps, "step_ends": ends})
    return out
