"""TGPO (Trust-Gated Policy Optimization): each token's clipped surrogate weighted by a trust gate on its deviation
from the sequence's anchor ratio, and each negative-advantage trajectory by a trust score, so imperfect trajectories
are kept, down-weighted. [RECONSTRUCTION: no primary source could be read; see README.md in this folder.]"""

from __future__ import annotations

import torch

from rl.losses import clipped_surrogate, masked_mean, regularise_and_aggregate, sequence_log_ratio
from rl.registry import register


def tgpo_gate(delta: torch.Tensor, gate: str, tau: float, kappa: float) -> torch.Tensor:
    """Trust gate on a token's deviation `delta` from its sequence anchor: `gauss` exp(-(delta/tau)^2)
    or `band` sigmoid((kappa - |delta|)/tau) / sigmoid(kappa/tau). The band gate is divided by its value at
    delta = 0 [RECONSTRUCTION: the spec's band is sigmoid((kappa - |delta|)/tau), 0.88 at delta = 0 with the
    defaults], so that both gates are 1 on the anchor and TGPO is GRPO/GSPO on policy with either."""
    if gate == "gauss":
        return torch.exp(-(delta / tau) ** 2)
    if gate == "band":
        return torch.sigmoid((kappa - delta.abs()) / tau) / torch.sigmoid(torch.tensor(kappa / tau, dtype=delta.dtype))
    raise ValueError(f"tgpo gate must be gauss or band, got {gate!r}")


@register("loss", "tgpo")
def tgpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
              *, ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
              anchor: str = "geo_mean", gate: str = "gauss", tau: float = 0.1, kappa: float = 0.2,
              trust: str = "gate_mean", w_min: float = 0.1, eps_low: float = 3e-4, eps_high: float = 4e-4,
              h_min: float = 0.0, gate_floor: float = 0.0, step_verified_frac: torch.Tensor | None = None,
              kl_coef: float = 0.0,
              kl_estimator: str = "k3", entropy_coef: float = 0.0, agg: str = "seq-mean-token-mean",
              num_tokens: float | None = None, num_seqs: float | None = None, norm_len: float | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Trust-Gated Policy Optimization. [RECONSTRUCTION: no primary source could be read; this follows
    rl/methods/tgpo/README.md exactly and every knob is a recipe parameter.]

    anchor `geo_mean`: sequence ratio `s_i = exp(mean_t rho_it)`, token ratio `r_it = sg[s_i] exp(logp - sg[logp])`
      (GSPO-token); anchor `token`: `r_it = exp(rho_it)` (GRPO's ratio).
    gate: `gamma_it = max(gate(sg[rho_it - log s_i]), gate_floor)` (`gauss` or `band`, both 1 at delta = 0),
      times `1[H_it >= h_min]` when h_min > 0.
    trust: `w_i = 1` for A_i > 0, else `clip(mean_t gamma_it, w_min, 1)` (`gate_mean`) or
      `clip(step_verified_frac_i, w_min, 1)` (`step_frac`: the fraction of the sample's steps with a positive
      step reward, from the step data a multi-step environment or a process reward records), so imperfect
      trajectories are kept, down-weighted.
    per token: `w_i * gamma_it * max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`, aggregated (default
      seq-mean-token-mean, the spec's 1/G sum_i 1/|y_i| sum_t).

    Limitation of the spec's formula (`gate_floor: 0`, the default): the retention property (rl/methods/tgpo/README.md item 4, a
    drifting negative trajectory keeps a bounded, non-zero gradient scaled by w_min) holds while some of its
    tokens stay near the anchor; when every token drifts, every gate underflows to 0 and so does the gradient,
    whatever w_min. `gate_floor > 0` keeps that share of every token's gradient, so the property holds always.
    """
    mask = response_mask.to(logp.dtype)
    ratio, delta = anchored_ratio(logp, old_logp, mask, anchor)
    gamma = tgpo_gate(delta, gate, tau, kappa).clamp(min=gate_floor)
    if h_min > 0:
        if entropy is None:
            raise ValueError("tgpo h_min > 0 needs per-token entropy")
        gamma = gamma * (entropy.detach() >= h_min).to(gamma.dtype)
    seq_adv = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    score = trust_score(gamma, mask, trust, step_verified_frac)
    w = torch.where(seq_adv > 0, torch.ones_like(score), score.clamp(w_min, 1.0)).detach()
    pg, clipped = clipped_surrogate(ratio, advantages, eps_low, eps_high)
    pg = w.unsqueeze(-1) * gamma * pg
    loss, metrics = regularise_and_aggregate(
        pg, logp, mask, ref_logp=ref_logp, entropy=entropy, kl_coef=kl_coef, kl_estimator=kl_estimator,
        entropy_coef=entropy_coef, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        metrics["clipfrac"] = float((clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0))
        metrics["gate_mean"] = float(masked_mean(gamma, mask))
        metrics["trust_mean"] = float(w.mean())
    return loss, metrics


def anchored_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, anchor: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ratio and each token's (detached) deviation from its sequence anchor: `geo_mean`, GSPO-token's
    `sg[s_i] exp(logp - sg[logp])` with s_i the geometric mean ratio; `token`, GRPO's own ratio (deviation 0)."""
    rho = logp - old_logp
    if anchor == "geo_mean":
        log_s = sequence_log_ratio(logp, old_logp, mask).clamp(-20.0, 20.0)
        return torch.exp(log_s.detach() + logp - logp.detach()), (rho - log_s).detach()
    if anchor == "token":
        return torch.exp(rho.clamp(-20.0, 20.0)), torch.zeros_like(rho)
    raise ValueError(f"tgpo anchor must be geo_mean or token, got {anchor!r}")


def trust_score(gamma: torch.Tensor, mask: torch.Tensor, trust: str, step_verified_frac: torch.Tensor | None
                ) -> torch.Tensor:
    """Per sample, how far a negative-advantage trajectory is trusted (before clipping to [w_min, 1]): the mean
    gate over its tokens (`gate_mean`) or the share of its steps with a positive step reward (`step_frac`)."""
    if trust == "gate_mean":
        return (gamma * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    if trust == "step_frac":
        if step_verified_frac is None:
            raise ValueError("tgpo trust=step_frac needs step_verified_frac (the fraction of each sample's steps "
                             "with a positive step reward); this batch carries no step rewards: use an environment "
                             "(rollout.env) or a process reward that records steps, or trust: gate_mean")
        return step_verified_frac.to(gamma.dtype)
    raise ValueError(f"tgpo trust must be gate_mean or step_frac, got {trust!r}")
