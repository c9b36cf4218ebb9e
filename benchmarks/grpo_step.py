"""Per-phase GRPO step time and tokens/s, looprl vs TRL's GRPOTrainer on the same workload.

    python benchmarks/grpo_step.py [--models tiny 85m] [--steps 16] [--dtypes float32 bfloat16]
                                   [--trl-python /path/to/trl-env/bin/python]
    python benchmarks/grpo_step.py --workload realistic --steps 5 --trl-python /path/to/trl-env/bin/python

The realistic workload (`race`): 16 prompts x 8 samples x 64 new tokens per step on the ~85M model, both
sides on the same 2 cores, each in its best configuration (TRL: fp32 and bf16, 2 threads; looprl: the
settings in RACE_LOOPRL), with looprl's phase breakdown and its perf/* utilisation metrics (MFU of the
learner, decode MFU and bandwidth utilisation, the step's floor). Results: benchmarks/results/grpo_race.json.

Workload (matches benchmarks/trl_grpo_baseline.py, the TRL side): 2 prompts x 4 samples per step, 32 new
tokens, no reference model (beta 0), lr 1e-4; 1 and 2 torch threads per process; fp32, and bf16
(looprl: `model.dtype=bfloat16`, i.e. bf16 rollout weights and DeepSpeed bf16 training with fp32
master weights; TRL: its `bf16=True` mixed precision, which is TRL's default). Models: the peer's
shapes, a tiny one (hidden 128, 2 layers) and an ~85M-parameter one (hidden 768, 14 layers). looprl
runs through the real pipeline (Ray actors, DeepSpeed learner, hf engine, math-verify reward service);
the step breakdown is read from metrics.jsonl. The TRL peer runs in its own environment (trl pins
differ) with its own tiny Qwen2 of the same width/depth; the ratio is TRL s/step over looprl s/step.
Results: benchmarks/results/grpo_step.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.weight_sync import cpu_kind  # noqa: E402

PEER = ROOT / "benchmarks" / "trl_grpo_baseline.py"
# The peer's shapes: intermediate = 2 * hidden, heads = hidden / 64 (its Qwen2 vs our Llama: same blocks
# apart from Qwen2's qkv biases; its vocab is a 1024-token BPE, ours 101 characters).
MODELS = {
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
    "85m": {"hidden_size": 768, "num_layers": 14, "num_heads": 12, "intermediate_size": 1536},
}
PHASES = ("generate", "reward", "logprobs", "train", "sync", "other")
PERF = ("perf/mfu", "perf/decode_mfu", "perf/mbu", "perf/floor_s", "perf/step_over_floor", "perf/learner_floor_s",
        "perf/decode_floor_s", "perf/tokens")
# tiny: the peer's default; realistic: 16 prompts x 8 samples x 64 new tokens on the ~85M model
WORKLOADS = {"tiny": {"prompts_per_step": 2, "n": 4, "max_new_tokens": 32},
             "realistic": {"prompts_per_step": 16, "n": 8, "max_new_tokens": 64}}


def run_looprl(model: str, steps: int, out: Path, threads: int, dtype: str, staleness: int = 0,
               engine: str = "hf", workload: dict | None = None, extra: list[str] | None = None) -> dict:
    m = MODELS[model]
    w = workload or WORKLOADS["tiny"]
    overrides = [f"output_dir={out}", "sft.enabled=false", f"trainer.steps={steps}",
                 f"trainer.prompts_per_step={w['prompts_per_step']}", f"rollout.n={w['n']}",
                 f"rollout.max_new_tokens={w['max_new_tokens']}", "learner.lr=1e-4",
                 f"learner.micro_batch_size={w['prompts_per_step'] * w['n']}",
                 "algorithm.kl_coef=0.0", "data.synthetic.num_train=256", "data.synthetic.num_eval=2",
                 "trainer.eval_max_prompts=2", "trainer.save_hf=false", "logging.progress_bar=false",
                 "logging.tensorboard=false", "reward.num_workers=1",
                 f"model.tiny.max_position_embeddings={w['max_new_tokens'] + 64}", *(extra or []),
                 f"learner.threads={threads}", f"rollout.threads={threads}", f"model.dtype={dtype}",
                 f"trainer.max_staleness={staleness}", f"rollout.engine={engine}", f"algorithm.is_correction={'token' if staleness else 'none'}",
                 *[f"model.tiny.{k}={v}" for k, v in m.items()]]
    # a folder left by an earlier run of this benchmark holds its stages' records: the stage runner would reuse them
    # (same recipe and inputs; the code is not part of that record), run no step and report the earlier metrics
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "run", str(ROOT / "recipes/quickstart.yaml"), *overrides],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"looprl run failed ({model})")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    from transformers import AutoConfig, AutoModelForCausalLM
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(out / "base_model")).parameters())
    summary = json.loads((out / "summary.json").read_text())
    steady = rows[1:] if len(rows) > 1 else rows  # the first step pays one-off warm-up
    step_s = statistics.median(r["perf/step_s"] for r in steady)
    phases = {p: statistics.median(r[f"time/{p}"] for r in steady) for p in PHASES}
    perf = {k: statistics.median(r[k] for r in steady) for k in PERF if k in steady[0]}
    return {
        "params": params, "threads_per_actor": threads, "steps": len(rows), "step_s_median_excl_first": step_s,
        "perf_median": perf, "overrides": overrides,
        "step_s_mean_excl_first": statistics.mean(r["perf/step_s"] for r in steady), "phase_s_median": phases,
        "phase_share": {p: v / step_s for p, v in phases.items()},
        "tokens_per_s_median": statistics.median(r["perf/tokens_per_s"] for r in steady),
        "run_wall_s_incl_startup": time.perf_counter() - t0,
        "peak_rss_gib": summary.get("peak_rss_gib"),
        "generated_tokens_per_s_during_generate": statistics.median(
            r["perf/tokens"] / r["time/generate"] for r in steady),
    }


def run_raw_vllm(model_dir: Path, threads: int, dtype: str, steps: int) -> dict:
    """vLLM alone on the same batch (2 prompts x 4 samples x 32 tokens) in a fresh process: the ceiling
    for looprl's rollout phase with engine=vllm."""
    code = f"""
import json, statistics, time, torch
torch.set_num_threads({threads})
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from rollout.vllm_engine import VLLMEngine
from rl.data import format_prompt
if __name__ == "__main__":
    eng = VLLMEngine({str(model_dir)!r}, dtype={dtype!r})  # only for its LLM, built with looprl's settings
    ids = [eng.tokenizer(format_prompt(p, eng.tokenizer, "", True), add_special_tokens=False)["input_ids"]
           for p in ("12+34*5=", "67+8*9=")]
    times, toks = [], []
    for s in range({steps}):
        t = time.perf_counter()
        outs = eng.llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids],
                                SamplingParams(n=4, max_tokens=32, seed=s, logprobs=0), use_tqdm=False)
        times.append(time.perf_counter() - t)
        toks.append(float(sum(len(c.token_ids) for o in outs for c in o.outputs)))
    rate = [k / t for k, t in zip(toks[1:], times[1:])]
    print("RAW " + json.dumps({{"s_per_batch_median": statistics.median(times[1:]),
                               "tokens_per_s_median": statistics.median(rate)}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RAW ")), None)
    if line is None:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit("raw vLLM run failed")
    return json.loads(line[4:])


def run_trl(python: str, model: str, steps: int, workdir: Path, threads: int, dtype: str,
            workload: dict | None = None) -> dict:
    m = MODELS[model]
    w = workload or WORKLOADS["tiny"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # the peer builds its model only when the folder is missing: name the folder by its shapes
    model_dir = workdir / f"trl-{model}-h{m['hidden_size']}-l{m['num_layers']}"
    cmd = [python, str(PEER), "--steps", str(steps), "--model-dir", str(model_dir),
           "--out", str(workdir / f"trl-out-{model}"), "--hidden", str(m["hidden_size"]),
           "--layers", str(m["num_layers"]), *(["--bf16"] if dtype == "bfloat16" else []),
           "--prompts-per-step", str(w["prompts_per_step"]), "--num-generations", str(w["n"]),
           "--max-completion-length", str(w["max_new_tokens"])]
    workdir.mkdir(parents=True, exist_ok=True)  # TRL may run first in a round: the folder is not there yet
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BASELINE_RESULT ")), None)
    if line is None:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"TRL peer failed ({model})")
    return json.loads(line[len("BASELINE_RESULT "):])


# looprl's settings for the realistic race, all on 2 cores: colocated roles take turns with 2 threads each
# (synchronous), or one thread each overlapping (one-step-off); eager attention decodes faster on CPU, and
# trains faster at these lengths (sdpa's fused CPU kernel has a slow backward: `learner.attn_implementation`);
# token-budget micro-batches group rows of similar length; each micro-batch runs as one packed row of its real
# tokens (`learner.pack_sequences`: every linear layer runs once over them, no padding) holding each prompt once,
# the 8 rows of a prompt attending to it (`learner.share_prompts`; the budget keeps them in one micro-batch;
# `models.varlen_attention` keeps the sequences apart in buckets of similar length, no [T, T] mask). Packed with
# shared prompts against padded response buckets after a shared prompt forward (the previous settings,
# `..._buckets`), alternated in one process: bf16 4.69 -> 3.95 s, fp32 15.3 -> 12.8 s a learner step
# (`benchmarks/learner_step.py --lengths race --batchings shared_prompts packed_shared_prompts`).
# In bf16 a budget that holds the step's 128 rows in one micro-batch runs 1.25x faster than 2048 tokens (bigger
# matmul blocks, fewer small ops; +1.4 GiB peak: `benchmarks/learner_step.py --max-tokens 2048 8192`); fp32's
# matmuls are at their peak rate at 2048 already and gain nothing from it. The decoder layers' MLPs, norms and
# rotary embedding run compiled (`learner.compile_position_wise`, `--compile` there): 1.17x on the bf16 learner
# step; 1.06x on the packed fp32 one (12.83 -> 12.08 s, alternated in one process, AMX Xeon).
ROLLOUT_EAGER = ["rollout.engine_params.hf.attn_implementation=eager"]
LEARNER_CPU_BUCKETS = ["learner.attn_implementation=eager", "learner.max_tokens_per_micro_batch=2048",
                       "learner.share_prompts=true"]
LEARNER_CPU_EAGER = [*LEARNER_CPU_BUCKETS, "learner.pack_sequences=true"]
LEARNER_CPU = [*LEARNER_CPU_EAGER, "learner.compile_position_wise=true"]
LEARNER_CPU_BF16_BUCKETS = ["learner.attn_implementation=eager", "learner.max_tokens_per_micro_batch=8192",
                            "learner.share_prompts=true", "learner.compile_position_wise=true"]
LEARNER_CPU_BF16 = [*LEARNER_CPU_BF16_BUCKETS, "learner.pack_sequences=true"]
LEARNER_UNSHARED = LEARNER_CPU[:2]
RACE_LOOPRL = {
    "bfloat16_sync": dict(dtype="bfloat16", threads=2, staleness=0, extra=ROLLOUT_EAGER + LEARNER_CPU_BF16),
    # the engine's decode step compiled as one graph (`rollout.compiled_decode`; off by default)
    "bfloat16_sync_compiled_decode": dict(dtype="bfloat16", threads=2, staleness=0,
                                          extra=[*ROLLOUT_EAGER, "rollout.engine_params.hf.compiled_decode=true",
                                                 *LEARNER_CPU_BF16]),
    "bfloat16_sync_buckets": dict(dtype="bfloat16", threads=2, staleness=0,
                                  extra=ROLLOUT_EAGER + LEARNER_CPU_BF16_BUCKETS),
    "bfloat16_sync_budget_2048": dict(dtype="bfloat16", threads=2, staleness=0, extra=ROLLOUT_EAGER + LEARNER_CPU),
    "bfloat16_sync_unshared": dict(dtype="bfloat16", threads=2, staleness=0, extra=ROLLOUT_EAGER + LEARNER_UNSHARED),
    "bfloat16_sync_previous": dict(dtype="bfloat16", threads=2, staleness=0, extra=ROLLOUT_EAGER),
    # the quickstart recipe's hf engine parameters do not apply to vllm: replaced by none
    "bfloat16_sync_vllm": dict(dtype="bfloat16", threads=2, staleness=0, engine="vllm",
                               extra=["rollout.engine_params={}", *LEARNER_CPU_BF16]),
    "bfloat16_one_step_off": dict(dtype="bfloat16", threads=1, staleness=1, extra=ROLLOUT_EAGER + LEARNER_CPU_BF16),
    "float32_sync": dict(dtype="float32", threads=2, staleness=0, extra=ROLLOUT_EAGER + LEARNER_CPU),
    "float32_sync_eager": dict(dtype="float32", threads=2, staleness=0, extra=ROLLOUT_EAGER + LEARNER_CPU_EAGER),
    "float32_sync_buckets": dict(dtype="float32", threads=2, staleness=0, extra=ROLLOUT_EAGER + LEARNER_CPU_BUCKETS),
}


def race(args: argparse.Namespace, work: Path) -> None:
    """The realistic workload at equal cores (2): TRL's fp32 and bf16 with 2 threads, looprl's settings above;
    each side's step time, tokens/s, looprl's phases and its utilisation of the measured machine limits. The sides
    run `--rounds` times, their order alternating from round to round (the machine's speed drifts within a run:
    the per-round figures show it); each side's figure is its median over rounds."""
    w = WORKLOADS["realistic"]
    report: dict = {"workload": {**w, "model": "85m", "beta": 0.0, "steps": args.steps, "cores": 2},
                    "cpu": cpu_kind(), "rounds": [], "trl": {}, "looprl": {}}
    for round_ in range(args.rounds):
        sides = [lambda r=round_: race_trl(args, work, w, r), lambda r=round_: race_looprl(args, work, w, r)]
        looprl_first = args.looprl_first != (round_ % 2 == 1)
        results: dict = {"order": "looprl first" if looprl_first else "TRL first"}
        for side in (sides[::-1] if looprl_first else sides):
            results.update(side())
        report["rounds"].append(results)
    for side in ("trl", "looprl"):
        for name in {k for r in report["rounds"] for k in r.get(side, {})}:
            runs = [r[side][name] for r in report["rounds"] if name in r.get(side, {})]
            report[side][name] = {**runs[-1], "step_s_mean_excl_first": statistics.median(
                x["step_s_mean_excl_first"] for x in runs), "step_s_per_round": [x["step_s_mean_excl_first"]
                                                                                for x in runs]}
    best_trl = {d: t["step_s_mean_excl_first"] for d, t in report["trl"].items()}
    for name, r in report["looprl"].items():
        dtype = RACE_LOOPRL[name]["dtype"]
        if dtype in best_trl:
            r["speedup_vs_trl_same_dtype"] = best_trl[dtype] / r["step_s_mean_excl_first"]
            r["speedup_vs_trl_best"] = min(best_trl.values()) / r["step_s_mean_excl_first"]
    Path(args.race_out).write_text(json.dumps(report, indent=2))


