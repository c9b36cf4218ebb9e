"""EP-Order: embedding-proximity ordering of SFT data with mixed regions. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.ep_order.stage"],
}
