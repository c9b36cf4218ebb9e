"""The algorithm of an RL step, resolved from the recipe once: Ray-free, it sees batches, never actors.

`RLAlgorithm` says which logprob passes the learners must run (old policy, reference, critic values), turns
scored samples into advantages (the KL to the reference in the reward when `algorithm.kl_in_reward`, the registered
estimator, the critic's GAE targets), cuts the update into seeded mini-batches, and holds the policy loss's name and
arguments. The trainer (`rl.loop.trainer`) runs the actor system around it: rollout, reward, learner passes, weight
sync.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig

from rl.advantages import distillation_advantages, gae_advantages_and_returns, outcome_token_rewards
from rl.batch import Batch
from rl.losses import kl_in_reward, kl_penalty
from rl.recipe import as_container, needs_critic, policy_loss_params
from rl.registry import lookup
from rl.step import estimate_advantages, step_verified_fraction


class RLAlgorithm:
    """The recipe's `algorithm` section (and the parts of `rollout`, `reward` and `critic` the step's maths reads),
    with its estimator and loss looked up and their signatures read once."""

    def __init__(self, cfg: DictConfig):
        a, r = cfg.algorithm, cfg.rollout
        self.seed = cfg.seed
        self.kl_coef, self.kl_estimator, self.kl_in_reward = a.kl_coef, a.kl_estimator, a.kl_in_reward
        self.need_ref = a.kl_coef > 0
        self.teacher_path, self.distill_coef, self.distill_reward_weight = (a.teacher_path, a.distill_coef,
                                                                            a.distill_reward_weight)
        self.ppo_epochs, self.mini_batch_count = a.ppo_epochs, a.mini_batches
        self.need_old_logp = a.ppo_epochs * a.mini_batches > 1  # the PPO ratio's denominator after the first update
        self.adv_fn = lookup("advantage", a.advantage)
        self.adv_inputs = inspect.signature(self.adv_fn).parameters
        self.adv_params = as_container(a.advantage_params)
        self.failed_samples = cfg.reward.failed_samples
        self.loss = a.loss
        loss_fn = lookup("loss", a.loss)  # fail now, not after the first rollout
        self.loss_inputs = inspect.signature(loss_fn).parameters
        self.loss_params = policy_loss_params(cfg, loss_fn)  # what the recipe decides, the same every step
        self.rollout_correction = {"level": a.is_correction, "mode": a.is_mode, "cap": a.is_cap}
        # The learner's logprobs are of the distribution the rollout sampled from: temperature, and the
        # top-k / top-p truncation when there is one, so that the PPO ratio, the rollout-correction weights
        # and the mismatch metrics compare one distribution (the rollout engines report processed logprobs).
        self.sampling = {"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p}
        self.critic = needs_critic(cfg)
        self.value_clip, self.critic_warmup_steps = cfg.critic.value_clip, cfg.critic.warmup_steps
        # micro-batches per optimizer step on each learner rank: one mini-batch's samples over ranks and micro-batches
        samples_per_update = cfg.trainer.prompts_per_step * r.n // a.mini_batches
        lc = cfg.learner
        self.grad_accum = max(1, math.ceil(samples_per_update / lc.world_size / lc.micro_batch_size))
        self.total_updates = cfg.trainer.steps * a.ppo_epochs * a.mini_batches  # the scheduler's length

    @property
    def needs_token_rewards(self) -> bool:
        """A critic, or a token-level estimator (GAE), learns from rewards per token."""
        return self.critic or "token_rewards" in self.adv_inputs

    def advantages(self, batch: Batch, metrics: dict[str, float]) -> torch.Tensor | None:
        """`batch.advantages` (and the verified-step fraction a loss may name) from the scored batch and its
        logprob passes; logs `actor/kl`. Returns the per-token rewards when a critic or the estimator uses them."""
        rewards = self.kl_shaped_rewards(batch, metrics)
        token_rewards = self.token_rewards(batch) if self.needs_token_rewards else None
        batch.advantages = estimate_advantages(batch, rewards, token_rewards, self.adv_fn, self.adv_params,
                                               self.failed_samples)
        if self.teacher_path is not None:
            self.distill(batch, metrics)
        if "step_verified_frac" in self.loss_inputs and any(batch.step_rewards):
            batch.set_extra("step_verified_frac", step_verified_fraction(batch.step_rewards))
        return token_rewards

    def distill(self, batch: Batch, metrics: dict[str, float]) -> None:
        """Add the teacher's per-token term to `batch.advantages` (`distillation_advantages`): the student's
        logprobs are the behaviour policy's (old policy's after the first update, else the engine's); logs the
        sampled tokens' mean reverse KL `distill/reverse_kl` (falls as the student nears the teacher)."""
        teacher = batch.extras["teacher_logp"].value
        student = batch.old_logp if batch.old_logp is not None else batch.rollout_logp
        mask = batch.response_mask
        batch.advantages = distillation_advantages(batch.advantages, student, teacher, mask, self.distill_coef,
                                                   self.distill_reward_weight)
        tokens = mask.sum().clamp(min=1)
        metrics["distill/reverse_kl"] = float(((student - teacher) * mask).sum() / tokens)
        metrics["distill/teacher_logp"] = float((teacher * mask).sum() / tokens)

    def kl_shaped_rewards(self, batch: Batch, metrics: dict[str, float]) -> torch.Tensor:
        """The rewards the advantages are computed from: minus the KL to the reference when `kl_in_reward`;
        the behaviour policy's KL is logged either way."""
        rewards = batch.rewards
        if self.need_ref:
            behaviour = batch.old_logp if batch.old_logp is not None else batch.rollout_logp
            penalised, seq_kl = kl_in_reward(rewards, behaviour, batch.ref_logp, batch.response_mask,
                                             self.kl_coef, self.kl_estimator)
            metrics["actor/kl"] = float(seq_kl.sum() / batch.response_mask.sum().clamp(min=1))
            if self.kl_in_reward:
                rewards = penalised
        return rewards

    def token_rewards(self, batch: Batch) -> torch.Tensor:
        """`[N, L]` rewards per token for a token-level estimator (GAE): the outcome on the last token, minus
        `kl_coef` times each token's KL to the reference when the KL is in the reward."""
        out = outcome_token_rewards(batch.rewards, batch.response_mask)
        if self.need_ref and self.kl_in_reward:
            behaviour = batch.old_logp if batch.old_logp is not None else batch.rollout_logp
            out = out - self.kl_coef * kl_penalty(behaviour, batch.ref_logp, self.kl_estimator) * batch.response_mask
        return out

    def critic_targets(self, batch: Batch, token_rewards: torch.Tensor) -> torch.Tensor:
        """The critic's regression targets: GAE returns of the values it gave before the update, set on the batch
        as `returns` beside `old_values` (the clipped value loss reads both). Returns the returns."""
        values = batch.extras["values"].value
        gamma, lam = (self.adv_params.get(k, self.adv_inputs[k].default) for k in ("gamma", "lam"))
        _, returns = gae_advantages_and_returns(token_rewards, values, batch.response_mask, gamma, lam)
        batch.set_extra("old_values", values, pad="right")
        batch.set_extra("returns", returns, pad="right")
        return returns

    def critic_metrics(self, batch: Batch, returns: torch.Tensor, results: list[dict[str, float]]
                       ) -> dict[str, float]:
        """The critic's step metrics (means over its mini-batch updates) and its explained variance."""
        values = batch.extras["values"].value
        mask = batch.response_mask.bool()
        residual_var = float((returns - values)[mask].var())
        out = {f"critic/{k}": sum(r[k] for r in results) / len(results)
               for k in ("loss", "grad_norm", "value_clip_frac", "values_mean")}
        out["critic/explained_variance"] = 1.0 - residual_var / max(float(returns[mask].var()), 1e-8)
        out["critic/returns_mean"] = float(returns[mask].mean())
        return out

    def mini_batches(self, batch: Batch, seed: int) -> Iterator[Batch]:
        """`ppo_epochs` passes over `mini_batches` mini-batches of `batch`, reshuffled each pass (seeded)."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(self.ppo_epochs):
            order = (torch.randperm(len(batch), generator=gen) if self.mini_batch_count > 1
                     else torch.arange(len(batch)))
            yield from batch.select(order).split(self.mini_batch_count)

    def policy_loss_kwargs(self) -> dict[str, Any]:
        """How the learner group's `train_step` runs the policy loss, after the batch and accumulation steps."""
        return {"loss_fn_spec": self.loss, "loss_params": self.loss_params, "need_entropy": True,
                "rollout_correction": self.rollout_correction, **self.sampling}