def race_trl(args: argparse.Namespace, work: Path, w: dict, round_: int) -> dict:
    """TRL's side of one round of the race: each of `--trl-dtypes` (none without `--trl-python`)."""
    out = {}
    for dtype in args.trl_dtypes if args.trl_python else []:
        out[dtype] = run_trl(args.trl_python, "85m", args.steps, work / f"round{round_}", 2, dtype, w)
        print(json.dumps({"round": round_, "trl": dtype, **out[dtype]}), flush=True)
    return {"trl": out}


def race_looprl(args: argparse.Namespace, work: Path, w: dict, round_: int) -> dict:
    """looprl's side of one round of the race: each arm of RACE_LOOPRL (or `--race-arms`)."""
    out = {}
    for name, c in RACE_LOOPRL.items():
        if args.race_arms and name not in args.race_arms:
            continue
        out[name] = run_looprl("85m", args.steps, work / f"round{round_}" / f"race-{name}", c["threads"],
                               c["dtype"], c["staleness"], c.get("engine", "hf"), w, c["extra"])
        print(json.dumps({"round": round_, "looprl": name, "step_s": out[name]["step_s_mean_excl_first"],
                          "phases": out[name]["phase_s_median"], "perf": out[name]["perf_median"]}), flush=True)
    return {"looprl": out}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=["tiny", "realistic"], default="tiny",
                   help="realistic: the equal-core race on 16 prompts x 8 samples x 64 tokens (85M)")
    p.add_argument("--race-out", default=str(ROOT / "benchmarks/results/grpo_race.json"))
    p.add_argument("--race-arms", nargs="*", default=None, choices=list(RACE_LOOPRL),
                   help="realistic workload: only these looprl arms (default: all)")
    p.add_argument("--looprl-first", action="store_true",
                   help="realistic workload: run looprl's arms before TRL in the first round (the machine's speed "
                        "drifts within a run)")
    p.add_argument("--rounds", type=int, default=2,
                   help="realistic workload: rounds of the race, the sides' order alternating (medians reported)")
    p.add_argument("--trl-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                   help="realistic workload: TRL's dtypes")
    p.add_argument("--models", nargs="+", default=["tiny", "85m"], choices=list(MODELS))
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1],
                   help="looprl trainer.max_staleness values (k > 0 only with 1 thread per actor: the overlap "
                        "needs a core per role)")
    p.add_argument("--engines", nargs="+", default=["hf"], choices=["hf", "vllm"],
                   help="looprl rollout engines (vllm: also measured alone on the same batch)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="torch threads per process (looprl: per learner rank and rollout worker; TRL: its one process)")
    p.add_argument("--trl-python", default=None, help="python of an environment with trl installed")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/grpo_step.json"))
    p.add_argument("--workdir", default=str(ROOT / "runs/bench_grpo_step"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.workload == "realistic":
        race(args, work)
        return
    report: dict = {"workload": {"prompts_per_step": 2, "n": 4, "max_new_tokens": 32, "beta": 0.0,
                                 "steps": args.steps}, "models": {}}
    for model in args.models:
        entry: dict = {}
        for dtype, threads in itertools.product(args.dtypes, args.threads):
            trl = run_trl(args.trl_python, model, args.steps, work, threads, dtype) if args.trl_python else None
            for engine, k in itertools.product(args.engines, args.staleness):
                if k and threads > 1:
                    continue
                key = ("vllm_" if engine == "vllm" else "") + f"{dtype}_threads{threads}" + (f"_staleness{k}" if k else "")
                out = work / f"looprl-{model}-{key}"
                entry[key] = {"looprl": run_looprl(model, args.steps, out, threads, dtype, k, engine)}
                if engine == "vllm" and not k:
                    raw = run_raw_vllm(out / "base_model", threads, dtype, args.steps)
                    entry[key]["raw_vllm"] = raw
                    entry[key]["rollout_vs_raw_vllm"] = (
                        entry[key]["looprl"]["generated_tokens_per_s_during_generate"] / raw["tokens_per_s_median"])
                if trl is not None:
                    entry[key]["trl"] = trl
                    # both are means over steps 2..N of wall time per step, same thread count per process
                    entry[key]["speedup_vs_trl"] = (trl["step_s_mean_excl_first"]
                                                    / entry[key]["looprl"]["step_s_mean_excl_first"])
        report["models"][model] = entry
        print(json.dumps({model: entry}, indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
