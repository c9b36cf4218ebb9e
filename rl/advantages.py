"""Advantage estimators, registered under kind "advantage".

Contract: `fn(rewards [N], group_id [N] int64, response_mask [N, L], **params) -> [N, L]`.
Outcome advantages are broadcast to every response token and zeroed on masked tokens.
"""

from __future__ import annotations

import torch

from rl.registry import register


def group_stats(rewards: torch.Tensor, group_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased (n-1) group std and group size.

    A group of one has std 0 (not NaN): its advantage is then 0 under every estimator here.
    """
    uniq, inverse = torch.unique(group_id, return_inverse=True)
    r = rewards.to(torch.float64)
    count = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / count
    sq = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
    return mean[inverse], var.sqrt()[inverse], count[inverse]


@register("advantage", "grpo")
def compute_grpo_advantages(rewards: torch.Tensor, group_id: torch.Tensor, response_mask: torch.Tensor,
                            eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO outcome advantage `(R - mean_g R) / (std_g R + eps)`, broadcast over response tokens.

    Conventions (as verl's `grpo` estimator): std is the unbiased (n-1) group std, `eps` is added
    to the std (not under the square root), a group of one and an all-equal group get advantage 0.
    `norm_by_std=False` gives Dr.GRPO's mean-only centring.
    """
    mean, std, _ = group_stats(rewards, group_id)
    adv = rewards.to(torch.float64) - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return (adv.to(torch.float32).unsqueeze(-1) * response_mask).to(torch.float32)


def distillation_advantages(advantages: torch.Tensor, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                            response_mask: torch.Tensor, coef: float = 1.0, reward_weight: float = 1.0
                            ) -> torch.Tensor:
    """On-policy distillation: `reward_weight * A + coef * (log pi_teacher(y_t) - log pi_student(y_t))` on each
    response token. The second term is minus the one-sample estimate of the reverse KL `KL(student || teacher)` at
    the token the student sampled, used as that token's own advantage (discount 0), as on-policy distillation does
    (TRL's GKD with student-generated data and beta = 1, prime-rl's teacher logprobs): the policy gradient of these
    advantages is the gradient of the per-token reverse KL, so the student moves toward the teacher on the text it
    writes itself. `advantages` is the reward's `[N, L]` (or `[N, 1]`) advantage."""
    gap = (teacher_logp - student_logp) * response_mask
    return (reward_weight * advantages * response_mask + coef * gap).to(torch.float32)


@register("advantage", "dr_grpo")
def compute_dr_grpo_advantages(rewards: torch.Tensor, group_id: torch.Tensor, response_mask: torch.Tensor,
                               ) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025): `R - mean_g R`, no std division (pair it with
    `loss_agg: seq-mean-token-sum-norm` for the paper's constant length normaliser)."""
    return compute_grpo_advantages(rewards, group_id, response_mask, norm_by_std=False)


@register("advantage", "rloo")
def compute_rloo_advantages(rewards: torch.Tensor, group_id: torch.Tensor, response_mask: torch.Tensor,
                            ) -> torch.Tensor:
    """RLOO: `R_i - mean_{j != i} R_j` (leave-one-out baseline) = `n/(n-1) (R_i - mean_g)`; a group of one gets 0."""
    mean, _, count = group_stats(rewards, group_id)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    adv = (rewards.to(torch.float64) - mean) * scale
    return adv.to(torch.float32).unsqueeze(-1) * response_mask


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`(x - mean) / sqrt(var + eps)` over the masked entries, unbiased variance (verl's convention)."""
    m = mask.to(torch.float64)
    x = values.to(torch.float64)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) ** 2) * m).sum() / (n - 1).clamp(min=1)
    return (((x - mean) * torch.rsqrt(var + eps)) * m).to(torch.float32)


def discounted_outcome_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Returns-to-go when the only reward is `R_i` on the last response token: `gamma^(T-1-t) R_i`."""
    mask = response_mask.to(torch.float64)
    # steps remaining after token t (counting masked-in tokens only)
    remaining = mask.flip(-1).cumsum(-1).flip(-1) - 1
    return (rewards.to(torch.float64).unsqueeze(-1) * gamma ** remaining * mask).to(torch.float32)


@register("advantage", "reinforce_pp")
def compute_reinforce_pp_advantages(rewards: torch.Tensor, group_id: torch.Tensor, response_mask: torch.Tensor,
                                    gamma: float = 1.0, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted returns of the outcome reward, whitened over all valid tokens
    of the batch (no group baseline; `group_id` is unused). A per-token KL penalty, when wanted, goes
    in the reward (`algorithm.kl_in_reward`)."""
    return masked_whiten(discounted_outcome_returns(rewards, response_mask, gamma), response_mask, eps)


