"""How close to its floor the race's step could come on this machine with torch's own matrix kernels: every matrix
product of one learner step and one generate, at the race's shapes, replayed alone at its best speed, summed.

    python benchmarks/gemm_bound.py [--dtypes float32 bfloat16] [--threads 2] [--out benchmarks/results/gemm_bound.json]

Workload: the race's (`benchmarks/grpo_step.py --workload realistic`): the ~85M model, 16 prompts of 7-9 tokens
sampled 8 times, up to 64 new tokens (the random model ends rows at EOS as the race's rollouts do: about half run
the whole length), the race's learner settings (packed rows, prompts once per group, eager attention, token
budget 2048 in fp32 and 8192 in bf16; its products recorded uncompiled: they are the same compiled) and the `hf`
engine's decode loop (packed weights, ended rows dropped). Each dtype runs in a process of its own with the malloc
settings of looprl's actors (`cluster.ray_utils.ACTOR_ENV`).

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
cache (`rollout.compiled_decode`: same tokens; the ended rows stay in its fixed-shape batch), and the learner
step again with its decoder layers compiled, as the race runs it; each phase over its own bound (`decode_over_bound`,
`learner_over_bound`) and the step's (`step_over_bound`; `race`: compiled learner, eager decode loop).

Where the time goes (`time_split`): the learner's forward, backward and optimizer step; its linears by pass
(forward, input gradients, weight gradients), alone and in the recorded step; the decode's one-query attention in
the loop (seconds, and the bytes/s it reads the cache at) beside the rates at which that kernel and a plain compiled
read take the same cache out of memory and out of the CPU's caches (`read_rates`), the decode's linears and the rest.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.weight_sync import cpu_kind  # noqa: E402
from cluster.ray_utils import ACTOR_ENV  # noqa: E402

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
                                                  "part": product_part(func, args),
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


def product_part(func, args) -> str:
    """Which pass a recorded product belongs to: `forward`, or in a backward pass (autograd running) the
    `weight_gradient` (`grad_output.t() @ input`: its left operand a transposed view, reduced over the tokens) or
    the `input_gradient`."""
    import torch
    if torch._C._current_graph_task_id() == -1:
        return "forward"
    left = args[0]
    transposed = left.dim() == 2 and not left.is_mkldnn and left.stride(0) == 1 and left.stride(1) > 1
    return "weight_gradient" if func == torch.ops.aten.mm.default and transposed else "input_gradient"


def replay(calls: dict, windows: int = 3, window_s: float = 0.02) -> dict[str, float]:
    """Seconds the recorded products take at their fastest, summed by kind (`linear`, `attention`): per product
    the faster of its best per-call time replayed alone (over `windows` windows, cycling through its kept operands)
    and its fastest call in the recorded run, times how often it ran. Also what they took in the recorded run
    (`..._in_context`), and the linears by pass (`linear_forward`, `linear_input_gradient`,
    `linear_weight_gradient`, each with its `_flops` and `_in_context`)."""
    import torch
    kinds = ("linear", "attention", *(f"linear_{p}" for p in ("forward", "input_gradient", "weight_gradient")))
    out = {f"{kind}{part}": 0.0 for kind in kinds for part in ("", "_flops", "_in_context")}
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
            kinds = (rec["kind"], f"linear_{rec['part']}") if rec["kind"] == "linear" else (rec["kind"],)
            for kind in kinds:
                out[kind] += min(best, rec["in_context_min_s"]) * rec["count"]
                out[kind + "_in_context"] += rec["in_context_s"]
                out[kind + "_flops"] += rec["flops"] * rec["count"]
    return out


def time_learner(worker, micro_batches, params: dict) -> tuple[dict, Any]:
    """The learner step eager, then with its decoder layers compiled as the race runs it
    (`learner.compile_position_wise` with packed rows and shared prompts: `models.blocks.compile_decoder_layers`),
    each after 2 warm-up steps: `learner_phases` of each, and the eager step's products (`gemm_recorder`)."""
    from models.blocks import compile_decoder_layers
    phases, recorder = {}, None
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            compile_decoder_layers(worker.strategy.engine.module)
        for _ in range(2):
            worker.train_step(micro_batches, "ppo_clip", params)
        phases[mode] = learner_phases(worker, micro_batches, params)
        if mode == "eager":  # the dispatch mode sees every product of the eager step
            recorder = gemm_recorder()
            with recorder:
                worker.train_step(micro_batches, "ppo_clip", params)
    return phases, recorder


