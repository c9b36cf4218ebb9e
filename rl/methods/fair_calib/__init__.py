"""FAIR-Calib: post-training quantization calibrated for masked-diffusion LMs. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.fair_calib.stage"],
}
