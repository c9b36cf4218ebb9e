"""The probes the driver asks every looprl actor (rollout workers, the reward service, learners): peak memory and
the hardware rates the `perf/mfu` and `perf/mbu` metrics divide by (`rollout.hardware`, imported when asked). A module
of its own and free of torch: the reward service's processes import neither torch nor the generation engines."""

from __future__ import annotations


def peak_rss_gib() -> float:
    """This process's peak resident memory in GiB (Linux reports ru_maxrss in KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class ActorProbes:
    """What the driver asks every looprl actor at the end of a run (mixed into the actor classes: rollout
    workers, the reward service, learners)."""

    def peak_rss_gib(self) -> float:
        return peak_rss_gib()

    def hardware_rates(self, dtype: str = "float32", again: bool = False) -> dict[str, float]:
        """This process's measured matmul FLOP/s (in `dtype`) and memory copy bytes/s (`hardware_rates`)."""
        # torch: imported by the roles that are asked (the learners and engines), never by the reward service
        from rollout.hardware import hardware_rates
        return hardware_rates(dtype, again=again)

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()
