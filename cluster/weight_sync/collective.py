"""Weight sync by broadcast: learner rank 0 and every rollout worker form a process group of their own (next to
DeepSpeed's; gloo on CPU, NCCL on GPUs with split placement), and rank 0 broadcasts its weights in flat buckets of
one dtype each (`rollout.weight_sync.broadcast_state`). Nothing goes through the object store.

With `trainer.max_staleness: 0` every rollout worker receives straight into its engine. With asynchronous
rollout the workers receive on a thread of their own while they generate (`receive_weights_staged`, one more copy
of the weights on each), and swap the new weights in between two generations (`install_staged`, queued behind
the generation in flight, as the object store's loads are): the learner's broadcast never waits for a
generation to end, and the next generation after it samples from the new weights."""

from __future__ import annotations

import time
from typing import Any

import ray

from cluster.ray_utils import free_port


class CollectiveSender:
    """In a learner rank: rank 0 joins the sync group as its rank 0 and broadcasts; every rank calls (ZeRO-3)."""

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.bytes_sent = 0

    def endpoint(self) -> tuple[str, int]:
        """Address for the group's rendezvous, hosted by this rank (rank 0)."""
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, host: str, port: int, world_size: int, backend: str) -> list | None:
        """Join the group (rank 0) and return the tensor metadata the receivers need (ZeRO-3 gathers the full
        weights to read their shapes, so every rank calls)."""
        from rollout.weight_sync import make_sync_group, state_meta
        sd = self.strategy.sync_state_dict()
        self.device = "cuda" if backend == "nccl" else "cpu"
        if self.strategy.rank != 0:
            return None
        self.meta = state_meta(sd)
        self.group = make_sync_group(host, port, 0, world_size, backend)
        return self.meta

    def send(self, bucket_bytes: int) -> float:
        """Rank 0 broadcasts its weights to the rollout workers; returns the seconds it took."""
        from rollout.weight_sync import broadcast_state, state_bytes
        t0 = time.perf_counter()
        sd = self.strategy.sync_state_dict(self.device)
        if self.strategy.rank == 0:
            self.bytes_sent = state_bytes(sd)
            broadcast_state(self.group, sd, self.meta, bucket_bytes, self.device)
        return time.perf_counter() - t0


class CollectiveTransport:
    """The driver's end: forms the group (again after a rollout worker was restarted) and runs each broadcast."""

    def __init__(self, learners: Any, rollout: list[Any], *, bucket_bytes: int, gpus: bool, keep_versions: int = 1,
                 **_: Any):
        self.learners, self.rollout = learners, rollout
        self.bucket_bytes, self.backend = bucket_bytes, "nccl" if gpus else "gloo"
        self.pipelined = keep_versions > 1  # max_staleness > 0: received in the background, swapped in between

    def reset(self) -> None:
        """Form the group: learner rank 0 and every rollout worker."""
        host, port = ray.get(self.learners.workers[0].sender_call.remote("collective", "endpoint"))
        world = 1 + len(self.rollout)
        senders = [w.sender_call.remote("collective", "setup", host, port, world, self.backend)
                   for w in self.learners.workers]
        receivers = [r.init_weight_sync_group.remote(host, port, i + 1, world, self.backend)
                     for i, r in enumerate(self.rollout)]
        self.meta = ray.get(senders)[0]
        ray.get(receivers)

    def push(self, version: int) -> tuple[list[Any], list[Any]]:
        """Start one broadcast: (the calls to wait for, one load per rollout worker returning its seconds).
        Not pipelined it waits for the learner side and the loads write into the engines directly."""
        sends = [w.sender_call.remote("collective", "send", self.bucket_bytes) for w in self.learners.workers]
        if self.pipelined:
            receives = [r.receive_weights_staged.remote(version, self.meta, self.bucket_bytes) for r in self.rollout]
            return sends + receives, [r.install_staged.remote(version) for r in self.rollout]
        loads = [r.receive_weights.remote(version, self.meta, self.bucket_bytes) for r in self.rollout]
        self.learners.get_all(sends, "the weight broadcast")
        return [], loads