def learner_phases(worker, micro_batches, params: dict, steps: int = 2) -> dict[str, float]:
    """Median seconds of a learner step (`step`) and of what it spends in its forward (the family's logprobs; the
    loss is a few elementwise ops), its backward and DeepSpeed's optimizer step, over `steps` steps."""
    engine, family = worker.strategy.engine, worker.family
    took: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer_step": [], "step": []}
    now: dict[str, float] = {}

    def timed(fn, key: str):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                now[key] = now.get(key, 0.0) + time.perf_counter() - t0
        return call
    patched = [(family, "forward", "forward"), (engine, "backward", "backward"), (engine, "step", "optimizer_step")]
    for obj, name, key in patched:
        setattr(obj, name, timed(getattr(obj, name), key))
    try:
        for _ in range(steps):
            now.clear()
            t0 = time.perf_counter()
            worker.train_step(micro_batches, "ppo_clip", params)
            now["step"] = time.perf_counter() - t0
            for key in took:
                took[key].append(now.get(key, 0.0))
    finally:
        for obj, name, _ in patched:
            delattr(obj, name)
    return {key: statistics.median(v) for key, v in took.items()}


def attention_in_loop(generate) -> dict[str, float]:
    """One generate of the engine's loop with its one-query attention calls (`rollout.fused_attention`'s compiled
    kernel) timed: their seconds, count and the bytes of keys and values they read."""
    import rollout.fused_attention as fused
    kernel = fused._attend
    total = {"s": 0.0, "calls": 0, "bytes": 0}

    def timed(query, key, value, mask, scaling):
        t0 = time.perf_counter()
        try:
            return kernel(query, key, value, mask, scaling)
        finally:
            total["s"] += time.perf_counter() - t0
            total["calls"] += 1
            total["bytes"] += 2 * key.numel() * key.element_size()
    fused._attend = timed
    try:
        generate(True)
    finally:
        fused._attend = kernel
    return total


def read_rates(dtype, rows: int, heads: int, head_size: int, positions: int, layers: int) -> dict[str, float]:
    """Bytes/s at which `layers` layers' keys and values `[rows, heads, positions, head_size]` (views of buffers
    with room for 64 more positions, as the loop's) are read: by the fused attention kernel and by a compiled plain
    read (each position's keys and values converted to fp32 and summed, the least work a kernel reading them does),
    each cold (the layers in turn: a layer's cache has left the CPU's caches before its next read, as in the loop)
    and hot (one layer again and again)."""
    import torch

    import rollout.fused_attention as fused
    keys = [torch.randn(rows, heads, positions + 64, head_size).to(dtype)[:, :, :positions] for _ in range(layers)]
    values = [torch.randn(rows, heads, positions + 64, head_size).to(dtype)[:, :, :positions] for _ in range(layers)]
    query = torch.randn(rows, heads, 1, head_size).to(dtype)
    mask = torch.zeros(rows, 1, 1, positions, dtype=dtype)
    plain = torch.compile(lambda k, v: (k.float().sum(-1), v.float().sum(-1)), dynamic=True)
    reads = {"attention": lambda k, v: fused._kernel()(query, k, v, mask, 0.125), "plain_read": plain}
    size = 2 * keys[0].numel() * keys[0].element_size()
    out = {}
    for name, read in reads.items():
        for temperature, order in (("cold", range(layers)), ("hot", [0] * layers)):
            best = float("inf")
            for _ in range(4):
                t0 = time.perf_counter()
                for i in list(order) * 3:
                    read(keys[i], values[i])
                best = min(best, (time.perf_counter() - t0) / (3 * layers))
            out[f"{name}_{temperature}_bytes_per_s"] = size / best
    return {"positions": positions, **out}


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


