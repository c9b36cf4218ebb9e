"""The environment contract (registry kind `env`): multi-turn episodes around the policy's generations.

Contract (one object per episode, built as `Cls(**rollout.env_params)`):

* `reset(prompt, row, seats) -> str`: the first observation, the text the policy is prompted with
  (`prompt` is the formatted dataset prompt; `row` the dataset row: answer, metadata).
* `step(action) -> EnvStep`: the policy's turn `action` (its text) → the observation appended after it,
  a reward for the turn, whether the episode is done, whether the turn failed (a tool that hung or
  crashed: recorded, the episode goes on), the turn's type (`step_type`: MGPO normalises step rewards per
  type, e.g. `tool` and `reflection`) and info. An exception is a failed step too: the episode ends
  there; the rollout goes on.
* `finish() -> list[float] | None` (optional): called once the episode is over (done, out of turns or
  tokens); a list restates the rewards of the turns stepped so far, in order, for a turn whose reward
  depends on later ones (a tool output the policy used afterwards).

`seats.ask(text, seat)` lets an environment have other seats played: by the current policy (`policy`, its
moves are context for the trained seat, never trained on) or by a frozen model (`frozen`,
`rollout.env_opponent_path`). The rollout loop (`rollout.multiturn`) works on token ids: what the policy
sampled is kept as sampled, observations are tokenised once and appended as ids and masked out of the
loss (`observation_mask`); each turn's tokens carry its index (`token_step`) and reward (`step_rewards`).
Single-turn generation is the trivial environment (`rollout.env: null`, the engines' plain path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl.registry import register


@dataclass
class EnvStep:
    observation: str | None = None  # text appended after the action (ignored when done)
    reward: float = 0.0  # this turn's reward (summed into metadata env_return)
    done: bool = False
    failed: bool = False  # the turn failed (a tool that hung or crashed); counted in metadata failed_turns, the episode goes on
    step_type: str | None = None  # the turn's type in step_types (MGPO's per-type pools); None: "action", or "failed" for a failed turn
    info: dict[str, Any] = field(default_factory=dict)


class Env:
    """Base class (optional): the trivial single-turn environment."""

    def reset(self, prompt: str, row: dict[str, Any], seats: Any) -> str:
        return prompt

    def step(self, action: str) -> EnvStep:
        return EnvStep(done=True)


register("env", "single_turn")(Env)
