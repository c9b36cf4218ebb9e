"""DSR: Decompose, Structure, Repair for autoformalization. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.dsr.stage"],
    "task": ["rl.methods.dsr.task"],
}
