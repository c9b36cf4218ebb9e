"""The held-out evaluation of a run on its rollout workers and reward service (the protocol itself, Ray-free,
is `rl.evaluate`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from omegaconf import DictConfig

from cluster.rollout_pipeline import generate as generate_on_workers
from rl.step import component_means, reward_items


def evaluate(workers: list[Any], reward_service: Any, tokenizer: Any, cfg: DictConfig, rows: list[dict],
             *, seed: int = 0) -> dict[str, float]:
    """Mean reward (accuracy for 0/1 rewards) on `rows` under the recipe's evaluation protocol:
    `rollout.eval_runs` independent samples per prompt (run r = every prompt's r-th sample) at
    `rollout.eval_temperature` and `rollout.eval_top_p`; `accuracy` is the mean over runs (mean@k) and
    `accuracy_std_over_runs` its spread. Also the mean of every reward function's score and components
    (`components`)."""
    rows = rows[: cfg.trainer.eval_max_prompts]
    runs = cfg.rollout.eval_runs
    batch = generate_on_workers(workers, tokenizer, cfg, rows, temperature=cfg.rollout.eval_temperature, n=runs,
                     seed=seed, group_base=0, evaluation=True, sampling_overrides={"top_p": cfg.rollout.eval_top_p})
    scored = ray.get(reward_service.score.remote(reward_items(batch), evaluation=True))
    scores = [s["score"] for s in scored]
    per_run = np.asarray(scores, dtype=np.float64).reshape(len(rows), runs).mean(axis=0)  # rows are prompt-major
    # every function's score and components (weight-0 and eval_only held-out judges included)
    components = component_means([s["components"] for s in scored])
    return {"accuracy": float(per_run.mean()), "num_prompts": float(len(rows)), "components": components,
            "runs": float(runs), "accuracy_std_over_runs": float(per_run.std(ddof=1)) if runs > 1 else 0.0,
            "failures": float(sum(s["failed"] for s in scored)),
            "response_length": float(batch.response_attn.sum(-1).float().mean()),
            "examples": [{"prompt": p, "response": r, "score": s}
                         for p, r, s in list(zip(batch.prompts, batch.responses, scores))[:3]],
            # every sample's score and components (prompt-major, `runs` per prompt), for paired comparisons
            "per_sample": [{"score": s["score"], "failed": bool(s["failed"]), "components": s["components"]}
                           for s in scored]}


def worker_protocol(workers: list[Any], reward_service: Any, tokenizer: Any, cfg: DictConfig, rows: list[dict]
                    ) -> tuple[Callable[..., Any], Callable[[Any], list[float]]]:
    """The protocol's `generate` and `score` on the run's rollout workers and reward service: one answer per
    row of `rows` (`trainer.eval_max_prompts` of them), scored by the training reward."""
    rows = rows[: cfg.trainer.eval_max_prompts]

    def generate(*, temperature: float, top_p: float, seed: int, exit_at_step: int | None = None) -> Any:
        overrides = {"top_p": top_p, **({"exit_at_step": exit_at_step} if exit_at_step is not None else {})}
        return generate_on_workers(workers, tokenizer, cfg, rows, temperature=temperature, n=1, seed=seed,
                                   evaluation=True, sampling_overrides=overrides)

    def score(batch: Any) -> list[float]:
        return [s["score"] for s in ray.get(reward_service.score.remote(reward_items(batch)))]

    return generate, score
