"""DenseSteer: steering small models toward dense reasoning. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.densesteer.stage"],
    "decoding": ["rl.methods.densesteer.decoding"],
    "task": ["rl.methods.densesteer.task"],
}
