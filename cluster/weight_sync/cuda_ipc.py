"""Weight sync on one GPU: a learner rank and the rollout worker colocated with it share a device. NCCL refuses a
group with two ranks on one device, so the learner copies its weights into flat GPU buckets and hands the worker
CUDA IPC handles to them (`rollout.weight_sync.share_state_ipc`); the worker copies out of the shared buckets
straight into its engine. The weights never leave the GPU."""

from __future__ import annotations

import time
from typing import Any

import torch


class CudaIpcSender:
    """In a learner rank: its full weights in GPU buckets, returned as IPC handles for the worker on its GPU."""

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.live: list[list[torch.Tensor]] = []  # buckets of the last versions, kept alive for their readers
        self.bytes_sent = 0

    def send(self, bucket_bytes: int, keep_versions: int) -> dict:
        """All ranks call. The buckets of the last `keep_versions` calls stay alive: with asynchronous rollout a
        worker opens them only after its queued generations."""
        from rollout.weight_sync import gpu_uuid, share_state_ipc, state_meta
        t0 = time.perf_counter()
        sd = self.strategy.full_state_dict("cuda", every_rank=True)
        meta = state_meta(sd)
        buckets, handles = share_state_ipc(sd, meta, bucket_bytes)
        del sd
        self.live = (self.live + [buckets])[-keep_versions:]
        torch.cuda.synchronize()  # the copies must be done before another process reads them
        return {"gpu": gpu_uuid(), "meta": meta, "handles": handles, "bucket_bytes": bucket_bytes,
                "pack_s": time.perf_counter() - t0}


class CudaIpcTransport:
    """The driver's end: rollout worker i reads learner rank i's buckets. Pipelined as the object store is."""

    pipelined = True

    def __init__(self, learners: Any, rollout: list[Any], *, bucket_bytes: int, keep_versions: int, **_: Any):
        self.learners, self.rollout = learners, rollout
        self.bucket_bytes, self.keep_versions = bucket_bytes, keep_versions

    def reset(self) -> None:
        """Nothing to form: handles go with every push."""

    def push(self, version: int) -> tuple[list[Any], list[Any]]:
        refs = [w.sender_call.remote("cuda_ipc", "send", self.bucket_bytes, self.keep_versions)
                for w in self.learners.workers]
        return refs[1:], [r.load_weights_ipc.remote(refs[i], version) for i, r in enumerate(self.rollout)]
