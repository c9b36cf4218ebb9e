"""The machine's rates and capabilities, measured or read through torch: the matmul and memory-copy ceilings that
the `perf/mfu` and `perf/mbu` metrics divide by (`hardware_rates`, asked of each role through
`rollout.probes.ActorProbes`) and whether this CPU multiplies bf16 natively (`bf16_advice`)."""

from __future__ import annotations

import functools
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from rl.progress import say  # standard library only


def best_rates(rates: dict[str, float], before: dict[str, float] | None) -> dict[str, float]:
    """`rates` with each ceiling the higher of its and `before`'s (a core that something else was busy on only
    lowers a measured rate)."""
    if before is None:
        return rates
    return {**rates, "matmul_flops": max(rates["matmul_flops"], before["matmul_flops"]),
            "copy_bytes_per_s": max(rates["copy_bytes_per_s"], before["copy_bytes_per_s"])}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has the bf16 matrix instructions oneDNN multiplies bf16 with (AVX512-BF16 or AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string (`GenuineIntel`, `AuthenticAMD`, ...) from `/proc/cpuinfo`, or `platform.processor()`
    where there is none (other systems); "" when neither names it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def bf16_advice(dtype: str, device: str = "cpu") -> str | None:
    """A line for a bf16 model on a CPU without bf16 matrix instructions (None otherwise): there bf16 products
    are emulated. On an AMD EPYC (AVX2, 2 cores) a decode-shaped bf16 linear ([128, 768] x [768, 1536]) ran at
    10.5 GFLOP/s against fp32's 58.7, a product of two row-major operands at 0.7."""
    if dtype != "bfloat16" or device != "cpu" or cpu_has_bf16_matmul():
        return None
    return (f"model.dtype=bfloat16 on a CPU without bf16 matrix instructions (neither AVX512-BF16 nor AMX; "
            f"{torch.backends.cpu.get_cpu_capability()}): its bf16 products are emulated, several times slower "
            "than float32's here; model.dtype=float32 runs faster on this CPU")


def warn_slow_bf16(dtype: str, device: str) -> None:
    """Prints `bf16_advice` once per process where it applies (each engine and learner rank checks its own CPU)."""
    advice = bf16_advice(dtype, device)
    if advice is not None and advice not in _WARNED:
        _WARNED.add(advice)
        say(advice)


_WARNED: set[str] = set()

# the (m, k, n) matmuls whose best rate is the ceiling. On CPU a square 1024 matmul alone understated it: on an AMX
# Xeon (2 threads, bf16) it ran at 1.1 TFLOP/s while the learner's own [5626, 768] x [768, 768 or 1536] products ran at
# 2.1-2.3 and a (4096, 1024, 1024) one at 2.3 (its 1024-column operand stays in cache); fp32 ran at 0.24-0.30 on all
# of them. The probe's time is split over the shapes.
MATMUL_SHAPES = {"cpu": ((1024, 1024, 1024), (4096, 1024, 1024)), "cuda": ((8192, 8192, 8192),)}

_RATES: dict[tuple[str, str], dict[str, float]] = {}


def seconds_per_call(fn: Callable[[], Any], total_s: float, windows: int = 5,
                     sync: Callable[[], Any] | None = None) -> float:
    """Seconds per call of `fn`, after one warm-up call: the fastest of `windows` timing windows of `total_s` in all,
    so that another process starting beside this one (the other actors of a run start together) does not lower a
    ceiling. Fewer windows where one call outlasts a window, down to one call: a slow CPU keeps to about the budget
    (a bf16 probe of 6 calls took 90 s on a CPU without bf16 instructions). `sync` waits for the device's work."""
    def call() -> None:
        fn()
        if sync is not None:
            sync()
    t0 = time.perf_counter()
    call()
    windows = max(1, min(windows, int(total_s / max(time.perf_counter() - t0, 1e-9))))
    best = float("inf")
    for _ in range(windows):
        calls, t0 = 0, time.perf_counter()
        while True:
            call()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= total_s / windows:
                best = min(best, elapsed / calls)
                break
    return best


def hardware_rates(dtype: str = "float32", seconds: float = 0.3, again: bool = False) -> dict[str, float]:
    """The ceilings the `perf/mfu` and `perf/mbu` metrics divide by, measured in this process with its torch
    threads (on CPU) or on its GPU: matmuls in `dtype` (`matmul_flops`, FLOP/s: the best of `MATMUL_SHAPES`, timed
    for `seconds` in all) and a large tensor copy (`copy_bytes_per_s`, bytes read + written per second, timed for
    `seconds`). Measured once per process; `again` measures anew and keeps each rate's best so far (a ceiling: a
    core that something else was busy on only lowers it)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    key = (dtype, device)
    if key in _RATES and not again:
        return _RATES[key]
    sync = torch.cuda.synchronize if device == "cuda" else None
    matmul_flops = 0.0
    per_shape_s = seconds / len(MATMUL_SHAPES[device])
    for m, k, n in MATMUL_SHAPES[device]:
        a = torch.randn(m, k, device=device).to(DTYPES[dtype])
        weight = torch.randn(n, k, device=device).to(DTYPES[dtype])  # stored [out, in], as a linear layer's
        # in a linear layer's layout (x @ W^T), the one every model product runs in: on a CPU without bf16
        # instructions (AVX2) a bf16 product of two row-major operands ran at a tenth of its rate
        per_call = seconds_per_call(lambda a=a, w=weight: a @ w.T, per_shape_s, sync=sync)
        matmul_flops = max(matmul_flops, 2 * m * k * n / per_call)
    src = torch.empty((256 << 20) // 4, device=device)  # 256 MB, well past any CPU cache
    dst = torch.empty_like(src)
    copy_s = seconds_per_call(lambda: dst.copy_(src), seconds, sync=sync)
    rates = {"matmul_flops": matmul_flops, "copy_bytes_per_s": 2 * src.numel() * 4 / copy_s, "device": device}
    _RATES[key] = best_rates(rates, _RATES.get(key))
    a = weight = src = dst = None  # noqa: F841  (released before the cache is emptied)
    if device == "cuda":
        torch.cuda.empty_cache()  # give the engine back what the measurement held
    return _RATES[key]