def record(dtype: str, threads: int) -> dict:
    """Run and time the generate (`time_generates`, `attention_in_loop`) and the learner step (`time_learner`),
    record and replay their products (`gemm_recorder`, `replay`) and measure the cache's read rates
    (`read_rates`): the raw figures `measure` derives the report from."""
    import torch

    from cluster.learner import LearnerWorker
    from cluster.ray_utils import free_port
    from models.tiny import build_tiny_tokenizer, save_tiny
    from rl.batch import Batch, micro_batches_of, plan_prompt_groups
    from rollout.decoding import KVBuffers, decode
    from rollout.hardware import hardware_rates
    tok = build_tiny_tokenizer()
    ids, mask = race_prompts(tok)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny(Path(tmp) / "m", max_position_embeddings=128, **SHAPE)
        rollout = race_model(path, dtype)
        kept = KVBuffers()

        def generate(fused: bool, seed: int = 0, compiled: bool = False):
            torch.manual_seed(seed)
            with torch.no_grad(), kept.claim() as buffers:
                return decode(rollout, ids, mask, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, fused_attention=fused,
                              packed_weights=True, kv_buffers=buffers, compiled=compiled)
        resp, lengths, gen_s, compiled_s, compiled_lengths = time_generates(generate)
        attention = attention_in_loop(generate)
        generate(False)
        rec_decode = gemm_recorder()
        with rec_decode:
            lengths2 = generate(False)[2]
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
        phases, rec_learner = time_learner(worker, mbs, params)
        distinct = {"learner": len(rec_learner.calls), "decode": len(rec_decode.calls)}
        cfg = rollout.config
        head_size = cfg.hidden_size // cfg.num_attention_heads
        per_position = 2 * len(ids) * cfg.num_key_value_heads * head_size * rollout.dtype.itemsize
        return {"mask": mask, "lengths": lengths, "attn": attn, "batch": batch, "gen_s": gen_s,
                "compiled_s": compiled_s, "compiled_lengths": compiled_lengths, "attention": attention,
                "phases": phases, "numbers": worker.model_numbers(), "rates": hardware_rates(dtype),
                "distinct": distinct, "learner": replay(rec_learner.calls), "dec": replay(rec_decode.calls),
                "reads": read_rates(rollout.dtype, len(ids), cfg.num_key_value_heads, head_size,
                                    round(attention["bytes"] / attention["calls"] / per_position),
                                    cfg.num_hidden_layers)}


def race_model(path: Path, dtype: str):
    """The race's model at `path` in `dtype`, eager attention, for inference."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="eager").eval()


def measure(dtype: str, threads: int) -> dict:
    """One dtype's report: `record`'s figures against the bound and the trainer's floor."""
    from omegaconf import OmegaConf

    from cluster.perf import cached_reads, utilisation
    from rl.batch import sequence_tokens
    m = record(dtype, threads)
    numbers, rates, learner, dec, batch = m["numbers"], m["rates"], m["learner"], m["dec"], m["batch"]
    cfg = OmegaConf.create({"learner": {"world_size": 1}, "rollout": {"num_workers": 1, "generation_batch_size": 256},
                            "algorithm": {"mini_batches": 1}})
    hardware = {"model": numbers, "learner": rates, "rollout": rates}
    train, train_compiled = m["phases"]["eager"]["step"], m["phases"]["compiled"]["step"]
    generate_s, compiled_s = statistics.median(m["gen_s"]), statistics.median(m["compiled_s"])
    perf = utilisation(batch, {"train": train, "generate": generate_s}, train + generate_s, hardware, cfg,
                       train_passes=1, logprob_passes=0)
    kv_bytes = numbers["kv_bytes_per_token"] * cached_reads(batch)
    kv_read_s = kv_bytes / rates["copy_bytes_per_s"]
    learner_bound, decode_bound = learner["linear"] + learner["attention"], dec["linear"] + kv_read_s
    bound = learner_bound + decode_bound
    # the floor with each prompt once per group (its 8 rows share one prompt forward in both phases; rows are
    # prompt-major); the decode's reads of weights (one pass a step) and cache are as in the trainer's floor
    n, peak = numbers["matmul_params"], rates["matmul_flops"]
    tokens_once = float(m["attn"].sum() + m["mask"][::8].sum())
    reads_s = (numbers["param_bytes"] * int(m["lengths"].max()) + kv_bytes) / rates["copy_bytes_per_s"]
    floor_once = 6 * n * tokens_once / peak + max(2 * n * tokens_once / peak, reads_s)
    return {"dtype": dtype, "threads": threads, "cpu": cpu_kind(), "rows": len(m["lengths"]),
            "generated_tokens": int(m["attn"].sum()), "rows_run_to_64": int((m["lengths"] == 64).sum()),
            "tokens_prompts_per_row": float(sum(sequence_tokens(batch))), "tokens_prompts_once": tokens_once,
            "matmul_flops_ceiling": peak, "copy_bytes_per_s": rates["copy_bytes_per_s"],
            **products_report(learner, dec, kv_read_s, 2 * n * tokens_once), "distinct_products": m["distinct"],
            # `step_race`: as the race runs it (decoder layers compiled in the learner, the engine's eager loop)
            "measured_s": {"train": train, "train_compiled": train_compiled, "generate": generate_s,
                           "step": train + generate_s, "step_race": train_compiled + generate_s,
                           "generate_compiled": compiled_s},
            # the compiled step's lengths (bf16 rounding may end a sampled row elsewhere; it runs to the longest)
            "compiled_longest_row": int(m["compiled_lengths"].max()), "longest_row": int(m["lengths"].max()),
            "compiled_same_lengths": bool((m["compiled_lengths"] == m["lengths"]).all()),
            "floor_s": perf["perf/floor_s"], "learner_floor_s": perf["perf/learner_floor_s"],
            "decode_floor_s": perf["perf/decode_floor_s"], "floor_s_prompts_once": floor_once,
            "bound_s": bound, "bound_over_floor": bound / perf["perf/floor_s"],
            # each phase against its own bound (the decode: its linears alone + its cache reads)
            "decode_bound_s": decode_bound,
            "decode_over_bound": {"eager": generate_s / decode_bound, "compiled": compiled_s / decode_bound},
            "learner_over_bound": {"eager": train / learner_bound, "compiled": train_compiled / learner_bound},
            # eager: both phases uncompiled; compiled: the decode step compiled; race: the learner's layers compiled
            "step_over_bound": {"eager": (train + generate_s) / bound, "compiled": (train + compiled_s) / bound,
                                "race": (train_compiled + generate_s) / bound},
            "decode_mfu_compiled": perf["perf/decode_mfu"] * generate_s / compiled_s,
            "bound_over_floor_prompts_once": bound / floor_once,
            "measured_over_floor": perf["perf/step_over_floor"],
            "mfu": perf["perf/mfu"], "decode_mfu": perf["perf/decode_mfu"],
            "time_split": time_split(m["phases"], learner, dec, m["attention"], m["reads"], generate_s)}


