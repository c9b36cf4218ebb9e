"""The reward function contract and how results are normalised.

A reward function is `fn(prompt, response, *, ground_truth=None, metadata=None, **columns)` and
returns a float, `dict(score=..., **components)` or `None` ("not applicable"). It may be `async`.
A *batched* reward (decorated with `@batched`) receives lists and returns a list of the same length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def batched(fn: Callable) -> Callable:
    """Mark `fn(prompts, responses, *, ground_truth, metadata, **columns) -> list` as batched."""
    fn.looprl_batched = True  # type: ignore[attr-defined]
    return fn


def is_batched(fn: Callable) -> bool:
    return bool(getattr(fn, "looprl_batched", False))


def uses_judges(fn: Callable) -> Callable:
    """Mark a batched reward that calls judge engines: the reward service runs it in its own process
    (where the judges' Ray handles live) with `judges={name: rewards.judges.JudgeClient}`."""
    fn.looprl_batched = True  # type: ignore[attr-defined]
    fn.looprl_judges = True  # type: ignore[attr-defined]
    return fn


def needs_judges(fn: Callable) -> bool:
    return bool(getattr(fn, "looprl_judges", False))


class RewardFailure:
    """Return this for a sample whose reward could not be computed (e.g. a grader that kept answering
    malformed output): the sample is recorded as failed with `reason` and leaves the loss."""

    def __init__(self, reason: str):
        self.reason = reason


@dataclass
class RewardResult:
    """One sample's reward: `score` is None when the function said "not applicable"."""
    score: float | None
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when the function raised, timed out or returned a bad value
    steps: dict[str, list] | None = None  # process rewards: {"rewards": [...], "ends": [character offsets]}
    valid: bool | None = None  # the sample passed the reward's validity check (MGPO's gate); None: not reported

    @property
    def failed(self) -> bool:
        return self.error is not None


def normalize_result(value: Any, plugin: str) -> RewardResult:
    """Turn a plugin's return value into a RewardResult; bad types and NaN become recorded errors."""
    if value is None:
        return RewardResult(None)
    if isinstance(value, RewardFailure):
        return RewardResult(None, error=f"reward {plugin!r}: {value.reason}")
    components: dict[str, float] = {}
    steps, valid = None, None
    if isinstance(value, dict):
        if "score" not in value:
            return RewardResult(None, error=f"reward {plugin!r} returned a dict without 'score': {sorted(value)}")
        components = {k: float(v) for k, v in value.items()
                      if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "step_rewards" in value:  # a process reward: one reward per step, each step ending at a character
            rewards, ends = list(value["step_rewards"]), list(value.get("step_ends", []))
            if len(rewards) != len(ends) or not all(isinstance(x, (int, float)) for x in rewards + ends):
                return RewardResult(None, error=f"reward {plugin!r}: step_rewards and step_ends must be two lists of "
                                                f"numbers of one length, got {len(rewards)} and {len(ends)}")
            steps = {"rewards": [float(x) for x in rewards], "ends": [int(x) for x in ends]}
        if "valid" in value:  # a validity verdict (MGPO's gate V): a bool, kept apart from the numeric components
            if not isinstance(value["valid"], bool):
                return RewardResult(None, error=f"reward {plugin!r}: 'valid' must be a bool, got "
                                                f"{type(value['valid']).__name__}")
            valid = value["valid"]
        value = value["score"]
        if value is None:
            return RewardResult(None, components)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            import torch
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = float(value)
            else:
                raise TypeError
        except (ImportError, TypeError):
            return RewardResult(None, error=f"reward {plugin!r} returned {type(value).__name__}, "
                                            f"expected float, dict(score=...) or None")
    score = float(value)
    if math.isnan(score) or math.isinf(score):
        return RewardResult(None, components, error=f"reward {plugin!r} returned {score}")
    return RewardResult(score, components, steps=steps, valid=valid)
