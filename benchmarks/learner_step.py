"""One learner step of the ~85M model on CPU, by attention kernel and by micro-batching, alternated in one
process so that every variant sees the same machine.

    python benchmarks/learner_step.py [--rows 128] [--steps 3] [--threads 2] [--dtype bfloat16] [--max-tokens 2048 ...]
                                      [--kernels sdpa eager] [--lengths uniform|race] [--max-padding 0.25 0.05 ...]
                                      [--compile] [--batchings shared_prompts ...]

Workload: the race's model and rows (`benchmarks/grpo_step.py`: the 85M model, 16 prompts sampled 8 times each,
up to 64 response tokens) with longer prompts (18–30 tokens; the race's arithmetic prompts have 7–9) and ragged
responses (8–64 tokens, uniform: what a rollout of sampled answers of different lengths gives); `--lengths race`:
the race's shapes instead, prompts of 7–9 tokens and response lengths drawn as the race's rollouts of a random
model end (geometric, mean 80, capped at 64: about half run the whole length). The `ppo_clip` loss, DeepSpeed
ZeRO-0 on one rank. Variants:
`learner.attn_implementation` sdpa or eager, and the rows as one padded micro-batch (`micro_batch_size` =
rows), as token-budget micro-batches (`learner.max_tokens_per_micro_batch`), each at its own width, or as
token-budget micro-batches that keep a prompt's rows together and run each prompt once (`learner.share_prompts`),
or as token-budget micro-batches each run as one packed row of its real tokens (`learner.pack_sequences`;
`packed_shared_prompts`: each prompt once in the row, its responses attending to it; both through
`models.varlen_attention` for the eager and sdpa kernels).
Several `--max-tokens` give a variant per budget (named `...@budget`); several `--max-padding` a shared-prompts
variant per padding allowed in a response bucket (`models.families.length_buckets`, named `...~padding`);
`--compile` runs every variant also with the decoder layers' MLPs, norms and rotary embedding compiled
(`models.blocks.compile_position_wise`, named `.../compiled`; compiled in the warm-up step); with
`--compile-layers` those are compiled in every variant and the `.../compiled` ones run each decoder layer
compiled whole (`models.blocks.compile_decoder_layers`, what `learner.compile_position_wise` does with packed rows
and shared prompts); `--batchings` keeps only
the micro-batchings named (the first variant named is then the ratios' base).
Reports the median step time of each variant (after one warm-up step) and the ratios to the first kernel's one
micro-batch.
Results: benchmarks/results/learner_step.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 768, "num_layers": 14, "num_heads": 12, "intermediate_size": 1536}


def ragged_batch(rows: int, seed: int = 0, lengths: str = "uniform"):
    import torch

    from rl.batch import Batch
    g = torch.Generator().manual_seed(seed)
    P, L, n = 30, 64, 8
    groups = -(-rows // n)
    if lengths == "race":
        plen = torch.randint(7, 10, (groups,), generator=g)
        u = torch.rand(rows, generator=g)  # geometric with mean 80 by inversion, capped at L
        rlen = (torch.log1p(-u) / torch.log1p(torch.tensor(-1 / 80))).ceil().long().clamp(1, L)
    else:
        plen = torch.randint(18, P + 1, (groups,), generator=g)
        rlen = torch.randint(8, L + 1, (rows,), generator=g)
    pm = (torch.arange(P)[None] >= (P - plen)[:, None]).long()
    prompts = torch.randint(5, 100, (groups, P), generator=g) * pm
    pm, prompts = pm.repeat_interleave(n, 0)[:rows], prompts.repeat_interleave(n, 0)[:rows]  # n samples a prompt
    rm = (torch.arange(L)[None] < rlen[:, None]).float()
    return Batch(prompt_ids=prompts, prompt_mask=pm,
                 response_ids=torch.randint(5, 100, (rows, L), generator=g) * rm.long(), response_mask=rm,
                 response_attn=rm.long(), group_id=torch.arange(rows) // 8, advantages=torch.randn(rows, L) * rm)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, nargs="+", default=[2048],
                   help="token budgets of the budgeted micro-batches (several: a variant for each)")
    p.add_argument("--kernels", nargs="+", default=["sdpa", "eager"], choices=["sdpa", "eager"])
    p.add_argument("--lengths", default="uniform", choices=["uniform", "race"],
                   help="prompt and response lengths: 18-30 and uniform 8-64, or the race's (see above)")
    p.add_argument("--compile", action="store_true", help="each variant also with compiled MLPs and norms")
    p.add_argument("--compile-layers", action="store_true",
                   help="with --compile: MLPs, norms and rotary compiled in every variant, and the '/compiled' "
                        "variants with the decoder layers compiled whole (models.blocks.compile_decoder_layers)")
    p.add_argument("--batchings", nargs="+", default=None,
                   choices=["one_micro_batch", "token_budget", "shared_prompts", "packed", "packed_shared_prompts"],
                   help="only these micro-batchings (default: all)")
    p.add_argument("--max-padding", type=float, nargs="+", default=None,
                   help="padding allowed in a shared-prompts response bucket (several: a variant for each)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/learner_step.json"))
    return p.parse_args()


def micro_batch_plans(batch, args: argparse.Namespace) -> tuple[dict, dict]:
    """Each micro-batching variant's plan of `batch`'s rows (one per `--max-tokens` budget and, for shared prompts,
    per `--max-padding`), and the padding its response buckets allow."""
    import models.families as families
    from rl.batch import contiguous_plan, plan_micro_batches, plan_prompt_groups, sequence_tokens
    at = (lambda b: f"@{b}") if len(args.max_tokens) > 1 else (lambda b: "")  # noqa: E731
    plans = {"one_micro_batch": contiguous_plan(args.rows, 1, 1)}
    for b in args.max_tokens:
        plans[f"token_budget{at(b)}"] = plan_micro_batches(sequence_tokens(batch), 1, b)
    paddings = {"": families.BUCKET_MAX_PADDING} if args.max_padding is None else {
        f"~{pad}": pad for pad in args.max_padding}
    padding_of = {}
    for b in args.max_tokens:
        for name, pad in paddings.items():
            plans[f"shared_prompts{at(b)}{name}"] = plan_prompt_groups(batch, 1, b)
            padding_of[f"shared_prompts{at(b)}{name}"] = pad
    for b in args.max_tokens:  # one packed row per micro-batch (`learner.pack_sequences`), prompts once or not
        plans[f"packed{at(b)}"] = plan_micro_batches(sequence_tokens(batch), 1, b)
        plans[f"packed_shared_prompts{at(b)}"] = plan_prompt_groups(batch, 1, b)
    if args.batchings:
        plans = {k: v for k, v in plans.items() if k.split("@")[0].split("~")[0] in args.batchings}
    return plans, {k: padding_of.get(k, families.BUCKET_MAX_PADDING) for k in plans}


def positions_run(m, name: str, max_padding: float) -> int:
    """Token positions the decoder runs for micro-batch `m` under batching `name` (padding included)."""
    import models.families as families
    from models.common import distinct_prompts
    if name.startswith("packed"):  # real tokens, without each response's last; prompts once if shared
        _, _, (_, owns) = families.packed_inputs(m, share_prompts=name.startswith("packed_shared"))
        return sum(len(o) for o in owns)
    if not name.startswith("shared_prompts"):
        return m.prompt_ids.numel() + m.response_ids.numel()
    lengths = m.response_attn.sum(-1).tolist()  # the responses run in buckets, without their last token
    return (len(distinct_prompts(m.prompt_ids, m.prompt_mask)[0]) * m.prompt_ids.shape[1]
            + sum(len(b) * (max(1, lengths[b[0]]) - 1)
                  for b in families.length_buckets(lengths, max_padding=max_padding)))


def compiled_switches(model, args: argparse.Namespace) -> tuple[dict, dict]:
    """With `--compile`: the model compiled in place once (`--compile-layers`: whole layers), and what each variant
    sets or clears: the modules' compiled calls, the rotary embedding's compiled and original function by module."""
    import sys

    from models.blocks import compile_decoder_layers, compile_position_wise, compile_rotary
    if not args.compile:
        return {}, {}
    if args.compile_layers:
        compile_always_on(model)
        compile_decoder_layers(model)
    else:
        compile_position_wise(model)
    compiled_calls = {m: m._compiled_call_impl for m in model.modules()
                      if getattr(m, "_compiled_call_impl", None) is not None}
    rotary = {}
    for name in [] if args.compile_layers else compile_rotary(model):  # its modeling module's function
        fn = sys.modules[name].apply_rotary_pos_emb
        rotary[sys.modules[name]] = (fn, fn.looprl_original)
    return compiled_calls, rotary


def time_variants(worker, args: argparse.Namespace, variants: list, mbs: dict, params: dict,
                  padding_of: dict) -> dict[str, list[float]]:
    """Every variant's step times, the variants alternated step by step (each sees the same machine load); the first
    step of each warms up."""
    import models.families as families
    buckets = families.length_buckets
    model = worker.strategy.engine.module
    compiled_calls, rotary = compiled_switches(model, args)
    times: dict[str, list[float]] = {variant_name(v): [] for v in variants}
    try:
        for step in range(args.steps + 1):
            for variant in variants:
                kernel, batching, compiled = variant
                for module, call in compiled_calls.items():
                    module._compiled_call_impl = call if compiled else None
                for module, (fast, original) in rotary.items():
                    module.apply_rotary_pos_emb = fast if compiled else original
                model.set_attn_implementation(kernel)
                worker.family.share_prompts = "shared_prompts" in batching
                worker.pack = batching.startswith("packed")
                families.length_buckets = functools.partial(buckets, max_padding=padding_of[batching])
                t0 = time.perf_counter()
                worker.train_step(mbs[batching], "ppo_clip", params)
                dt = time.perf_counter() - t0
                if step > 0:
                    times[variant_name(variant)].append(dt)
                print(json.dumps({"step": step, "variant": variant_name(variant), "s": round(dt, 3)}), flush=True)
    finally:
        families.length_buckets = buckets
    return times


def variant_name(variant: tuple) -> str:
    kernel, batching, compiled = variant
    return f"{kernel}/{batching}" + ("/compiled" if compiled else "")


def main() -> None:
    from cluster.ray_utils import exec_with_actor_malloc
    exec_with_actor_malloc()  # timed as an actor runs: with its malloc settings
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from cluster.learner import LearnerWorker
    from cluster.ray_utils import free_port
    from models.tiny import save_tiny
    from rl.batch import micro_batches_of, sequence_tokens
    batch = ragged_batch(args.rows, lengths=args.lengths)
    params = {"num_tokens": float(batch.response_mask.sum()), "num_seqs": float(args.rows)}
    plans, padding_of = micro_batch_plans(batch, args)
    mbs = {k: micro_batches_of(batch, plan)[0] for k, plan in plans.items()}
    positions = {k: sum(positions_run(m, k, padding_of[k]) for m in v) for k, v in mbs.items()}
    variants = list(itertools.product(args.kernels, plans, [False, True] if args.compile else [False]))
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny(Path(tmp) / "m", max_position_embeddings=128, **SHAPE)
        worker = LearnerWorker(0, 1, "127.0.0.1", free_port(), str(path), lr=1e-6, dtype=args.dtype,
                               micro_batch_size=args.rows, threads=args.threads)
        times = time_variants(worker, args, variants, mbs, params, padding_of)
    med = {k: statistics.median(v) for k, v in times.items()}
    base_name = variant_name(variants[0])
    speedup_key = "speedup_vs_" + base_name.replace("/", "_")
    report = {"workload": {"rows": args.rows, "real_tokens": sum(sequence_tokens(batch)), "model": SHAPE,
                           "lengths": args.lengths, "bucket_max_padding": padding_of,
                           "dtype": args.dtype, "threads": args.threads, "steps": args.steps,
                           "max_tokens_per_micro_batch": args.max_tokens},
              "micro_batches": {k: len(v) for k, v in mbs.items()}, "token_positions": positions,
              "step_s": times, "median_step_s": med, speedup_key: {k: med[base_name] / v for k, v in med.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("token_positions", "median_step_s", speedup_key)}))


def compile_always_on(model) -> None:
    """The position-wise modules' forwards and the rotary embedding compiled for every variant (`--compile-layers`:
    what the whole layers are measured against), not through `_compiled_call_impl`, which the variants toggle."""
    import torch

    from models.blocks import POSITION_WISE, compile_rotary, decoder_layers
    for layer in decoder_layers(model):
        for name in POSITION_WISE:
            module = getattr(layer, name, None)
            if module is not None:
                module.forward = torch.compile(module.forward, dynamic=True)
    model.model.norm.forward = torch.compile(model.model.norm.forward, dynamic=True)
    compile_rotary(model)


if __name__ == "__main__":
    main()
