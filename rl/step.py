"""The Ray-free parts of an RL step on a batch: rewards attached to the samples (with process-reward steps),
length shaping, reward items for the reward service, advantages, episode and reward-component metrics."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from rl.batch import Batch
from rl.losses import soft_overlong_penalty


def apply_length_shaping(batch: Batch, a: Any, max_new_tokens: int) -> None:
    """Loss masking and length shaping (in place): environment/tool-output tokens leave the loss; DAPO
    overlong handling optionally masks truncated completions and adds the soft overlong penalty."""
    if a.overlong_buffer > 0:
        lengths = batch.response_attn.sum(-1)
        batch.rewards = batch.rewards + soft_overlong_penalty(lengths, max_new_tokens, a.overlong_buffer,
                                                              a.overlong_penalty)
    if batch.observation_mask is not None:  # environment/tool-output tokens are never trained on
        batch.response_mask = batch.response_mask * (1 - batch.observation_mask.to(batch.response_mask.dtype))
    if a.mask_truncated and bool(batch.truncated.any()):
        batch.response_mask = batch.response_mask * (~batch.truncated).unsqueeze(1).to(batch.response_mask.dtype)


def reward_items(batch: Batch) -> list[dict]:
    """Reward-service rows; `truncated` (the response hit max_new_tokens) reaches plugins as a column."""
    truncated = batch.truncated.tolist() if batch.truncated is not None else [False] * len(batch.prompts)
    return [{"prompt": p, "response": r, "ground_truth": g, "metadata": m, "truncated": bool(t)}
            for p, r, g, m, t in zip(batch.prompts, batch.responses, batch.ground_truth, batch.metadata, truncated)]


def episode_metrics(batch: Batch) -> dict[str, float]:
    """Multi-turn episodes (`rollout.env`): turns per episode, failed turns, share of observation tokens."""
    if not batch.step_types:
        return {}
    obs = float(batch.observation_mask.sum()) if batch.observation_mask is not None else 0.0
    return {"env/turns_mean": sum(len(t) for t in batch.step_types) / len(batch),
            "env/failed_turns": float(sum(m.get("failed_turns", 0) for m in batch.metadata)),
            "env/observation_token_frac": obs / max(1.0, float(batch.response_attn.sum()))}


def component_means(components: list[dict[str, float]]) -> dict[str, float]:
    """Mean of every reward component over the samples that have it (a function that failed or did not
    apply to a sample leaves no component there)."""
    means = {}
    for name in sorted({k for c in components for k in c}):
        vals = [c[name] for c in components if name in c]
        means[name] = sum(vals) / len(vals)
    return means


def attach_rewards(batch: Batch, scored: list[dict], tokenizer: Any = None, failed_leave_loss: bool = True) -> None:
    """The reward service's scores into `batch`; a process reward's steps (`steps`: rewards and the character
    offset where each step ends) become `step_rewards` and the `token_step` map (`step_spans`); a validity
    verdict (`valid`, a reward returning `{"score": ..., "valid": bool}`) becomes `batch.valid`."""
    batch.rewards = torch.tensor([s["score"] for s in scored], dtype=torch.float32)
    if tokenizer is not None and any("steps" in s for s in scored) and batch.token_step is None:
        batch.step_rewards = [s.get("steps", {}).get("rewards", []) for s in scored]
        batch.token_step = step_spans(batch, [s.get("steps", {}).get("ends", []) for s in scored], tokenizer)
    if any("valid" in s for s in scored):  # a validity verdict (MGPO's gate); a row no function judged is valid
        batch.valid = torch.tensor([bool(s.get("valid", True)) for s in scored])
    batch.reward_failed = torch.tensor([bool(s["failed"]) for s in scored])
    batch.reward_components = [dict(s["components"]) for s in scored]
    # A sample whose reward could not be computed carries no learning signal: it leaves the loss (unless
    # reward.failed_samples: train scores it failure_reward like any sample).
    if failed_leave_loss and bool(batch.reward_failed.any()):
        batch.response_mask = batch.response_mask * (~batch.reward_failed).unsqueeze(1).to(batch.response_mask.dtype)
    for m, s in zip(batch.metadata, scored):
        if s["failed"]:
            m["reward_error"] = s["error"]


def step_spans(batch: Batch, ends: list[list[int]], tokenizer: Any) -> torch.Tensor:
    """`token_step [N, L]`: the step each generated token belongs to, from the character offsets where the
    steps of each response end (a token belongs to the first step whose end it has not passed; tokens
    after the last end, EOS included, belong to the last step; -1 past the response)."""
    attn = batch.response_attn if batch.response_attn is not None else batch.response_mask
    out = torch.full(batch.response_ids.shape, -1, dtype=torch.long)
    for i, row_ends in enumerate(ends):
        if not row_ends:
            continue
        n = int(attn[i].sum())
        ids = batch.response_ids[i, :n].tolist()
        step = 0
        for t in range(n):
            out[i, t] = step
            text_len = len(tokenizer.decode(ids[:t + 1], skip_special_tokens=True))
            while step < len(row_ends) - 1 and text_len >= row_ends[step]:
                step += 1
    return out


def estimate_advantages(batch: Batch, rewards: torch.Tensor, token_rewards: torch.Tensor | None, adv_fn: Any,
                        params: dict[str, Any], failed_samples: str = "exclude") -> torch.Tensor:
    """`adv_fn`'s advantages for `batch`. With `failed_samples: exclude` a sample whose reward failed takes no
    part: the estimator sees the other rows only (its group's mean, std or leave-one-out baseline are those of
    the scored samples) and the failed row's advantage is 0 (it has left the loss too). With `train` its
    `failure_reward` counts like any score."""
    failed = batch.reward_failed
    rows = torch.arange(len(batch))
    if failed_samples == "exclude" and failed is not None and bool(failed.any()):
        rows = (~failed).nonzero().squeeze(1)
    if len(rows) == 0:
        return torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    sub = batch if len(rows) == len(batch) else batch.select(rows)
    inputs = sub.named_fields(adv_fn)
    if "token_rewards" in inspect.signature(adv_fn).parameters:
        inputs["token_rewards"] = token_rewards[rows]
    adv = adv_fn(rewards[rows], sub.group_id, sub.response_mask, **inputs, **params)
    if sub is batch:
        return adv
    out = torch.zeros((len(batch), *adv.shape[1:]), dtype=adv.dtype)
    out[rows] = adv
    return out


def step_verified_fraction(step_rewards: list[list[float]]) -> torch.Tensor:
    """`[N]`: the share of each sample's steps with a positive step reward (a tool call that ran and was used, a
    verified reflection); 0 for a sample without steps (nothing verified). TGPO's `trust: step_frac`."""
    return torch.tensor([sum(r > 0 for r in rows) / len(rows) if rows else 0.0 for rows in step_rewards])


