"""RLTT: Reward Latent Thought Trajectories, for looped language models (Ouro).

A looped model reads out a next-token distribution after every loop t = 1..T. RLTT credits the whole
latent trajectory: the per-token log-probability in the policy gradient is a weighted sum over loops,

    ℓ_ij = Σ_t ω_ijt · log P^(t)(y_ij | x, y_i<j)        (logits divided by the rollout temperature)
    L    = agg(−Â_i · ℓ_ij) + β · agg(k3(ref, final loop))

REINFORCE (no ratio, no clipping) with the GRPO group-normalised advantage Â, KL on the final loop only
against the frozen reference, `token-mean` aggregation over the whole batch as in the released verl
actor (`agg` switches to a per-sequence mean). GRPO on a looped model is the same with ω one-hot on the
last loop (`loop_weighting: last`). Spec: rl/methods/rltt/README.md.

Loop weightings ω: `uniform` 1/T; `progressive` t^α / Σ_s s^α; `exit_pdf` the model's own per-token
stick-breaking exit distribution (gradient flows into the exit gate unless `detach_exit_pdf`, default
False as in the released code); `learned` softmax(θ/τ) of a learnable `[T]` vector; `last` one-hot T.
"""

from __future__ import annotations

import torch

from rl.losses import LossParameter, masked_mean, regularise_and_aggregate
from rl.registry import register

LOOP_WEIGHTINGS = ("uniform", "progressive", "exit_pdf", "learned", "last")


def compute_loop_weights(weighting: str, num_loops: int, *, alpha: float = 1.0,
                         exit_pdf: torch.Tensor | None = None, detach_exit_pdf: bool = False,
                         learned_logits: torch.Tensor | None = None, tau: float = 1.0) -> torch.Tensor:
    """ω over loops: `[T]` for the fixed and learned weightings, `[..., T]` (per token) for `exit_pdf`."""
    if weighting == "uniform":
        return torch.full((num_loops,), 1.0 / num_loops)
    if weighting == "progressive":
        w = torch.arange(1, num_loops + 1, dtype=torch.float64) ** alpha
        return (w / w.sum()).float()
    if weighting == "last":
        return torch.nn.functional.one_hot(torch.tensor(num_loops - 1), num_loops).float()
    if weighting == "exit_pdf":
        if exit_pdf is None:
            raise ValueError("loop_weighting=exit_pdf needs the model's exit pdf (a looped model such as Ouro)")
        return exit_pdf.detach() if detach_exit_pdf else exit_pdf
    if weighting == "learned":
        if learned_logits is None:
            raise ValueError("loop_weighting=learned needs the learnable loop logits")
        return torch.softmax(learned_logits / tau, dim=-1)
    raise ValueError(f"unknown loop_weighting {weighting!r}; choose one of {LOOP_WEIGHTINGS}")


@register("loss", "rltt")
def rltt_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
              *, loop_logp: torch.Tensor, exit_pdf: torch.Tensor | None = None,
              learned_logits: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None, loop_weighting: str = "exit_pdf", alpha: float = 1.0,
              detach_exit_pdf: bool = False, tau: float = 1.0, learned_init: str = "uniform",
              learned_lr_scale: float = 10.0, kl_coef: float = 0.0, kl_estimator: str = "k3",
              entropy_coef: float = 0.0, agg: str = "token-mean", num_tokens: float | None = None,
              num_seqs: float | None = None, norm_len: float | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """RLTT loss from per-loop sampled-token logprobs `loop_logp [N, L, T]` (the learner supplies them,
    and `logp` = the final loop's). `old_logp` is unused: RLTT has no importance ratio.

    `learned_init` (uniform | progressive) and `learned_lr_scale` (× the model lr) configure the learnable
    loop logits of `loop_weighting: learned` (`rltt_trainable_parameters`); the learner passes them in as
    `learned_logits`. `kl_coef` defaults to 0 like every loss: the trainer passes `algorithm.kl_coef` (0.001 in
    the released recipes) when the KL is in the loss and 0 when it is in the reward or absent."""
    num_loops = loop_logp.shape[-1]
    omega = compute_loop_weights(loop_weighting, num_loops, alpha=alpha, exit_pdf=exit_pdf,
                                 detach_exit_pdf=detach_exit_pdf, learned_logits=learned_logits, tau=tau)
    omega = omega.to(device=loop_logp.device, dtype=loop_logp.dtype)
    trajectory_logp = (omega * loop_logp).sum(-1)
    pg = -advantages * trajectory_logp
    final = loop_logp[..., -1]
    loss, metrics = regularise_and_aggregate(
        pg, final, response_mask.to(final.dtype), ref_logp=ref_logp, entropy=entropy, kl_coef=kl_coef,
        kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs,
        norm_len=norm_len)
    with torch.no_grad():
        mask = response_mask.to(final.dtype)
        mean_omega = omega if omega.dim() == 1 else (omega * mask[..., None]).sum((0, 1)) / mask.sum().clamp(min=1)
        for t in range(num_loops):
            metrics[f"loop_weight_{t + 1}"] = float(mean_omega[t])
            metrics[f"loop_logp_{t + 1}"] = float(masked_mean(loop_logp[..., t], mask))
    return loss, metrics


def rltt_trainable_parameters(outputs: dict[str, torch.Tensor], *, loop_weighting: str = "exit_pdf",
                              learned_init: str = "uniform", alpha: float = 1.0, learned_lr_scale: float = 10.0,
                              **_: object) -> dict[str, LossParameter]:
    """RLTT's learnable loop-weight logits θ_w `[T]` (ω = softmax(θ_w/τ)) for `loop_weighting: learned`:
    initialised to zeros (uniform) or log(progressive(α)) centred, with `learned_lr_scale` × the model lr
    and no weight decay (rl/methods/rltt/README.md). None for the other weightings."""
    if loop_weighting != "learned":
        return {}
    if learned_init not in ("uniform", "progressive"):
        raise ValueError(f"algorithm.loss_params.learned_init must be uniform or progressive, got {learned_init!r}")
    w = compute_loop_weights(learned_init, outputs["loop_logp"].shape[-1], alpha=alpha)
    return {"learned_logits": LossParameter(torch.log(w) - torch.log(w).mean(), lr_scale=learned_lr_scale)}


rltt_loss.trainable_parameters = rltt_trainable_parameters
