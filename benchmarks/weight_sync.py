"""Weight-sync transfer time per gigabyte, per transport: what one learner -> rollout sync costs on this machine.

    python benchmarks/weight_sync.py [--gib 1.0] [--receivers 1 2] [--buckets-mb 16 64 256] [--repeats 3]

A sender actor holds a bf16 state dict shaped like a transformer's (equal matrices of 64 MiB and small norm
vectors) of `--gib` GiB; `--receivers` receiver actors hold tensors of the same shapes. Each transport moves
the weights with looprl's own code (`rollout.weight_sync`) and every receiver copies them into its tensors, as an
engine's `load_weights` does:

* `object_store`: the sender packs the tensors (`pack_state`), the object reference goes to every receiver,
  which reads it zero-copy (`unpack_state`) and copies;
* `collective`: the sender and the receivers form a gloo group of their own (`make_sync_group`) and the sender
  broadcasts in buckets of `--buckets-mb` (`broadcast_state` / `receive_state`).

Recorded per transport, bucket size and receiver count: seconds per sync (the best and the median of
`--repeats`), GiB/s (the weights' size over the time until the last receiver has copied them), and the CPU kind
(AMX or not: the copies run on it). The NCCL and CUDA IPC paths need GPUs: `benchmarks/gpu_smoke.py` records
them. Results: `benchmarks/results/weight_sync.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import ray
import torch

MATRIX = 32 << 20  # elements of each weight matrix: 64 MiB in bf16


def layout(gib: float) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of about `gib` GiB in bf16: square-ish matrices and a norm vector after each."""
    out = []
    count = max(1, round(gib * (1 << 30) / (MATRIX * 2)))
    for i in range(count):
        out.append((f"layers.{i}.weight", (4096, MATRIX // 4096)))
        out.append((f"layers.{i}.norm", (4096,)))
    return out


@ray.remote(concurrency_groups={"sync": 1})
class Sender:
    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]]):
        torch.set_num_threads(1)
        self.state = {n: torch.randn(s, dtype=torch.float32).to(torch.bfloat16) for n, s in shapes}

    def endpoint(self) -> tuple[str, int]:
        from cluster.ray_utils import free_port
        return ray.util.get_node_ip_address(), free_port()

    def meta(self) -> list:
        from rollout.weight_sync import state_meta
        return state_meta(self.state)

    def join(self, host: str, port: int, world: int) -> None:
        from rollout.weight_sync import make_sync_group
        self.group = make_sync_group(host, port, 0, world, "gloo")

    def checksum(self) -> float:
        return float(sum(t.float().sum() for t in self.state.values()))

    def pack(self) -> dict:
        from rollout.weight_sync import pack_state
        return pack_state(self.state)

    def broadcast(self, meta: list, bucket_bytes: int) -> float:
        from rollout.weight_sync import broadcast_state
        t0 = time.perf_counter()
        broadcast_state(self.group, self.state, meta, bucket_bytes)
        return time.perf_counter() - t0


@ray.remote
class Receiver:
    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]]):
        torch.set_num_threads(1)
        self.state = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes}

    def join(self, host: str, port: int, rank: int, world: int) -> None:
        from rollout.weight_sync import make_sync_group
        self.group = make_sync_group(host, port, rank, world, "gloo")

    def load_packed(self, packed: dict) -> float:
        from rollout.weight_sync import unpack_state
        for name, t in unpack_state(packed).items():
            self.state[name].copy_(t)
        return time.perf_counter()

    def receive(self, meta: list, bucket_bytes: int) -> float:
        from rollout.weight_sync import receive_state
        for part in receive_state(self.group, meta, bucket_bytes):
            for name, t in part.items():
                self.state[name].copy_(t)
        return time.perf_counter()

    def checksum(self) -> float:
        return float(sum(t.float().sum() for t in self.state.values()))


def _object_store(sender, receivers) -> float:
    t0 = time.perf_counter()
    ref = sender.pack.remote()
    ends = ray.get([r.load_packed.remote(ref) for r in receivers])
    del ref
    return max(ends) - t0


def _collective(sender, receivers, meta, bucket_bytes) -> float:
    t0 = time.perf_counter()
    send = sender.broadcast.remote(meta, bucket_bytes)
    ends = ray.get([r.receive.remote(meta, bucket_bytes) for r in receivers])
    ray.get(send)
    return max(ends) - t0


def measure(gib: float, n: int, buckets_mb: list[int], repeats: int) -> list[dict]:
    shapes = layout(gib)
    sender = Sender.remote(shapes)
    receivers = [Receiver.remote(shapes) for _ in range(n)]
    meta = ray.get(sender.meta.remote())
    size = sum(torch.Size(s).numel() * 2 for _, s in shapes)
    host, port = ray.get(sender.endpoint.remote())
    ray.get([sender.join.remote(host, port, n + 1), *[r.join.remote(host, port, i + 1, n + 1)
                                                        for i, r in enumerate(receivers)]])
    runs = [("object_store", None, lambda: _object_store(sender, receivers))]
    runs += [("collective", mb, lambda mb=mb: _collective(sender, receivers, meta, mb << 20)) for mb in buckets_mb]
    rows = []
    for transport, mb, fn in runs:
        fn()  # warm-up: buffers allocated, connections open
        times = [fn() for _ in range(repeats)]
        rows.append({"transport": transport, "bucket_mb": mb, "receivers": n, "bytes": size,
                     "seconds_best": min(times), "seconds_median": statistics.median(times),
                     "gib_per_s": size / (1 << 30) / min(times), "seconds_per_gib": min(times) / (size / (1 << 30))})
        print(json.dumps(rows[-1]), flush=True)
    sent, got = ray.get(sender.checksum.remote()), ray.get([r.checksum.remote() for r in receivers])
    assert all(g == sent for g in got), f"the receivers hold other weights than the sender's ({got} vs {sent})"
    for a in [sender, *receivers]:
        ray.kill(a)
    return rows


def cpu_kind() -> str:
    """The CPU's model name and whether it has AMX or AVX-512 bf16 (the copies' speed depends on it)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return f"{name} ({'AMX' if 'amx_tile' in flags else 'no AMX'}, {'avx512_bf16' if 'avx512_bf16' in flags else 'no avx512_bf16'})"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--buckets-mb", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "weight_sync.json"))
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=max(2, max(args.receivers) + 1), include_dashboard=False, log_to_driver=False)
    rows = [row for n in args.receivers for row in measure(args.gib, n, args.buckets_mb, args.repeats)]
    report = {"gib": args.gib, "cpu": cpu_kind(), "cores": os.cpu_count(), "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({"cpu": report["cpu"]}))


if __name__ == "__main__":
    main()
