"""Policy losses, KL estimators and loss aggregation, registered under kind "loss".

Contract: `fn(logp, old_logp, advantages, response_mask, *, ref_logp=None, **params) -> (loss, metrics)`.
All tensors are `[N, L]`. `num_tokens` / `num_seqs` are the *global* counts over the optimizer
step (all ranks, all micro-batches): the learner passes them so that summing the per-micro-batch
losses gives the loss of the whole batch, whatever the data-parallel size or micro-batching.

Beyond the contract a loss receives, by naming them as keyword parameters: the model family's extra
outputs (`loop_logp`, `exit_pdf` for looped models; see `models/families.py`), Batch fields and extras
(`rl.batch.NAMED_FIELDS`), and its own trainable parameters. A loss declares those with a
`trainable_parameters` attribute: `fn(outputs, **loss_params) -> {name: LossParameter}`, called once with
the family outputs of the first micro-batch. The learner keeps them beside the model (replicated on every
rank, gradients averaged over ranks), steps them with their own AdamW (`lr_scale` × the model lr, no weight
decay) and saves them with the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.registry import register

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")

# Keywords the learner passes to every loss itself (a recipe's loss_params may not set them).
LOSS_INPUTS = ("logp", "old_logp", "advantages", "response_mask", "ref_logp", "entropy", "agg", "num_tokens",
               "num_seqs", "norm_len", "kl_coef", "kl_estimator", "entropy_coef")


@dataclass
class LossParameter:
    """A trainable tensor that a loss owns (not part of the model): its initial value and its learning
    rate as a multiple of the model's."""
    init: torch.Tensor
    lr_scale: float = 1.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from sampled-token logprobs.

    k1 = logp - ref (unbiased, high variance); k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1
    (Schulman's low-variance estimator, always >= 0, verl's `low_var_kl` without clamping).
    """
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        return torch.exp(-diff) - (-diff) - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


def kl_in_reward(rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor,
                 coef: float, estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a reward penalty: `R_i - coef * sum_t KL_it` over the response tokens (verl's
    `use_kl_in_reward` with an outcome reward). Returns (penalised rewards [N], per-sequence KL [N]).
    `logp` are the behaviour (rollout or old) logprobs; no gradient flows through this term."""
    seq_kl = (kl_penalty(logp, ref_logp, estimator) * response_mask).sum(-1)
    return rewards - coef * seq_kl, seq_kl


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to `max_len - buffer` tokens, then a linear ramp down to
    `-factor` at `max_len` (and beyond)."""
    start = max_len - buffer
    over = (lengths.to(torch.float32) - start).clamp(min=0.0)
    return -factor * (over / max(buffer, 1)).clamp(max=1.0)


IS_LEVELS = ("none", "token", "sequence")
IS_MODES = ("truncate", "mask")


def rollout_importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
                               level: str = "token", mode: str = "truncate", cap: float = 2.0
                               ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Importance weights that correct for the rollout engine sampling from a slightly different policy
    than the learner's `old_logp` (numerics of another engine, or an older policy version under
    asynchronous rollout); detached, `[N, L]`, zero outside the mask, or None for `level="none"`.

    token: w_t = pi_old(y_t) / pi_rollout(y_t); sequence: one weight per sequence, the product over its
    response tokens. `truncate` caps weights at `cap` (truncated IS, Yao et al. 2025, verl's TIS, TRL's
    `*_truncate`); `mask` zeroes weights above `cap` (TRL's `*_mask`). The metrics measure the mismatch
    whatever the level: `mismatch_kl` is the k3 estimate of KL(pi_rollout || pi_old) per token and
    `mismatch_abs_diff` the mean |old - rollout| logprob gap.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; choose one of {IS_LEVELS}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; choose one of {IS_MODES}")
    if cap <= 0:
        raise ValueError(f"importance-sampling cap must be > 0, got {cap}")
    with torch.no_grad():
        mask = response_mask.to(old_logp.dtype)
        log_ratio = (old_logp - rollout_logp) * mask
        metrics = {"mismatch_kl": float(masked_mean(kl_penalty(rollout_logp, old_logp, "k3"), mask)),
                   "mismatch_abs_diff": float(masked_mean(log_ratio.abs(), mask))}
        if level == "none":
            return None, metrics
        if level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        log_ratio = log_ratio.clamp(max=20.0)  # exp stays finite; anything this large is capped anyway
        over = log_ratio > torch.log(torch.tensor(cap, dtype=log_ratio.dtype))
        weights = torch.exp(log_ratio)
        weights = torch.where(over, torch.full_like(weights, cap) if mode == "truncate" else torch.zeros_like(weights),
                              weights) * mask
        metrics["is_weight_mean"] = float(masked_mean(weights, mask))
        metrics["is_capped_frac"] = float(masked_mean(over.to(mask.dtype), mask))
    return weights, metrics


def aggregate_loss(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
                   num_tokens: float | None = None, num_seqs: float | None = None,
                   norm_len: float | None = None) -> torch.Tensor:
    """Reduce per-token `values [N, L]` to a scalar.

    token-mean: sum(v·m) / num_tokens, each token weighs the same (verl/DAPO default).
    seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO).
    seq-mean-token-sum-norm: sum(v·m) / (num_seqs · norm_len), a constant length normaliser
      (Dr.GRPO); `norm_len` defaults to the padded response width L.
    `num_tokens` / `num_seqs` default to this batch's counts; pass global counts so that
    sums over shards equal the full-batch value. Fully masked sequences are not counted.
    """
    mask = mask.to(values.dtype)
    tok_per_seq = mask.sum(-1)
    if num_seqs is None:
        num_seqs = float((tok_per_seq > 0).sum())
    if mode == "token-mean":
        denom = float(mask.sum()) if num_tokens is None else num_tokens
        return (values * mask).sum() / max(denom, 1.0)
    if mode == "seq-mean-token-mean":
        seq_mean = (values * mask).sum(-1) / tok_per_seq.clamp(min=1.0)
        return seq_mean.sum() / max(num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        length = float(values.shape[-1]) if norm_len is None else norm_len
        return (values * mask).sum() / (max(num_seqs, 1.0) * length)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGG_MODES}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def regularise_and_aggregate(pg: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, *,
                              ref_logp: torch.Tensor | None, entropy: torch.Tensor | None, kl_coef: float,
                              kl_estimator: str, entropy_coef: float, agg: str, num_tokens: float | None,
                              num_seqs: float | None, norm_len: float | None
                              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Add the KL-to-reference and entropy terms to the per-token policy loss `pg`, then aggregate.

    Shared by every policy loss so that KL placement and aggregation mean the same thing everywhere.
    """
    per_token = pg
    metrics: dict[str, float] = {}
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 in the loss needs reference logprobs (ref_logp)")
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        per_token = per_token + kl_coef * kl
        metrics["kl"] = float(masked_mean(kl.detach(), mask))
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs per-token entropy")
        per_token = per_token - entropy_coef * entropy
    loss = aggregate_loss(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        metrics["pg_loss"] = float(aggregate_loss(pg, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                                                  norm_len=norm_len))
    return loss, metrics


@register("loss", "ppo_clip")
def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, *, ref_logp: torch.Tensor | None = None,
                  entropy: torch.Tensor | None = None, eps_low: float = 0.2, eps_high: float = 0.2,
                  dual_clip: float | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                  entropy_coef: float = 0.0, agg: str = "token-mean", num_tokens: float | None = None,
                  num_seqs: float | None = None, norm_len: float | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with separate low/high clip (DAPO clip-higher) and optional dual-clip.

    per-token: max(-A·r, -A·clip(r, 1-eps_low, 1+eps_high)); with `dual_clip = c > 1`, tokens with
    A < 0 are further capped at -A·c (Ye et al. 2020). `kl_coef > 0` adds a KL-to-reference term
    (`kl_estimator`) to the loss; `entropy_coef > 0` subtracts an entropy bonus. All three terms use
    the same aggregation `agg`.
    """
    mask = response_mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * dual_clip), pg)
    loss, metrics = regularise_and_aggregate(
        pg, logp, mask, ref_logp=ref_logp, entropy=entropy, kl_coef=kl_coef, kl_estimator=kl_estimator,
        entropy_coef=entropy_coef, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        clipped = ((pg_clipped > pg_unclipped) & (mask > 0)).to(logp.dtype)
        metrics["clipfrac"] = float(clipped.sum() / mask.sum().clamp(min=1.0))
        metrics["approx_kl_old"] = float(masked_mean(0.5 * log_ratio.square(), mask))
        metrics["ratio_mean"] = float(masked_mean(ratio, mask))
    return loss, metrics


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`log s_i = mean_t (logp - old_logp)` over each sequence's response tokens, `[N, 1]` (GSPO's anchor)."""
    m = mask.to(logp.dtype)
    return ((logp - old_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


@register("loss", "gspo")
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
              *, ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
              eps_low: float = 3e-4, eps_high: float = 4e-4, kl_coef: float = 0.0, kl_estimator: str = "k3",
              entropy_coef: float = 0.0, agg: str = "seq-mean-token-mean", num_tokens: float | None = None,
              num_seqs: float | None = None, norm_len: float | None = None, token_level: bool = False
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): PPO clipping on the sequence ratio `s_i = exp(mean_t log r_it)`.

    Defaults follow the paper: eps 3e-4 / 4e-4 (sequence ratios stay near 1) and
    `seq-mean-token-mean` aggregation, so each sequence weighs the same. With `token_level=True`
    (registered as `gspo_token`) the ratio of token t is `sg[s_i] * exp(logp_t - sg[logp_t])`: the same
    value, but each token's gradient is its own, which allows per-token advantages.
    """
    mask = response_mask.to(logp.dtype)
    log_s = sequence_log_ratio(logp, old_logp, mask).clamp(-20.0, 20.0)
    if token_level:
        ratio = torch.exp(log_s.detach() + logp - logp.detach())
    else:
        ratio = torch.exp(log_s).expand_as(logp)
    pg, clipped = clipped_surrogate(ratio, advantages, eps_low, eps_high)
    loss, metrics = regularise_and_aggregate(
        pg, logp, mask, ref_logp=ref_logp, entropy=entropy, kl_coef=kl_coef, kl_estimator=kl_estimator,
        entropy_coef=entropy_coef, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        metrics["clipfrac"] = float((clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0))
        seqs = mask.sum(-1) > 0
        metrics["seq_ratio_mean"] = float(torch.exp(log_s.squeeze(-1))[seqs].mean()) if seqs.any() else 1.0
    return loss, metrics


@register("loss", "gspo_token")
def gspo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, **params) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token: sequence-anchored ratio with per-token gradients (see `gspo_loss`)."""
    return gspo_loss(logp, old_logp, advantages, response_mask, token_level=True, **params)


@register("loss", "cispo")
def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
               *, ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
               eps_low: float = 1.0, eps_high: float = 0.28, kl_coef: float = 0.0, kl_estimator: str = "k3",
               entropy_coef: float = 0.0, agg: str = "token-mean", num_tokens: float | None = None,
               num_seqs: float | None = None, norm_len: float | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight,
    `-sg[clip(r, 1-eps_low, 1+eps_high)] * A * logp`. Unlike PPO no token loses its gradient;
    the weight is only bounded. The paper bounds it from above only: `eps_low = 1.0` (lower bound 0)."""
    mask = response_mask.to(logp.dtype)
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0)).detach()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = -weight * advantages * logp
    loss, metrics = regularise_and_aggregate(
        pg, logp, mask, ref_logp=ref_logp, entropy=entropy, kl_coef=kl_coef, kl_estimator=kl_estimator,
        entropy_coef=entropy_coef, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        metrics["clipfrac"] = float(((weight != ratio).to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0))
        metrics["ratio_mean"] = float(masked_mean(ratio, mask))
    return loss, metrics


@register("loss", "value_clip")
def value_clip_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                    response_mask: torch.Tensor, *, clip: float = 0.2, agg: str = "token-mean",
                    num_tokens: float | None = None, num_seqs: float | None = None,
                    norm_len: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's clipped value loss (PPO): `0.5 max((V - R)^2, (clip(V, V_old ± clip) - R)^2)`,
    aggregated like the policy loss (global counts). `clip <= 0` disables clipping."""
    mask = response_mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip > 0:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clip_frac = float(masked_mean((clipped > unclipped).to(mask.dtype), mask))
    else:
        per_token, clip_frac = 0.5 * unclipped, 0.0
    loss = aggregate_loss(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    return loss, {"value_clip_frac": clip_frac, "values_mean": float(masked_mean(values.detach(), mask))}


@register("loss", "bradley_terry")
def bradley_terry_loss(scores: torch.Tensor, response_mask: torch.Tensor, *, num_seqs: float | None = None,
                       margin: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Pairwise reward-model loss `-log sigmoid(r_chosen - r_rejected - margin)`, averaged over the global
    number of pairs. Rows come in pairs: chosen at even, rejected at odd positions (`num_seqs` rows in all)."""
    if scores.shape[0] % 2:
        raise ValueError(f"bradley_terry: rows must come in (chosen, rejected) pairs, got {scores.shape[0]} rows")
    diff = scores[0::2] - scores[1::2]
    pairs = (num_seqs if num_seqs is not None else scores.shape[0]) / 2
    loss = -torch.nn.functional.logsigmoid(diff - margin).sum() / max(pairs, 1.0)
    return loss, {"pair_accuracy": float((diff > 0).float().mean()), "margin_mean": float(diff.mean())}
