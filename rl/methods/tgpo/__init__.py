"""TGPO: Trust-Gated Policy Optimization. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "loss": ["rl.methods.tgpo.loss"],
}
