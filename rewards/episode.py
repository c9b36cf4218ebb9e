"""Rewards of environment episodes (`rollout.env`)."""

from __future__ import annotations

from typing import Any

from rl.registry import register


@register("reward", "env_return")
def env_return(prompt: str, response: str, *, metadata: dict[str, Any] | None = None, **_: Any) -> float | None:
    """The episode's return: the sum of the environment's per-turn rewards (None outside an environment)."""
    if not metadata or "env_return" not in metadata:
        return None
    return float(metadata["env_return"])
