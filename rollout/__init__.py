"""The rollout layer: engines (hf, vLLM), the decode loop and its hooks, environments and the episode runner, the rollout worker and its weight receivers.

`BUILTINS`: the modules of `rollout` that register built-ins, by registry kind (read by `rl.registry` through
the entry-point group `looprl.builtins`; importing this package imports none of them)."""

BUILTINS = {
    "env": ["rollout.envs"],
    "engine": ["rollout.hf_engine", "rollout.vllm_engine", "rollout.classifier_engine"],
    "decoding": ["rollout.decoding"],
}
