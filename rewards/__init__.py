"""The rewards layer: reward functions, the Ray-free scoring runner, the reward service actor, remote rewards and judges.

`BUILTINS`: the modules of `rewards` that register built-ins, by registry kind (read by `rl.registry` through
the entry-point group `looprl.builtins`; importing this package imports none of them)."""

BUILTINS = {
    "reward": ["rewards.math", "rewards.episode", "rewards.remote", "rewards.reward_model", "rewards.match",
               "rewards.judged"],
    "stage": ["rewards.reward_model_stage"],
}
