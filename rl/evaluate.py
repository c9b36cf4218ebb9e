"""Held-out evaluation: generate on the eval prompts, score with the reward service, report accuracy."""

from __future__ import annotations

from typing import Any

import ray
from omegaconf import DictConfig

from rl.trainer import component_means, generate, reward_items


def evaluate(workers: list[Any], reward_service: Any, tokenizer: Any, cfg: DictConfig, rows: list[dict],
             *, seed: int = 0) -> dict[str, float]:
    """Mean reward (accuracy for 0/1 rewards) on `rows`, one sample per prompt at `rollout.eval_temperature`,
    and the mean of every reward function's score and components (`components`)."""
    rows = rows[: cfg.trainer.eval_max_prompts]
    batch = generate(workers, tokenizer, cfg, rows, temperature=cfg.rollout.eval_temperature, n=1,
                     seed=seed, group_base=0, evaluation=True)
    scored = ray.get(reward_service.score.remote(reward_items(batch), evaluation=True))
    scores = [s["score"] for s in scored]
    # every function's score and components (weight-0 and eval_only held-out judges included)
    components = component_means([s["components"] for s in scored])
    return {"accuracy": sum(scores) / len(scores), "num_prompts": float(len(scores)), "components": components,
            "failures": float(sum(s["failed"] for s in scored)),
            "response_length": float(batch.response_attn.sum(-1).float().mean()),
            "examples": [{"prompt": p, "response": r, "score": s}
                         for p, r, s in list(zip(batch.prompts, batch.responses, scores))[:3]]}
