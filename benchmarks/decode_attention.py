"""The fused one-query decode attention alone (`rollout.fused_attention`): every row reading its own copy of its
group's prompt (`attend_one_query`) against the group's rows reading one copy (`attend_shared_prompt`), both
compiled, at the race's batch (128 rows = 16 groups of 8, 12 heads, head size 64) over a grid of prompt lengths P
and cached positions C (P plus 8, 32 and 56 sampled tokens). The two give the same numbers bit for bit; the script
checks it before timing.

    python benchmarks/decode_attention.py [--threads 2] [--prompts 16 24 32 48 64 128]

Reports, per dtype and (P, C), each kernel's fastest milliseconds a call over 5 windows of 20 calls, alternated,
and the ratio (own copies / one copy); where the ratio stays under 1 the prompt is too short to pay
(`rollout.fused_attention.MIN_SHARED_PROMPT_BYTES`). Result: benchmarks/results/decode_attention.json.

    python benchmarks/decode_attention.py --loop [--prompts 8 16 32 64] [--reps 4]

The same choice in the decode loop, where each layer's cache has left the CPU's caches by its next step: the race's
rollout (the ~85M model, 16 prompts x 8 rows, up to 64 new tokens, rows ending at EOS) with prompts of P tokens, own
copies against one copy per group, alternated, bf16 and fp32 (`in_loop`); the thresholds come from these figures.
Kept under `loop` in the same file.
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


def in_loop(dtype, prompt: int, reps: int) -> dict:
    """The race's rollout (`benchmarks/gemm_bound.py`'s ~85M model and sampling: 16 prompts x 8 rows, up to 64 new
    tokens, rows ending at EOS, the engine's defaults) with prompts of `prompt` tokens, every row reading its own
    copy of its prompt and each group's rows reading one copy (the shared-prompt kernel forced on at every size),
    alternated `reps` times after a warm-up round: medians, the speed-up, whether both sampled the same tokens."""
    import statistics
    import tempfile
    import time

    import torch
    from transformers import AutoModelForCausalLM

    import rollout.fused_attention as fused
    from benchmarks.gemm_bound import SHAPE
    from models.tiny import build_tiny_tokenizer, save_tiny
    from rollout.decoding import KVBuffers, decode
    tok = build_tiny_tokenizer()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(tok), (16, prompt), generator=g).repeat_interleave(GROUP, 0)
    own_threshold = fused.MIN_SHARED_PROMPT_BYTES
    choices = {"own copies": dict.fromkeys(own_threshold, 1 << 62), "one copy": dict.fromkeys(own_threshold, 0)}
    times: dict[str, list[float]] = {k: [] for k in choices}
    outs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny(Path(tmp) / "m", max_position_embeddings=prompt + 96, **SHAPE)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
        kept = KVBuffers()
        try:
            for rep in range(reps + 1):
                for name, threshold in choices.items():
                    fused.MIN_SHARED_PROMPT_BYTES = threshold
                    torch.manual_seed(0)
                    t0 = time.perf_counter()
                    with torch.no_grad(), kept.claim() as buffers:
                        outs[name] = decode(model, ids, torch.ones_like(ids), max_new_tokens=64, temperature=1.0,
                                            top_k=0, top_p=1.0, eos_token_id=tok.eos_token_id,
                                            pad_token_id=tok.pad_token_id, fused_attention=True, packed_weights=True,
                                            kv_buffers=buffers)
                    if rep:
                        times[name].append(time.perf_counter() - t0)
        finally:
            fused.MIN_SHARED_PROMPT_BYTES = own_threshold
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"dtype": str(dtype).removeprefix("torch."), "prompt": prompt,
            "prompt_bytes_a_layer": 2 * len(ids) * HEADS * prompt * HEAD_SIZE * dtype.itemsize, "s_per_generate": times,
            "median_s": median, "speedup": median["own copies"] / median["one copy"],
            "same_tokens": bool(all(torch.equal(a, b) for a, b in zip(outs["own copies"][:3], outs["one copy"][:3])))}


def main() -> None:
    from cluster.ray_utils import exec_with_actor_malloc
    exec_with_actor_malloc()  # timed as an actor runs: with its malloc settings
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, nargs="+", default=[16, 24, 32, 48, 64, 128])
    p.add_argument("--loop", action="store_true", help="the race's rollout at each prompt length instead (--prompts "
                   "defaults to 8 16 32 64); kept in the same file under `loop`")
    p.add_argument("--reps", type=int, default=4, help="--loop: alternations after the warm-up")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/decode_attention.json"))
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    if args.loop:
        loop(args)
        return
    report = {"args": vars(args), "cpu": cpu_kind(), "rows": ROWS, "group": GROUP, "heads": HEADS, "runs": {}}
    for dtype in (torch.bfloat16, torch.float32):
        rows = [measure(dtype, prompt, prompt + new) for prompt in args.prompts for new in (8, 32, 56)]
        report["runs"][str(dtype).removeprefix("torch.")] = rows
        for r in rows:
            print(json.dumps({"dtype": str(dtype), **{k: round(v, 3) for k, v in r.items()}}), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


def loop(args: argparse.Namespace) -> None:
    """`--loop`: `in_loop` per dtype and prompt length, kept under `loop` beside the kernel's figures."""
    import torch
    prompts = args.prompts if "--prompts" in sys.argv else [8, 16, 32, 64]
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    report["loop"] = {"cpu": cpu_kind(), "threads": args.threads, "rows": ROWS, "group": GROUP, "runs": []}
    for dtype in (torch.bfloat16, torch.float32):
        for prompt in prompts:
            report["loop"]["runs"].append(in_loop(dtype, prompt, args.reps))
            print(json.dumps(report["loop"]["runs"][-1]), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
