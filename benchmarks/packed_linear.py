"""The `hf` decode loop's linear layers with packed weights (`rollout.packed_linear`): MKL's packed sgemm against
oneDNN's packed product and the plain `F.linear`, alone at the decode's block sizes and in a whole generate.

    python benchmarks/packed_linear.py [--threads 2] [--reps 5] [--out benchmarks/results/packed_linear.json]

Products alone: `[M, K] x [K, N]` at the ~85M model's shapes (K, N = 768/768, 768/1536, 1536/768) and the row counts
a decode batch passes through as rows end (M = 128, 96, 64, 16), fp32; each kind over 14 weights in turn (one per
layer, so that none stays in cache more than in the loop), best of 3 windows. MKL's weight is packed once for 128
rows and serves every M (`rollout.packed_linear`'s docstring). bf16 has no MKL path in torch; its rows list oneDNN
and `F.linear` for reference.

A whole generate: the race's rollout (`benchmarks/gemm_bound.py`'s prompts: 16 prompts x 8 samples, up to 64 new
tokens, rows ending at EOS, the ~85M model with random weights, fp32, the engine's defaults on CPU: fused
attention, packed weights, ended rows dropped, KV storage kept), with fp32 weights packed for MKL and for oneDNN
(the engine's `fp32_packing`; `auto_chooses` records what `auto` takes on this CPU), alternated `--reps` times in
one process after a warm-up each; medians, and whether both sampled the same tokens.
Result: benchmarks/results/packed_linear.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.gemm_bound import SHAPE, race_prompts  # noqa: E402
from benchmarks.weight_sync import cpu_kind  # noqa: E402

SHAPES = ((768, 768), (768, 1536), (1536, 768))
ROWS = (128, 96, 64, 16)


def best_per_call(fn, calls: int, windows: int = 3, window_s: float = 0.05) -> float:
    """Seconds per call of `fn` (which makes `calls` products), best of `windows` windows."""
    fn()
    best = float("inf")
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < window_s:
            fn()
            n += 1
        best = min(best, (time.perf_counter() - t0) / (n * calls))
    return best


def kinds(x, m: int, weights: list, mkl: list | None) -> dict:
    """Each kind of product of `x [m, K]` by the weights in turn, as a callable."""
    import torch
    import torch.nn.functional as F
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
    out = {"F.linear": lambda: [F.linear(x, w) for w in weights],
           "oneDNN packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn]}
    if mkl is not None:
        out["MKL packed (for 128 rows)"] = lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, m)
                                                    for p, w in zip(mkl, weights)]
    return out


def products(dtype) -> list[dict]:
    """GFLOP/s of each kind of product at each shape and row count."""
    import torch
    rows = []
    g = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        weights = [torch.randn(n, k, generator=g).to(dtype) for _ in range(14)]
        mkl = ([torch.ops.mkl._mkl_reorder_linear_weight(w, 128) for w in weights]
               if dtype == torch.float32 and torch.backends.mkl.is_available() else None)
        for m in ROWS:
            x = torch.randn(m, k, generator=g).to(dtype)
            rates = {name: 2 * m * k * n / best_per_call(fn, 14) / 1e9
                     for name, fn in kinds(x, m, weights, mkl).items()}
            rows.append({"m": m, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."), **rates})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def generates(reps: int) -> dict:
    """The race's fp32 rollout with weights packed for MKL and for oneDNN, alternated."""
    import torch
    from transformers import AutoModelForCausalLM

    import rollout.packed_linear as packed_linear
    from models.tiny import build_tiny_tokenizer, save_tiny
    from rollout.decoding import KVBuffers, decode
    tok = build_tiny_tokenizer()
    ids, mask = race_prompts(tok)
    packings = {"MKL": "mkl", "oneDNN": "onednn"}
    times: dict[str, list[float]] = {k: [] for k in packings}
    outs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny(Path(tmp) / "m", max_position_embeddings=128, **SHAPE)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        kept = KVBuffers()
        for rep in range(reps + 1):  # the first round warms up (compiles the attention kernel)
            for name, choice in packings.items():
                torch.manual_seed(0)
                t0 = time.perf_counter()
                with torch.no_grad(), kept.claim() as buffers:
                    outs[name] = decode(model, ids, mask, max_new_tokens=64, temperature=1.0, top_k=0,
                                        top_p=1.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                        fused_attention=True, packed_weights=True, kv_buffers=buffers,
                                        fp32_packing=choice)
                if rep:
                    times[name].append(time.perf_counter() - t0)
    (a, la, lengths_a, _, _), (b, lb, lengths_b, _, _) = outs["MKL"], outs["oneDNN"]
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"s_per_generate": times, "median_s": median, "speedup": median["oneDNN"] / median["MKL"],
            "same_tokens": bool(torch.equal(a, b) and torch.equal(lengths_a, lengths_b)),
            "logprob_max_abs_diff": float((la - lb).abs().max()), "generated_tokens": int(lengths_a.sum()),
            "auto_chooses": packed_linear.resolve_fp32_packing("auto")}


def main() -> None:
    from cluster.ray_utils import exec_with_actor_malloc
    exec_with_actor_malloc()  # timed as an actor runs: with its malloc settings
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/packed_linear.json"))
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from rollout.hardware import cpu_has_bf16_matmul
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_has_bf16_matmul() else [])  # oneDNN packs bf16 only there
    report = {"cpu": cpu_kind(), "threads": args.threads, "torch": torch.__version__,
              "products_gflops": {str(d).removeprefix("torch."): products(d) for d in dtypes},
              "generate_fp32": generates(args.reps)}
    print(json.dumps(report["generate_fp32"]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
