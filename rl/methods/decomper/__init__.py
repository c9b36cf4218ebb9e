"""Decomper: low-rank decomposition with representation-drift compensation. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.decomper.stage"],
}
