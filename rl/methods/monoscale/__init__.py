"""MonoScale: router memory updates when agents are added to a pool. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.monoscale.stage"],
    "task": ["rl.methods.monoscale.task"],
    "env": ["rl.methods.monoscale.env"],
}
