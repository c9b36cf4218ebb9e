"""Supervised fine-tuning: token-mean NLL of the trained tokens (global count), on the DeepSpeed learner group.

The loop reads on one screen: draw a batch of tokenized examples (`rl.sft_data`) in a seeded epoch-wise order,
take one optimizer step, now and then measure the held-out loss and write a checkpoint. The order's state is two
integers, so a resumed run draws exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rl.batch import batch_of_examples
from rl.data import PromptSampler
from rl.sft_data import SFTExample


def noise_seeds(seed: int, step: int, n: int) -> torch.Tensor:
    """Per-row seeds of a training batch's noise (a masked-diffusion model's masking, `noise_seed` batch extra):
    fixed by the run's seed, the step and the row, so a row is noised the same on any rank or micro-batch and in
    a resumed run. Causal families ignore them."""
    return (seed * 1_000_003 + step) * 65_536 + torch.arange(n)


def eval_loss(learners: Any, examples: list[SFTExample], pad_id: int, batch_size: int) -> float:
    """Token-mean NLL of the trained tokens of `examples` under the current weights (forward only); for a
    masked-diffusion model the MDLM loss under the same noise at every evaluation (seeded by example index)."""
    total, count = 0.0, 0.0
    for i in range(0, len(examples), batch_size):
        batch = batch_of_examples(examples[i:i + batch_size], pad_id)
        batch.set_extra("noise_seed", -1 - (i + torch.arange(len(batch))))  # apart from every training seed
        logp = learners.compute_logprobs(batch)
        mask = batch.response_mask
        total -= float((logp[:, :mask.shape[1]] * mask).sum())
        count += float(mask.sum())
    return total / max(count, 1.0)


def run_sft(learners: Any, examples: list[SFTExample], *, pad_id: int, steps: int, batch_size: int,
            grad_accum: int, seed: int, log: Callable[[int, dict], None] | None = None,
            loop_readouts: str = "final", eval_examples: list[SFTExample] | None = None, eval_every: int = 0,
            save: Callable[[int, dict], None] | None = None, save_every: int = 0,
            resume: dict | None = None, shuffle: bool = True) -> list[dict]:
    """Optimizer steps `resume["step"] + 1 .. steps` over `examples` (from the start without `resume`, a saved
    `{"step", "sampler"}` state); returns their metrics. `save(step, state)` is called every `save_every` steps
    before the last; `sft/eval_loss` is measured every `eval_every` steps and after the last. `shuffle=False` draws
    the examples in their order (data an ordering stage arranged)."""
    sampler = PromptSampler(len(examples), seed, shuffle)
    start = 0
    if resume is not None:
        start = int(resume["step"])
        sampler.load(resume["sampler"])
    history = []
    for step in range(start + 1, steps + 1):
        batch = batch_of_examples([examples[i] for i in sampler.next(batch_size)], pad_id)
        batch.set_extra("noise_seed", noise_seeds(seed, step, len(batch)))
        t0 = time.perf_counter()
        out = learners.sft_step(batch, grad_accum, loop_readouts)
        metrics = {"sft/loss": out["loss"], "sft/grad_norm": out["grad_norm"], "sft/lr": out["lr"],
                   "sft/step_s": time.perf_counter() - t0, "sft/tokens": float(batch.response_mask.sum()),
                   "sft/epoch": sampler.epoch + sampler.pos / len(examples),
                   **{f"sft/{k}": v for k, v in out.items() if k.startswith("zo/")}}
        if eval_examples and (step == steps or (eval_every and step % eval_every == 0)):
            metrics["sft/eval_loss"] = eval_loss(learners, eval_examples, pad_id, batch_size)
        history.append(metrics)
        if log is not None:
            log(step, metrics)
        if save is not None and save_every and step % save_every == 0 and step < steps:
            save(step, {"step": step, "sampler": sampler.state()})
    return history
