"""Weight sync through Ray's object store: learner rank 0 packs its weights as numpy arrays (stored out-of-band and
read back zero-copy, `rollout.weight_sync.pack_state`); the object reference goes to every rollout worker, actor to
actor, without passing through the driver. Works for any placement; the fallback the other transports recover with."""

from __future__ import annotations

from typing import Any


class ObjectStoreSender:
    """In a learner rank: the weights the rollout engines need (rank 0; None elsewhere), packed for the store."""

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.bytes_sent = 0

    def send(self) -> Any:
        from rollout.weight_sync import pack_state, state_bytes
        sd = self.strategy.sync_state_dict()  # collective under ZeRO-3: every rank calls
        if sd is None:
            return None
        self.bytes_sent = state_bytes(sd)
        return pack_state(sd)


class ObjectStoreTransport:
    """The driver's end. Pipelined: with `max_staleness > 0` the loads queue behind in-flight generations."""

    pipelined = True

    def __init__(self, learners: Any, rollout: list[Any], in_flight: bool = False, **_: Any):
        self.learners, self.rollout, self.in_flight = learners, rollout, in_flight

    def reset(self) -> None:
        """Nothing to form: every push reaches the rollout workers alive now."""

    def push(self, version: int) -> tuple[list[Any], list[Any]]:
        """Start one sync: (the learner calls to wait for, one load per rollout worker returning its load time)."""
        refs = [w.sender_call.remote("object_store", "send") for w in self.learners.workers]
        state = refs[0]  # an ObjectRef: moves actor-to-actor without passing through the driver
        if self.in_flight:  # staged beside a generation in flight, swapped in between its decode steps or after it
            stages = [r.stage_weights.remote(state, version) for r in self.rollout]
            return refs[1:] + stages, [r.install_staged.remote(version) for r in self.rollout]
        return refs[1:], [r.load_weights.remote(state, version) for r in self.rollout]
