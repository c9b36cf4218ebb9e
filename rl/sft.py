"""Supervised warm-up stage: token-mean NLL of target tokens, trained on the DeepSpeed learner group."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from rl.batch import Batch


def make_sft_batch(tokenizer: Any, prompts: list[str], targets: list[str]) -> Batch:
    """Prompt (left-padded) + target + EOS (right-padded); the loss covers target and EOS."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    tgt = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in targets]
    width = max(len(t) for t in tgt)
    resp = torch.full((len(tgt), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(tgt), width))
    for i, t in enumerate(tgt):
        resp[i, :len(t)] = torch.tensor(t)
        mask[i, :len(t)] = 1.0
    return Batch(prompt_ids=enc["input_ids"], prompt_mask=enc["attention_mask"], response_ids=resp,
                 response_mask=mask, response_attn=mask.long(), group_id=torch.arange(len(tgt)))


def run_sft(learners: Any, tokenizer: Any, rows: list[dict], *, prompt_key: str, target_key: str,
            steps: int, batch_size: int, grad_accum: int, seed: int,
            format_prompt: Any, log: Any = None) -> list[dict]:
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
        metrics = learners.sft_step(batch, grad_accum)
        metrics = {"sft/loss": metrics["loss"], "sft/grad_norm": metrics["grad_norm"], "sft/lr": metrics["lr"],
                   "sft/step_s": time.perf_counter() - t0}
        history.append(metrics)
        if log is not None:
            log(step, metrics)
    return history
