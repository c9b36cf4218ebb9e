"""Agentic Proposing: a proposer trained with MGPO to write verifiable problems for a solver. See README.md in this folder."""

# the modules of this method that register built-ins, by registry kind (read by `rl.registry`)
BUILTINS = {
    "stage": ["rl.methods.agentic_proposing.stage"],
    "task": ["rl.methods.agentic_proposing.task"],
    "env": ["rl.methods.agentic_proposing.env"],
    "reward": ["rl.methods.agentic_proposing.reward"],
    "sampler": ["rl.methods.agentic_proposing.core"],
    "advantage": ["rl.methods.agentic_proposing.mgpo"],
}
