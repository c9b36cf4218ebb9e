"""Long-form factuality RL: claim-level factual precision and detail as the reward. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "reward": ["rl.methods.factuality.reward"],
    "task": ["rl.methods.factuality.task"],
}
