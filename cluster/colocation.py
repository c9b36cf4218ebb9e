"""Colocated roles take turns on one device: the phase choreography of an RL step.

With `rollout.sleep_between_phases` (the engines free their weights and KV cache while the learner computes) or
`learner.offload_between_phases` (the learner's optimizer states, master weights and gradients wait in host memory
while the engines generate), each step passes through four turns:

1. `rollout_turn`: the learner's states leave the device; the engines generate with their KV cache.
2. `learner_turn`: the engines sleep; the learner's states come back (logprobs, advantages, update).
3. `weights_turn`: the engines wake their weights only, so the new weights go straight in (the sync).
4. `cache_turn`: the learner's states leave again, then the engines' KV cache comes back.

Without either setting every turn is a no-op and both roles keep the device.
"""

from __future__ import annotations

import time
from typing import Any

import ray


class Colocation:
    """The turns of the learner group `learners` and the rollout workers `rollout` on shared devices."""

    def __init__(self, learners: Any, rollout: list[Any], swap: bool):
        self.learners, self.rollout, self.swap = learners, rollout, swap

    def rollout_turn(self) -> None:
        """Before generation: the learner's states wait in host memory."""
        if self.swap:
            self.learners.offload_states()

    def learner_turn(self, timing: dict[str, float]) -> None:
        """After generation: the engines sleep, the learner's states come back (timed as `swap`)."""
        if self.swap:
            t0 = time.perf_counter()
            ray.get([w.sleep.remote() for w in self.rollout])
            self.learners.reload_states()
            timing["swap"] = timing.get("swap", 0.0) + time.perf_counter() - t0

    def weights_turn(self) -> None:
        """Before the weight sync: the engines' weights wake (not their KV cache), so the new ones go straight in."""
        if self.swap:
            ray.get([w.wake.remote(["weights"]) for w in self.rollout])

    def cache_turn(self, timing: dict[str, float]) -> dict[str, float]:
        """After the sync: the learner leaves the device, then the KV cache comes back (timed as `swap`). Returns
        the learner's GPU memory before and after it left."""
        if not self.swap:
            return {}
        metrics = {"memory/learner_gpu_gib_loaded": self.learners.gpu_memory_gib()}
        t0 = time.perf_counter()
        self.learners.offload_states()
        metrics["memory/learner_gpu_gib_offloaded"] = self.learners.gpu_memory_gib()
        ray.get([w.wake.remote(["kv_cache"]) for w in self.rollout])
        timing["swap"] = timing.get("swap", 0.0) + time.perf_counter() - t0
        return metrics