@register("advantage", "reinforce_pp_baseline")
def compute_reinforce_pp_baseline_advantages(rewards: torch.Tensor, group_id: torch.Tensor,
                                             response_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean reward, broadcast to tokens, whiten over the batch."""
    mean, _, _ = group_stats(rewards, group_id)
    centred = (rewards.to(torch.float64) - mean).to(torch.float32).unsqueeze(-1) * response_mask
    return masked_whiten(centred, response_mask, eps)


@register("advantage", "grpo_passk")
def compute_grpo_passk_advantages(rewards: torch.Tensor, group_id: torch.Tensor, response_mask: torch.Tensor,
                                  eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """Pass@k-aware GRPO (as verl's `grpo_passk`): only the best sample of each group is credited, with
    `(R_max - R_second) / (std_g + eps)`; every other sample gets 0. A group of one gets 0."""
    _, std, _ = group_stats(rewards, group_id)
    adv = torch.zeros(len(rewards), dtype=torch.float64)
    for g in torch.unique(group_id):
        idx = (group_id == g).nonzero(as_tuple=True)[0]
        if len(idx) < 2:
            continue
        vals, order = rewards[idx].to(torch.float64).sort(descending=True)
        gap = vals[0] - vals[1]
        adv[idx[order[0]]] = gap / (std[idx[0]] + eps) if norm_by_std else gap
    return adv.to(torch.float32).unsqueeze(-1) * response_mask


def gae_advantages_and_returns(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                               gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (Schulman et al. 2016).

    `delta_t = r_t + gamma V_{t+1} - V_t`, `A_t = delta_t + gamma lam A_{t+1}`, `returns = A + V`. Positions
    outside `response_mask` (padding, tool-output tokens) are skipped: the recursion carries the next
    counted token's value and advantage across them, and past the last token the value is 0 (terminal).
    With gamma = lam = 1, `A_t = sum_{k>=t} r_k - V_t` (returns minus values).
    """
    mask = response_mask.to(torch.float64)
    r, v = token_rewards.to(torch.float64) * mask, values.to(torch.float64) * mask
    N, L = r.shape
    adv = torch.zeros(N, L, dtype=torch.float64)
    next_value = torch.zeros(N, dtype=torch.float64)
    next_adv = torch.zeros(N, dtype=torch.float64)
    for t in reversed(range(L)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        m = mask[:, t]
        adv[:, t] = a * m
        next_value = v[:, t] * m + next_value * (1 - m)
        next_adv = a * m + next_adv * (1 - m)
    returns = (adv + v) * mask
    return adv.to(torch.float32), returns.to(torch.float32)


def outcome_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """`[N, L]` token rewards with each sample's outcome reward on its last counted token."""
    mask = response_mask.to(torch.float32)
    idx = torch.arange(mask.shape[1], dtype=torch.float32)
    last = (mask * (idx + 1)).argmax(-1)  # the last counted position (0 for an empty mask)
    out = torch.zeros_like(mask)
    out[torch.arange(len(rewards)), last] = rewards.to(torch.float32)
    return out * mask


@register("advantage", "gae")
def compute_gae_advantages(rewards: torch.Tensor, group_id: torch.Tensor, response_mask: torch.Tensor, *,
                           values: torch.Tensor, token_rewards: torch.Tensor | None = None, gamma: float = 1.0,
                           lam: float = 0.95, whiten: bool = True) -> torch.Tensor:
    """PPO's advantage from a value model (`values [N, L]`, a batch extra the critic fills): GAE over token
    rewards — `token_rewards` when given (outcome on the last token minus a per-token KL penalty), else the
    outcome reward on each sample's last token — whitened over the batch's tokens (`whiten`, as verl/OpenRLHF)."""
    if token_rewards is None:
        token_rewards = outcome_token_rewards(rewards, response_mask)
    adv, _ = gae_advantages_and_returns(token_rewards, values, response_mask, gamma, lam)
    return masked_whiten(adv, response_mask) if whiten else adv
