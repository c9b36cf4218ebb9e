"""Generation on the rollout workers: submitting prompts (split over the workers, `n` samples each), gathering
the results into one batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from omegaconf import DictConfig

from cluster.ray_utils import unfinished
from rl.batch import Batch
from rl.config import as_container
from rl.data import format_prompt


@dataclass
class SubmittedRollout:
    """A generation in flight: the rollout workers' ObjectRefs and how to submit the same prompts and seeds
    again (after a rollout worker died)."""
    refs: list[Any]
    resubmit: Callable[[], list[Any]]


def submit_generation(workers: list[Any], tokenizer: Any, cfg: DictConfig, rows: list[dict], *,
                      temperature: float, n: int, seed: int, group_base: int = 0, evaluation: bool = False,
                      sampling_overrides: dict[str, Any] | None = None) -> list[Any]:
    """Spread prompts over the rollout workers without waiting; returns the workers' ObjectRefs
    (`Batch.concat(ray.get(refs))` is the prompt-major batch). Each worker runs its calls in order, so
    a generation submitted before a weight update samples from the weights before it. `evaluation` picks
    the recipe's evaluation decoding method instead of the rollout one; `sampling_overrides` replace sampling
    parameters (top_p, exit_at_step) for an evaluation protocol."""
    d = cfg.data
    prompts = [format_prompt(r[d.prompt_column], tokenizer, d.prompt_prefix, d.chat_template) for r in rows]
    answers = [r.get(d.answer_column) for r in rows]
    k = min(len(workers), len(prompts))
    bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
    futures = []
    for w in range(k):
        lo, hi = bounds[w], bounds[w + 1]
        sampling = {"n": n, "temperature": temperature, "top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k,
                    "max_new_tokens": cfg.rollout.max_new_tokens, "seed": seed * 131 + w,
                    "stop": list(cfg.rollout.stop) or None}
        r = cfg.rollout
        decoding, params = (r.eval_decoding, r.eval_decoding_params) if evaluation else (r.decoding, r.decoding_params)
        if decoding is not None:
            sampling.update(decoding=decoding, decoding_params=as_container(params))
        sampling.update(sampling_overrides or {})
        groups = list(range(group_base + lo, group_base + hi))
        meta = [{"row": group_base + i, **{c: rows[i].get(c) for c in d.metadata_columns}} for i in range(lo, hi)]
        rows_w = [{**row, "answer": row.get(d.answer_column)} for row in rows[lo:hi]]  # what episodes read
        if r.agent is not None:  # episodes of an agent program against the worker's OpenAI-compatible endpoint
            agent = {"program": r.agent, "timeout_s": r.agent_timeout_s, "workers": r.env_workers,
                     "max_episode_tokens": r.max_episode_tokens, "port": r.openai_port}
            futures.append(workers[w].run_agent_episodes.remote(prompts[lo:hi], rows_w, sampling, groups, agent,
                                                                meta))
        elif r.env is not None:  # multi-turn episodes of an environment
            env = {"name": r.env, "params": as_container(r.env_params), "max_turns": r.max_turns,
                   "max_episode_tokens": r.max_episode_tokens, "opponent_path": r.env_opponent_path,
                   "step_timeout_s": r.env_step_timeout_s, "schedule": r.agent_loop, "env_workers": r.env_workers}
            futures.append(workers[w].run_episodes.remote(prompts[lo:hi], rows_w, sampling, groups, env, meta))
        else:
            futures.append(workers[w].generate.remote(prompts[lo:hi], sampling, groups, answers[lo:hi], meta,
                                                      in_flight=r.in_flight_updates and not evaluation))
    return futures


def generate(workers: list[Any], tokenizer: Any, cfg: DictConfig, rows: list[dict], *, temperature: float,
             n: int, seed: int, group_base: int = 0, evaluation: bool = False,
             sampling_overrides: dict[str, Any] | None = None) -> Batch:
    """Spread prompts over the rollout workers; returns one Batch (prompt-major rows), within
    `trainer.deadlines.generate_s`."""
    refs = submit_generation(workers, tokenizer, cfg, rows, temperature=temperature, n=n, seed=seed,
                             group_base=group_base, evaluation=evaluation, sampling_overrides=sampling_overrides)
    limit = cfg.trainer.deadlines.generate_s
    if unfinished(refs, limit):
        raise TimeoutError(f"generation on the rollout workers did not finish within {limit:g} s "
                           f"(trainer.deadlines.generate_s)")
    return gather_rollout(refs)


def gather_rollout(refs: list[Any]) -> Batch:
    parts = ray.get(refs)
    batch = Batch.concat(parts)
    # a batch mixes the versions of its workers only if they were out of step: keep the oldest
    batch.policy_version = min(p.policy_version for p in parts)
    return batch
