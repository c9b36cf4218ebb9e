"""The fused one-query decode attention alone (`rollout.fused_attention`): every row reading its own copy of its
group's prompt (`attend_one_query`) against the group's rows reading one copy (`attend_shared_prompt`), both
compiled, at the race's batch (128 rows = 16 groups of 8, 12 heads, head size 64) over a grid of prompt lengths P
and cached positions C (P plus 8, 32 and 56 sampled tokens). The two give the same numbers bit for bit; the script
checks it before timing.

    python benchmarks/decode_attention.py [--threads 2] [--prompts 16 24 32 48 64 128]

Reports, per dtype and (P, C), each kernel's fastest milliseconds a call over 5 windows of 20 calls, alternated,
and the ratio (own copies / one copy); where the ratio stays under 1 the prompt is too short to pay
(`rollout.fused_attention.MIN_SHARED_PROMPT_BYTES`). Result: benchmarks/results/decode_attention.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.weight_sync import cpu_kind  # noqa: E402

ROWS, GROUP, HEADS, HEAD_SIZE = 128, 8, 12, 64


def fastest_ms(call, windows: int = 5, calls: int = 20) -> float:
    best = float("inf")
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def measure(dtype, prompt: int, cached: int) -> dict:
    import torch

    import rollout.fused_attention as fused
    key, value = (torch.randn(ROWS, HEADS, cached, HEAD_SIZE).to(dtype) for _ in range(2))
    first = torch.arange(ROWS) // GROUP * GROUP
    key[:, :, :prompt], value[:, :, :prompt] = key[first, :, :prompt], value[first, :, :prompt]
    query = torch.randn(ROWS, HEADS, 1, HEAD_SIZE).to(dtype)
    mask = torch.zeros(ROWS, 1, 1, cached)
    own = lambda: fused._kernel()(query, key, value, mask, 0.125)  # noqa: E731
    once = lambda: fused._shared_kernel()(query, key, value, mask, 0.125, first, prompt)  # noqa: E731
    assert torch.equal(own(), once())
    times = {"own_copies_ms": fastest_ms(own), "one_copy_ms": fastest_ms(once)}
    return {"prompt": prompt, "cached": cached, **times, "ratio": times["own_copies_ms"] / times["one_copy_ms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, nargs="+", default=[16, 24, 32, 48, 64, 128])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/decode_attention.json"))
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    report = {"args": vars(args), "cpu": cpu_kind(), "rows": ROWS, "group": GROUP, "heads": HEADS, "runs": {}}
    for dtype in (torch.bfloat16, torch.float32):
        rows = [measure(dtype, prompt, prompt + new) for prompt in args.prompts for new in (8, 32, 56)]
        report["runs"][str(dtype).removeprefix("torch.")] = rows
        for r in rows:
            print(json.dumps({"dtype": str(dtype), **{k: round(v, 3) for k, v in r.items()}}), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
