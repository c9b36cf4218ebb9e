"""The Ray actor system: the driver (pipeline, stage runner, runtime), the RL run's roles (`rl_roles`: learners, rollout workers, reward service and weight sync behind `rl.loop.roles.RLRoles`), the DeepSpeed learner group, launchers and the CLI.

`BUILTINS`: the modules of `cluster` that register built-ins, by registry kind (read by `rl.registry` through
the entry-point group `looprl.builtins`; importing this package imports none of them)."""

BUILTINS = {
    "stage": ["cluster.pipeline"],
}
