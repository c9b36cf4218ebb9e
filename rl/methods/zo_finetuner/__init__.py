"""ZO Fine-tuner: a learned zeroth-order optimizer. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "optimizer": ["rl.methods.zo_finetuner.optimizer"],
    "stage": ["rl.methods.zo_finetuner.stage"],
}
