"""Supervised warm-up stage: token-mean NLL of target tokens, trained on the DeepSpeed learner group."""

from __future__ import annotations

import random
import time
from typing import Any

from rl.batch import Batch, make_sft_batch  # noqa: F401  (the SFT batch layout; re-exported)


def run_sft(learners: Any, tokenizer: Any, rows: list[dict], *, prompt_key: str, target_key: str,
            steps: int, batch_size: int, grad_accum: int, seed: int,
            format_prompt: Any, log: Any = None, loop_readouts: str = "final") -> list[dict]:
    """`steps` optimizer steps over shuffled `rows`; returns per-step metrics."""
    rng = random.Random(seed)
    order: list[int] = []
    history = []
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            perm = list(range(len(rows)))
            rng.shuffle(perm)
            order.extend(perm)
        idx, order = order[:batch_size], order[batch_size:]
        batch = make_sft_batch(tokenizer, [format_prompt(rows[i][prompt_key]) for i in idx],
                               [str(rows[i][target_key]) for i in idx])
        t0 = time.perf_counter()
        metrics = learners.sft_step(batch, grad_accum, loop_readouts)
        metrics = {"sft/loss": metrics["loss"], "sft/grad_norm": metrics["grad_norm"], "sft/lr": metrics["lr"],
                   "sft/step_s": time.perf_counter() - t0}
        history.append(metrics)
        if log is not None:
            log(step, metrics)
    return history
