"""BLISS: bilevel influence scoring for SFT data selection. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.bliss.stage"],
}
