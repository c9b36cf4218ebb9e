"""Environment plugin: one object per episode; `reset(prompt, row, seats)` gives the first observation,
`step(action)` the observation after the policy's turn, a reward and whether the episode is done.
Recipe: `rollout.env: recipes/extending/env.py:GuessTheAnswer` with `reward.functions: [{name: env_return}]`."""

import re

from rl.env import Env, EnvStep


class GuessTheAnswer(Env):
    """The policy guesses the row's numeric answer; the environment replies `higher` or `lower` until it
    is right (reward 1) or the turns run out."""

    def reset(self, prompt: str, row: dict, seats) -> str:
        self.answer = int(row["answer"])
        return prompt

    def step(self, action: str) -> EnvStep:
        guess = re.search(r"-?\d+", action)
        if guess is None:
            return EnvStep(observation=" number?\n")
        value = int(guess.group())
        if value == self.answer:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(observation=" higher\n" if value < self.answer else " lower\n")
