"""MEMO: self-play context optimisation on text games. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.memo.stage"],
    "task": ["rl.methods.memo.task"],
    "env": ["rl.methods.memo.textarena"],
}
