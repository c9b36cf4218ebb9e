"""MGPO (Multi-Granularity Policy Optimization), the RL algorithm of Agentic Proposing: the advantage that adds
per-step credit, normalised within step types, to GRPO's trajectory advantage. Its trajectory reward
(`mgpo_trajectory_reward`) is in `reward.py`, which the reward service's processes import without torch."""

from __future__ import annotations

import torch

from rl.advantages import compute_grpo_advantages
from rl.registry import register


@register("advantage", "mgpo")
def compute_mgpo_advantages(rewards: torch.Tensor, group_id: torch.Tensor, response_mask: torch.Tensor, *,
                            token_step: torch.Tensor | None = None, step_rewards: list[list[float]] | None = None,
                            step_types: list[list[str]] | None = None, valid: torch.Tensor | None = None,
                            observation_mask: torch.Tensor | None = None, lambda_step: float = 0.5,
                            eps: float = 1e-6, allow_trajectory_only: bool = False) -> torch.Tensor:
    """Multi-granularity advantages (MGPO, Agentic Proposing) [RECONSTRUCTION, rl/methods/agentic_proposing/README.md].

    token advantage = A_traj_i + lambda_step * A_step_{i,k} for a token in step k, A_traj_i elsewhere, where
      A_traj: GRPO over the group's trajectory rewards (unbiased std, + eps);
      A_step: step rewards normalised over all steps *of the same type* in the same group (unbiased std, + eps;
              a type with one step, or all-equal rewards, gives 0).
    Validity gate: an invalid trajectory (`valid` False) has its trajectory and step rewards zeroed.
    Environment/tool-output tokens (`observation_mask`) get advantage 0. The step data come from the
    Batch (`token_step`, `step_rewards`, `step_types`, `valid`, `observation_mask`), filled by a multi-step
    environment. A batch without `token_step`, `step_rewards` or `valid` is refused: MGPO on it would silently be
    GRPO. `allow_trajectory_only: true` accepts such batches (GRPO on the trajectory rewards, gated by `valid`
    when present). With `lambda_step = 0` it is GRPO on the trajectory rewards.
    """
    missing = [name for name, value in (("token_step", token_step), ("step_rewards", step_rewards), ("valid", valid))
               if value is None]
    if missing and not allow_trajectory_only:
        raise ValueError(f"advantage 'mgpo': the batch carries no {missing}. MGPO needs the step map and step "
                         f"rewards that a multi-step environment (rollout.env) or a process reward records, and the "
                         f"validity verdict a reward returns ({{'score': ..., 'valid': bool}}); without them it "
                         f"would silently be GRPO. Set algorithm.advantage_params.allow_trajectory_only: true to "
                         f"train on trajectory rewards only")
    rewards = rewards.to(torch.float32)
    if valid is not None:
        rewards = torch.where(valid.bool(), rewards, torch.zeros_like(rewards))
    adv = compute_grpo_advantages(rewards, group_id, response_mask, eps=eps)
    if lambda_step and token_step is not None and step_rewards:
        n = len(rewards)
        types = step_types or [["step"] * len(r) for r in step_rewards]
        gated = [[0.0] * len(step_rewards[i]) if valid is not None and not bool(valid[i]) else
                 [float(x) for x in step_rewards[i]] for i in range(n)]
        step_adv: list[list[float]] = [[0.0] * len(r) for r in gated]
        pools: dict[tuple[int, str], list[tuple[int, int]]] = {}
        for i in range(n):
            for k, t in enumerate(types[i]):
                pools.setdefault((int(group_id[i]), t), []).append((i, k))
        for members in pools.values():
            vals = torch.tensor([gated[i][k] for i, k in members], dtype=torch.float64)
            if len(vals) < 2:
                continue
            normed = (vals - vals.mean()) / (vals.std() + eps)
            for (i, k), a in zip(members, normed.tolist()):
                step_adv[i][k] = a
        table = torch.zeros(token_step.shape, dtype=torch.float32)
        for i in range(n):
            for k, a in enumerate(step_adv[i]):
                table[i][token_step[i] == k] = a
        adv = adv + lambda_step * table * response_mask
    if observation_mask is not None:
        adv = adv * (1 - observation_mask.to(adv.dtype))
    return adv
