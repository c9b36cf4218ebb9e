"""How close to its floor the race's step could come on this machine with torch's own matrix kernels: every matrix
product of one learner step and one generate, at the race's shapes, replayed alone at its best speed, summed.

    python benchmarks/gemm_bound.py [--dtypes float32 bfloat16] [--threads 2] [--out benchmarks/results/gemm_bound.json]

Workload: the race's (`benchmarks/grpo_step.py --workload realistic`): the ~85M model, 16 prompts of 7-9 tokens
sampled 8 times, up to 64 new tokens (the random model ends rows at EOS as the race's rollouts do: about half run
the whole length), the race's learner settings (packed rows, prompts once per group, eager attention, token
budget 2048 in fp32 and 8192 in bf16; not compiled: the products are the same) and the `hf` engine's decode loop
(packed weights, ended rows dropped).

What it does, per dtype: a learner step and a generate run once under a dispatch mode that records every matrix
product (`mm`, `addmm`, `bmm`, `baddbmm`, oneDNN's and MKL's packed linears): its operation, shapes, strides and dtype, how
often it ran, and the operands of its first calls. Each distinct product is then replayed alone, cycling through
its recorded operands (the decode's 14 layers' weights, so that a weight is not served from cache more than in the
loop), and timed at its fastest of 3 windows; count x time summed is what the products alone take.

The bound on the step: the learner's products (its linears and its attention's) + the decode's linears + the
decode's reads of its KV cache at the measured copy bandwidth (the one-query attention is bound by those reads; a
compiled kernel replaces the eager attention's products there). Everything else (elementwise work, norms,
sampling, the optimizer, Python) counts as zero. Against the floor of `perf/floor_s`
(`cluster.perf.utilisation`, the same formulas and measured ceilings as the trainer's metrics), `bound / floor` is
the smallest step / floor that any schedule of these kernels at these shapes can reach here. The floor counts a
prompt's tokens once per row (the 8 rows of a group share one prompt forward in both phases here); the
`floor_s_prompts_once` figure counts them once per group, the work the step really needs.

Also measured, for comparison: the learner step and the generate in the engine's own settings (fused decode
attention), median of 2 after warm-ups, and the generate with the decode step compiled as one graph over a static
cache (`rollout.compiled_decode`: same tokens; the ended rows stay in its fixed-shape batch); each phase over its
own bound (`decode_over_bound`, `learner_over_bound`) and the step's, eager and compiled (`step_over_bound`).
Results: benchmarks/results/gemm_bound.json, one entry per dtype (a run of some dtypes keeps the others' entries).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.weight_sync import cpu_kind  # noqa: E402

SHAPE = {"hidden_size": 768, "num_layers": 14, "num_heads": 12, "intermediate_size": 1536}
BUDGET = {"float32": 2048, "bfloat16": 8192}  # the race's learner.max_tokens_per_micro_batch per dtype
ARGS_BYTES_KEPT = 256 << 20  # operands kept per distinct product for its replay


def gemm_recorder():
    """A dispatch mode recording every matrix product: `calls[key] = {func, count, flops, args}`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    aten = torch.ops.aten
    linear = {aten.mm.default, aten.addmm.default}
    if hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        linear.add(torch.ops.mkldnn._linear_pointwise.default)
    if hasattr(torch.ops, "mkl") and hasattr(torch.ops.mkl, "_mkl_linear"):
        linear.add(torch.ops.mkl._mkl_linear.default)  # the fp32 decode's packed products
    attention = {aten.bmm.default, aten.baddbmm.default}

    def describe(a):
        if not isinstance(a, torch.Tensor):
            return repr(a)
        return (tuple(a.shape), None if a.is_mkldnn else tuple(a.stride()), str(a.dtype))

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            took = time.perf_counter() - t0
            if func in linear or func in attention:
                key = (str(func), tuple(describe(a) for a in args))
                # the reduced dimension: the last of the operand multiplied from the left
                k = args[1 if func in (aten.addmm.default, aten.baddbmm.default) else 0].shape[-1]
                rec = self.calls.setdefault(key, {"func": func, "count": 0, "flops": 2 * out.numel() * k,
                                                  "kind": "linear" if func in linear else "attention",
                                                  "args": [], "kwargs": kwargs or {}, "bytes": 0,
                                                  "in_context_s": 0.0, "in_context_min_s": float("inf")})
                rec["count"] += 1
                rec["in_context_s"] += took
                rec["in_context_min_s"] = min(rec["in_context_min_s"], took)
                size = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
                if rec["bytes"] + size <= ARGS_BYTES_KEPT or not rec["args"]:
                    rec["args"].append(tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
                    rec["bytes"] += size
            return out
    return Recorder()


def replay(calls: dict, windows: int = 3, window_s: float = 0.02) -> dict[str, float]:
    """Seconds the recorded products take at their fastest, summed by kind (`linear`, `attention`): per product
    the faster of its best per-call time replayed alone (over `windows` windows, cycling through its kept operands)
    and its fastest call in the recorded run, times how often it ran. Also what they took in the recorded run
    (`..._in_context`)."""
    import torch
    out = {f"{kind}{part}": 0.0 for kind in ("linear", "attention") for part in ("", "_flops", "_in_context")}
    with torch.no_grad():
        for rec in calls.values():
            fn, sets, kw = rec["func"], rec["args"], rec["kwargs"]
            for a in sets:  # warm-up
                fn(*a, **kw)
            best = float("inf")
            for _ in range(windows):
                n, t0 = 0, time.perf_counter()
                while True:
                    fn(*sets[n % len(sets)], **kw)
                    n += 1
                    if n >= len(sets) and time.perf_counter() - t0 >= window_s:
                        break
                best = min(best, (time.perf_counter() - t0) / n)
            out[rec["kind"]] += min(best, rec["in_context_min_s"]) * rec["count"]
            out[rec["kind"] + "_in_context"] += rec["in_context_s"]
            out[rec["kind"] + "_flops"] += rec["flops"] * rec["count"]
    return out


def race_prompts(tok, seed: int = 0):
    """16 prompts of 7-9 tokens, left-padded, each repeated 8 times (the race's rows)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    P = 9
    plen = torch.randint(7, P + 1, (16,), generator=g)
    mask = (torch.arange(P)[None] >= (P - plen)[:, None]).long()
    ids = torch.randint(5, len(tok), (16, P), generator=g) * mask + tok.pad_token_id * (1 - mask)
    return ids.repeat_interleave(8, 0), mask.repeat_interleave(8, 0)


def time_generates(generate) -> tuple:
    """The engine's own generate (fused attention, packed weights) and the compiled static-cache step
    (`rollout.compiled_decode`, the fused attention and packed weights in its graph), alternated, 2 each after a
    warm-up that compiles:
    (responses, lengths, seconds of the first, seconds of the second, the compiled step's lengths). In bf16 the
    graph's fused norms and adds round differently from the eager ops, so a sampled row may end elsewhere; the
    compiled step runs every row until the longest ends, so its time depends on the longest row only."""
    generate(True)
    generate(True, compiled=True)
    gen_s, compiled_s = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        resp, _, lengths, _, _ = generate(True)
        gen_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compiled_lengths = generate(True, compiled=True)[2]
        compiled_s.append(time.perf_counter() - t0)
    return resp, lengths, gen_s, compiled_s, compiled_lengths


def measure(dtype: str, threads: int) -> dict:
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from cluster.learner import LearnerWorker
    from cluster.perf import cached_reads, utilisation
    from cluster.ray_utils import free_port
    from models.tiny import build_tiny_tokenizer, save_tiny
    from rl.batch import Batch, micro_batches_of, plan_prompt_groups, sequence_tokens
    from rollout.decoding import KVBuffers, decode
    from rollout.probes import hardware_rates
    tok = build_tiny_tokenizer()
    ids, mask = race_prompts(tok)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny(Path(tmp) / "m", max_position_embeddings=128, **SHAPE)
        rollout = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                       attn_implementation="eager").eval()
        kept = KVBuffers()

        def generate(fused: bool, seed: int = 0, compiled: bool = False):
            torch.manual_seed(seed)
            with torch.no_grad(), kept.claim() as buffers:
                return decode(rollout, ids, mask, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, fused_attention=fused,
                              packed_weights=True, kv_buffers=buffers, compiled=compiled)
        resp, lengths, gen_s, compiled_s, compiled_lengths = time_generates(generate)
        generate(False)
        rec_decode = gemm_recorder()
        with rec_decode:
            resp2, _, lengths2, _, _ = generate(False)
        assert torch.equal(lengths, lengths2), "the fused and the eager decode sampled different lengths"
        attn = (torch.arange(resp.shape[1])[None] < lengths[:, None]).long()
        g = torch.Generator().manual_seed(1)
        batch = Batch(prompt_ids=ids, prompt_mask=mask, response_ids=resp, response_mask=attn.float(),
                      response_attn=attn, group_id=torch.arange(len(ids)) // 8,
                      advantages=torch.randn(resp.shape, generator=g) * attn)
        worker = LearnerWorker(0, 1, "127.0.0.1", free_port(), str(path), lr=1e-6, dtype=dtype,
                               micro_batch_size=len(ids), threads=threads, pack_sequences=True, share_prompts=True,
                               attn_implementation="eager")
        mbs = micro_batches_of(batch, plan_prompt_groups(batch, 1, BUDGET[dtype]))[0]
        params = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(len(ids))}
        train_s = []
        for step in range(4):
            t0 = time.perf_counter()
            worker.train_step(mbs, "ppo_clip", params)
            if step >= 2:
                train_s.append(time.perf_counter() - t0)
        rec_learner = gemm_recorder()
        with rec_learner:
            worker.train_step(mbs, "ppo_clip", params)
        numbers = worker.model_numbers()
        rates = hardware_rates(dtype)
        distinct = {"learner": len(rec_learner.calls), "decode": len(rec_decode.calls)}
        learner = replay(rec_learner.calls)
        rec_learner = None
        dec = replay(rec_decode.calls)
        rec_decode = None
    cfg = OmegaConf.create({"learner": {"world_size": 1}, "rollout": {"num_workers": 1, "generation_batch_size": 256},
                            "algorithm": {"mini_batches": 1}})
    hardware = {"model": numbers, "learner": rates, "rollout": rates}
    train, generate_s = statistics.median(train_s), statistics.median(gen_s)
    perf = utilisation(batch, {"train": train, "generate": generate_s}, train + generate_s, hardware, cfg,
                       train_passes=1, logprob_passes=0)
    kv_bytes = numbers["kv_bytes_per_token"] * cached_reads(batch)
    kv_read_s = kv_bytes / rates["copy_bytes_per_s"]
    bound = learner["linear"] + learner["attention"] + dec["linear"] + kv_read_s
    # the floor with each prompt once per group (its 8 rows share one prompt forward in both phases; rows are
    # prompt-major); the decode's reads of weights (one pass a step) and cache are as in the trainer's floor
    n, peak = numbers["matmul_params"], rates["matmul_flops"]
    tokens_all, tokens_once = float(sum(sequence_tokens(batch))), float(attn.sum() + mask[::8].sum())
    reads_s = (numbers["param_bytes"] * int(lengths.max()) + kv_bytes) / rates["copy_bytes_per_s"]
    floor_once = 6 * n * tokens_once / peak + max(2 * n * tokens_once / peak, reads_s)
    return {"dtype": dtype, "threads": threads, "cpu": cpu_kind(), "rows": len(ids), "generated_tokens": int(attn.sum()),
            "rows_run_to_64": int((lengths == 64).sum()), "tokens_prompts_per_row": tokens_all,
            "tokens_prompts_once": tokens_once,
            "matmul_flops_ceiling": peak, "copy_bytes_per_s": rates["copy_bytes_per_s"],
            "products_alone_s": {"learner_linear": learner["linear"], "learner_attention": learner["attention"],
                                 "decode_linear": dec["linear"], "decode_kv_reads_at_copy_bandwidth": kv_read_s},
            "products_in_context_s": {"learner_linear": learner["linear_in_context"],
                                      "learner_attention": learner["attention_in_context"],
                                      "decode_linear": dec["linear_in_context"]},
            "products_tflops": {"learner_linear": learner["linear_flops"] / max(learner["linear"], 1e-9) / 1e12,
                                "decode_linear": dec["linear_flops"] / max(dec["linear"], 1e-9) / 1e12},
            "distinct_products": distinct,
            # a check on the recording: the products' FLOPs over the model FLOPs of the tokens each phase runs
            # (6 N and 2 N a token, prompts once; the learner does not run a response's last token)
            "recorded_over_model_flops": {"learner": learner["linear_flops"] / (6 * n * tokens_once),
                                          "decode": dec["linear_flops"] / (2 * n * tokens_once)},
            "measured_s": {"train": train, "generate": generate_s, "step": train + generate_s,
                           "generate_compiled": statistics.median(compiled_s)},
            # the compiled step's lengths (bf16 rounding may end a sampled row elsewhere; it runs to the longest)
            "compiled_longest_row": int(compiled_lengths.max()), "longest_row": int(lengths.max()),
            "compiled_same_lengths": bool(torch.equal(compiled_lengths, lengths)),
            "floor_s": perf["perf/floor_s"], "learner_floor_s": perf["perf/learner_floor_s"],
            "decode_floor_s": perf["perf/decode_floor_s"], "floor_s_prompts_once": floor_once,
            "bound_s": bound, "bound_over_floor": bound / perf["perf/floor_s"],
            # the decode against its own bound (its linears alone + its cache reads), eager loop and compiled step
            "decode_bound_s": dec["linear"] + kv_read_s,
            "decode_over_bound": {"eager": generate_s / (dec["linear"] + kv_read_s),
                                  "compiled": statistics.median(compiled_s) / (dec["linear"] + kv_read_s)},
            "learner_over_bound": train / (learner["linear"] + learner["attention"]),
            "step_over_bound": {"eager": (train + generate_s) / bound,
                                "compiled": (train + statistics.median(compiled_s)) / bound},
            "decode_mfu_compiled": perf["perf/decode_mfu"] * generate_s / statistics.median(compiled_s),
            "bound_over_floor_prompts_once": bound / floor_once,
            "measured_over_floor": perf["perf/step_over_floor"],
            "mfu": perf["perf/mfu"], "decode_mfu": perf["perf/decode_mfu"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/gemm_bound.json"))
    p.add_argument("--one", choices=["float32", "bfloat16"], help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.one:  # one dtype in this process (a learner's process group is set up once per process)
        import torch
        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.one, args.threads)), flush=True)
        return
    out = Path(args.out)
    # the other dtypes' entries of an earlier run stay (`--dtypes float32` re-measures fp32 alone)
    results = json.loads(out.read_text()) if out.exists() else {}
    for dtype in args.dtypes:
        proc = subprocess.run([sys.executable, __file__, "--one", dtype, "--threads", str(args.threads)],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"gemm_bound: the {dtype} run failed")
        results[dtype] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[dtype]), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
