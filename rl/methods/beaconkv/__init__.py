"""BeaconKV: KV-cache compression guided by beacon queries (and the baselines it is measured against). See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "decoding": ["rl.methods.beaconkv.decoding"],
}