def group_fraction(batch: Batch, pred) -> float:
    ids = torch.unique(batch.group_id)
    return sum(bool(pred(batch.rewards[batch.group_id == g])) for g in ids) / max(1, len(ids))


def split_informative(batch: Batch) -> tuple[list[int], list[int], int]:
    """The rows of groups whose rewards differ (they carry a signal), the rows of the other groups, and the
    number of informative groups (DAPO's dynamic sampling keeps the first)."""
    informative = {g for g in torch.unique(batch.group_id).tolist()
                   if batch.rewards[batch.group_id == g].unique().numel() > 1}
    rows = [i for i in range(len(batch)) if int(batch.group_id[i]) in informative]
    rest = [i for i in range(len(batch)) if int(batch.group_id[i]) not in informative]
    return rows, rest, len(informative)


def bound_token_staleness(batch: Batch, version: int, max_staleness: int) -> dict[str, float]:
    """With in-flight weight updates each response token carries the policy version that sampled it (batch extra
    `token_version`): a token more than `max_staleness` versions behind `version` (the policy being trained) leaves
    the loss. Returns the share of tokens sampled by weights newer than their row's first token's, the tokens'
    mean age in versions and how many left the loss; nothing without per-token versions."""
    if "token_version" not in batch.extras:
        return {}
    versions = batch.extras["token_version"].value[:, :batch.response_mask.shape[1]]
    mask = batch.response_mask > 0
    age = (version - versions).float()
    stale = mask & (age > max_staleness)
    if bool(stale.any()):
        batch.response_mask = batch.response_mask.masked_fill(stale, 0.0)
    tokens = mask.sum().clamp(min=1)
    return {"rollout/in_flight_token_frac": float((mask & (versions > versions[:, :1])).sum() / tokens),
            "rollout/token_staleness_mean": float(age[mask].sum() / tokens),
            "rollout/stale_tokens_dropped": float(stale.sum())}
