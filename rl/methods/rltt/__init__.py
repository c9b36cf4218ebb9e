"""RLTT: rewarding the latent thought trajectories of looped language models. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "loss": ["rl.methods.rltt.loss"],
}
