"""Learner → rollout weight sync after each update: one module per transport (`rollout.weight_sync` in the recipe).

- `object_store`: learner rank 0's weights, packed as numpy arrays, travel through Ray's object store actor to
  actor (any placement; the default).
- `collective`: learner rank 0 broadcasts its weights in buckets into a process group of its own with every rollout
  worker (gloo on CPU, NCCL on GPUs with split placement).
- `cuda_ipc`: colocated on one GPU, rollout worker i opens CUDA IPC handles to learner rank i's weight buckets.

Each module holds both ends the driver does not see: a `Sender` that lives in every learner rank (the worker calls
it through `LearnerWorker.sender_call`), and the driver's `Transport` that starts one sync (`push`) and
forms its channel again after a rollout worker was restarted (`reset`). The tensors' wire format, shared with the
receiving rollout workers, is `rollout.weight_sync`.
"""

from __future__ import annotations

from typing import Any

from cluster.weight_sync.collective import CollectiveSender, CollectiveTransport
from cluster.weight_sync.cuda_ipc import CudaIpcSender, CudaIpcTransport
from cluster.weight_sync.object_store import ObjectStoreSender, ObjectStoreTransport

SENDERS = {"object_store": ObjectStoreSender, "collective": CollectiveSender, "cuda_ipc": CudaIpcSender}
TRANSPORTS = {"object_store": ObjectStoreTransport, "collective": CollectiveTransport, "cuda_ipc": CudaIpcTransport}


def make_transport(name: str, learners: Any, rollout: list[Any], *, bucket_mb: int, gpus: bool,
                   keep_versions: int, in_flight: bool = False) -> Any:
    """The driver's end of transport `name` between a learner group and its rollout workers (channel formed)."""
    transport = TRANSPORTS[name](learners, rollout, bucket_bytes=bucket_mb << 20, gpus=gpus,
                                 keep_versions=keep_versions, in_flight=in_flight)
    transport.reset()
    return transport


__all__ = ["SENDERS", "TRANSPORTS", "make_transport"]
