"""Guidance: sentence-level citation enforcement by Prefix-Tail guidance during decoding. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.guidance.stage"],
    "decoding": ["rl.methods.guidance.decoding"],
    "task": ["rl.methods.guidance.task"],
}
