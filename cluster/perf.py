"""Performance accounting of an RL step: the hardware ceilings each role measures, the engines' own generation
time, the KV-cache reads of a decode, and the utilisation metrics (`perf/mfu`, `perf/mbu`, `perf/floor_s`)."""

from __future__ import annotations

from typing import Any

import ray
from omegaconf import DictConfig

from rl.batch import Batch
from rollout.hardware import best_rates

# ---------------------------------------------------------------------- helpers shared with other stages
# The ceilings measured in this driver process, by (node, dtype, threads per actor): a node's matmul and copy rates
# do not change between the runs of one process (the stages of a pipeline, a test session), and measuring them costs
# about a second per role and run, in which nothing else may run.
_CEILINGS: dict[tuple[str, str, int], dict[str, float]] = {}
# The keys measured `again` (warm, after a run's first step) in this process: one warm measurement per key is enough
_MEASURED_WARM: set[tuple[str, str, int]] = set()


def ceilings(actor: Any, dtype: str, threads: int, again: bool = False) -> dict[str, float]:
    """The hardware rates that `perf/mfu` and `perf/mbu` divide by (`rollout.hardware.hardware_rates`) for a role whose
    first actor is `actor`: measured by that actor, unless one with the same `threads` on the same node measured
    them in `dtype` earlier in this process. `again` measures anew and keeps each rate's best (a ceiling), once per
    node, dtype and threads in this process: a later run's `again` takes the warm measurement an earlier run made."""
    key = (ray.get(actor.node_id.remote()), dtype, threads)
    if key in _CEILINGS and (not again or key in _MEASURED_WARM):
        return _CEILINGS[key]
    _CEILINGS[key] = best_rates(ray.get(actor.hardware_rates.remote(dtype, again=again)), _CEILINGS.get(key))
    if again:
        _MEASURED_WARM.add(key)
    return _CEILINGS[key]


def engine_seconds(batch: Batch) -> float | None:
    """Seconds the rollout engines spent generating `batch`, summed over workers (each row carries its share of its
    chunk's decode time, `gen_s`, in its metadata: the `hf` engine reports it); None unless every row does."""
    reported = [m["gen_s"] for m in batch.metadata if isinstance(m, dict) and "gen_s" in m]
    return float(sum(reported)) if reported and len(reported) == len(batch) else None


def cached_reads(batch: Batch) -> float:
    """Cached positions the decode reads for `batch`: each fed token of a row reads its cache, `(r - 1) p + r (r - 1)
    / 2` for a prompt of p and a response of r tokens."""
    lengths = batch.response_attn.sum(-1).tolist()
    prompt_lengths = batch.prompt_mask.sum(-1).tolist()
    return float(sum((r - 1) * p + r * (r - 1) / 2 for p, r in zip(prompt_lengths, lengths) if r > 0))


def utilisation(batch: Batch, timing: dict[str, float], step_s: float, hardware: dict[str, dict[str, float]],
                cfg: DictConfig, train_passes: int, logprob_passes: int) -> dict[str, float]:
    """How close each phase ran to the machine's limits, against ceilings measured in the actors.

    * `perf/mfu`: learner model-FLOPs utilisation, `(6 N T x updates + 2 N T x logprob passes) / (time of the
      train and logprob phases x ranks x matmul FLOP/s)`, N the matmul parameters, T the batch's real tokens
      (an update is one pass over its share: `ppo_epochs` passes of the batch in all).
    * `perf/decode_mfu`: generation's FLOPs (`2 N` per prompt and generated token) over the rollout workers'
      matmul rate during their generation time (as the engines report it); `perf/mbu`: generation's reads of
      the weights (once per decode step; a worker decodes its rows in chunks of `rollout.generation_batch_size`,
      each as many steps as its longest response) and of the KV cache (each fed token of a row reads its
      cached positions: `(r - 1) p + r (r - 1) / 2` for a prompt of p and a response of r tokens), over the
      measured copy bandwidth. Decoding is bound by whichever of the two floors is higher.
    * `perf/floor_s`: the step's floor (learner FLOPs at the full matmul rate plus the binding decode floor)
      and `perf/step_over_floor` the step's time over it. The critic's work is not counted.
    """
    from rl.batch import sequence_tokens
    n, weight_bytes = hardware["model"]["matmul_params"], hardware["model"]["param_bytes"]
    peak_l, peak_r = hardware["learner"]["matmul_flops"], hardware["rollout"]["matmul_flops"]
    bandwidth = hardware["rollout"]["copy_bytes_per_s"]
    ranks, workers = cfg.learner.world_size, cfg.rollout.num_workers
    tokens = float(sum(sequence_tokens(batch)))
    updates = train_passes / max(1, cfg.algorithm.mini_batches)  # passes over the whole batch
    learner_flops = 6 * n * tokens * updates + 2 * n * tokens * logprob_passes
    generated = float(batch.response_attn.sum())
    decode_flops = 2 * n * (generated + float(batch.prompt_mask.sum()))
    lengths = batch.response_attn.sum(-1).tolist()
    per_worker = -(-len(lengths) // workers)
    chunk = cfg.rollout.generation_batch_size
    steps = sum(max(lengths[i:i + chunk]) for w in range(workers)
                for i in range(w * per_worker, min(len(lengths), (w + 1) * per_worker), chunk))
    # all workers' steps (they run in parallel) and every row's reads of its cached keys and values
    decode_bytes = weight_bytes * steps + hardware["model"].get("kv_bytes_per_token", 0.0) * cached_reads(batch)
    learner_s = timing.get("train", 0.0) + timing.get("logprobs", 0.0)
    # the workers' own generation time, which an overlapped rollout hides from the step's `generate` phase; else
    # the phase times the workers
    reported = engine_seconds(batch)
    worker_s = reported if reported is not None else timing.get("generate", 0.0) * workers
    out = {"perf/mfu": learner_flops / max(learner_s * ranks * peak_l, 1e-9) if learner_flops else 0.0,
           "perf/decode_mfu": decode_flops / max(worker_s * peak_r, 1e-9),
           "perf/mbu": decode_bytes / max(worker_s * bandwidth, 1e-9)}
    floor = learner_flops / (ranks * peak_l) + max(decode_flops / (workers * peak_r), decode_bytes / (workers * bandwidth))
    out.update({"perf/floor_s": floor, "perf/step_over_floor": step_s / max(floor, 1e-9),
                "perf/learner_floor_s": learner_flops / (ranks * peak_l),
                "perf/decode_floor_s": max(decode_flops / (workers * peak_r), decode_bytes / (workers * bandwidth))})
    return out
