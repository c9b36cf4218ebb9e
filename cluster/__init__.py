"""The modules of `cluster` that register built-ins, by registry kind (read by `rl.registry` through the
entry-point group `looprl.builtins`; importing this package imports none of them)."""

BUILTINS = {
    "stage": ["cluster.pipeline"],
}