def products_report(learner: dict, dec: dict, kv_read_s: float, forward_flops: float) -> dict:
    """The replayed products' seconds alone and in their run, their rates, and a check on the recording: their
    FLOPs over the model FLOPs of the tokens each phase runs (`forward_flops`: 2 N a token, prompts once; the learner
    runs 3x that, and not a response's last token)."""
    return {"products_alone_s": {"learner_linear": learner["linear"], "learner_attention": learner["attention"],
                                 "decode_linear": dec["linear"], "decode_kv_reads_at_copy_bandwidth": kv_read_s},
            "products_in_context_s": {"learner_linear": learner["linear_in_context"],
                                      "learner_attention": learner["attention_in_context"],
                                      "decode_linear": dec["linear_in_context"]},
            "products_tflops": {"learner_linear": learner["linear_flops"] / max(learner["linear"], 1e-9) / 1e12,
                                "decode_linear": dec["linear_flops"] / max(dec["linear"], 1e-9) / 1e12},
            "recorded_over_model_flops": {"learner": learner["linear_flops"] / (3 * forward_flops),
                                          "decode": dec["linear_flops"] / forward_flops}}


def time_split(phases: dict, learner: dict, dec: dict, attention: dict, reads: dict, generate_s: float) -> dict:
    """Where each phase's time goes: the learner's forward, backward and optimizer step (eager and compiled), its
    products by pass (replayed alone and in the recorded run, TFLOP/s); the decode's one-query attention in the loop
    (seconds and the rate it reads the cache at, beside `read_rates`), its linears in the recorded run and the rest."""
    passes = {}
    for part in ("forward", "input_gradient", "weight_gradient"):
        flops = learner[f"linear_{part}_flops"]
        alone, context = learner[f"linear_{part}"], learner[f"linear_{part}_in_context"]
        passes[part] = {"alone_s": alone, "in_context_s": context, "tflops_alone": flops / max(alone, 1e-9) / 1e12,
                        "tflops_in_context": flops / max(context, 1e-9) / 1e12}
    learner = {mode: {f"{k}_s": v for k, v in times.items()} for mode, times in phases.items()}
    return {"learner": {**learner, "linear_by_pass": passes},
            "decode": {"generate_s": generate_s, "attention_s": attention["s"], "attention_calls": attention["calls"],
                       "attention_bytes_per_s": attention["bytes"] / max(attention["s"], 1e-9),
                       "attention_bytes": attention["bytes"], "read_rates": reads,
                       "linear_in_context_s": dec["linear_in_context"],
                       "rest_s": generate_s - attention["s"] - dec["linear_in_context"]}}


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
    # glibc's malloc settings of looprl's actors (`cluster.ray_utils.ACTOR_ENV`): freed activations stay in the
    # heap, so a step does not page-fault its memory in again (without them the learner's forward products ran at
    # 0.6 of their rate in context)
    malloc = {k: v for k, v in ACTOR_ENV.items() if k.startswith("MALLOC_")}
    for dtype in args.dtypes:
        proc = subprocess.run([sys.executable, __file__, "--one", dtype, "--threads", str(args.threads)],
                              capture_output=True, text=True, cwd=ROOT, env={**os.environ, **malloc})
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"gemm_bound: the {dtype} run failed")
        results[dtype] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[dtype]), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
