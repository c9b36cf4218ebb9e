"""The RL loop: rollout → reward → logprobs → advantages → DeepSpeed update → weight sync.

One `RLTrainer.step()` is the whole algorithm; the roles it drives (rollout workers, reward
service, learner group) are Ray actors placed by `cluster.ray_utils.make_placement`.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import DictConfig

from cluster.learner import LearnerGroup
from cluster.ray_utils import Placement, actor_env, unfinished
from rl.advantages import gae_advantages_and_returns, outcome_token_rewards
from rl.batch import Batch
from rl.config import as_container
from rl.data import format_prompt
from rl.losses import kl_in_reward, kl_penalty, soft_overlong_penalty
from rl.recipe import model_family, needs_critic, policy_loss_params
from rl.registry import get
from rl.validation import check_weight_sync
from rollout.probes import best_rates
from rollout.worker import RolloutWorker, RolloutWorkerRestarted, RolloutWorkerStuck


@dataclass
class PendingRollout:
    """A submitted generation: the step it is for, the rollout workers' ObjectRefs, and the prompt
    sampler's state before its prompts were drawn (what a checkpoint must store to redraw them)."""
    step: int
    refs: list[Any]
    sampler_state: dict[str, int]
    resubmit: Callable[[], list[Any]]  # the same prompts and seeds again (after a rollout worker died)


class RLTrainer:
    def __init__(self, cfg: DictConfig, model_path: str, tokenizer: Any, train_rows: list[dict],
                 placement: Placement, reward_service: Any):
        check_weight_sync(cfg.rollout.weight_sync, bool(placement.gpus_per_actor),
                          cfg.cluster.placement == "colocated")
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.rows = train_rows
        self.placement = placement
        self.rewards = reward_service
        self.out = Path(cfg.output_dir)
        self.step_idx = 0
        ps = cfg.trainer.prompt_sampler
        self.sampler = get("sampler", ps.name)(train_rows, cfg.seed, **as_container(ps.params))
        a, lc = cfg.algorithm, cfg.learner
        self.need_ref = a.kl_coef > 0
        self.samples_per_update = cfg.trainer.prompts_per_step * cfg.rollout.n // a.mini_batches
        self.grad_accum = max(1, math.ceil(self.samples_per_update / lc.world_size / lc.micro_batch_size))
        # The learner's logprobs are of the distribution the rollout sampled from: temperature, and the
        # top-k / top-p truncation when there is one, so that the PPO ratio, the rollout-correction weights
        # and the mismatch metrics compare one distribution (the rollout engines report processed logprobs).
        r = cfg.rollout
        self.sampling_distribution = {"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p}
        self.adv_fn = get("advantage", a.advantage)
        self.adv_params = inspect.signature(self.adv_fn).parameters
        loss_fn = get("loss", a.loss)  # fail now, not after the first rollout
        self.loss_inputs = inspect.signature(loss_fn).parameters
        self.loss_params = policy_loss_params(cfg, loss_fn)  # what the recipe decides, the same every step
        self._start_roles()
        self.hardware = self._measure_hardware()
        # At start-up another process may still share the cores (Ray's own agents start beside the roles): a run
        # of 3+ synchronous steps measures the ceilings again after its first step and keeps the better ones.
        self.ceilings_to_check = cfg.trainer.steps >= 3 and cfg.trainer.max_staleness == 0
        self.pending: list[PendingRollout] = []  # submitted rollouts, oldest first
        self.next_submit = 0  # first step whose rollout is not submitted yet
        self.pending_loads: list[Any] = []  # weight loads not yet waited for (max_staleness > 0)
        self.rollout_restarts = 0  # rollouts regenerated because a rollout worker died
        self.sync_bytes: float | None = None  # bytes one weight sync sends (logged as rollout/sync_bytes)
        if cfg.rollout.weight_sync == "collective":
            self._init_collective_sync()

    def _start_roles(self) -> None:
        """The learner group (and critic), then the rollout workers. They start side by side (model loading and
        imports overlap); with offloading, the engines start only once the learner's states have left the
        device, so that they see the free memory."""
        cfg, a, lc = self.cfg, self.cfg.algorithm, self.cfg.learner
        together = not lc.offload_between_phases
        self.learners = make_learner_group(
            cfg, self.model_path, self.placement, lr=lc.lr, weight_decay=lc.weight_decay,
            micro_batch_size=lc.micro_batch_size, grad_accum=self.grad_accum, with_ref=self.need_ref,
            scheduler=lc.scheduler, warmup_steps=lc.warmup_steps,
            total_steps=cfg.trainer.steps * a.ppo_epochs * a.mini_batches, wait=not together)
        self.critic = (make_critic_group(cfg, self.model_path, self.placement, self.grad_accum, wait=not together)
                       if needs_critic(cfg) else None)
        # colocated roles take turns on one device: the learner's states wait in host memory while the
        # engines generate, the engines sleep while the learner computes
        self.swap_phases = cfg.rollout.sleep_between_phases or lc.offload_between_phases
        if lc.offload_between_phases:
            self.learners.offload_states()
        self.rollout = make_rollout_workers(cfg, self.model_path, self.placement, wait=not together)
        if together:
            for group in (self.learners, self.critic):
                if group is not None:
                    group.wait_ready()
            ray.get([w.pid.remote() for w in self.rollout])

    def _measure_hardware(self) -> dict[str, dict[str, float]]:
        """What perf/mfu and perf/mbu divide by: the model's size and each role's measured ceilings, measured once
        every role has started (a reward worker still importing would share the cores)."""
        cfg = self.cfg
        ray.get(self.rewards.wait_started.remote())
        return {"model": ray.get(self.learners.workers[0].model_numbers.remote()),
                "learner": ceilings(self.learners.workers[0], cfg.model.dtype, cfg.learner.threads),
                "rollout": ceilings(self.rollout[0], cfg.model.dtype, cfg.rollout.threads)}

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, float]:
        """One RL step: rollout → rewards → logprobs → advantages → policy update → weight sync."""
        a = self.cfg.algorithm
        t_start, timing = time.perf_counter(), {}
        if self.swap_phases:  # colocated roles take turns: the learner's states wait in host memory
            self.learners.offload_states()
        batch, metrics = self.collect(timing)  # generate and score (dynamic sampling tops up)
        if self.swap_phases:
            with _timer(timing, "swap"):
                ray.get([w.sleep.remote() for w in self.rollout])
                self.learners.reload_states()
        with _timer(timing, "logprobs"):
            if a.ppo_epochs * a.mini_batches > 1:  # the PPO ratio's denominator after the first update
                batch.old_logp = self.learners.compute_logprobs(batch, "policy", **self.sampling_distribution)
            if self.need_ref:
                batch.ref_logp = self.learners.compute_logprobs(batch, "ref", **self.sampling_distribution)
            if self.critic is not None:
                batch.set_extra("values", self.critic.compute_logprobs(batch, output="values"), pad="right")
        rewards = self.kl_shaped_rewards(batch, metrics)
        token_rewards = self.token_rewards(batch) if self.critic is not None or "token_rewards" in self.adv_params \
            else None
        batch.advantages = self.advantages(batch, rewards, token_rewards)
        if "step_verified_frac" in self.loss_inputs and any(batch.step_rewards):
            batch.set_extra("step_verified_frac", step_verified_fraction(batch.step_rewards))
        with _timer(timing, "train"):
            if self.critic is not None:
                metrics.update(self.update_critic(batch, token_rewards))
            warming_up = self.critic is not None and self.step_idx < self.cfg.critic.warmup_steps
            train_metrics = [] if warming_up else self.update(batch)
        self.step_idx += 1
        with _timer(timing, "sync"):
            if self.swap_phases:  # weights first: the new ones go straight in
                ray.get([w.wake.remote(["weights"]) for w in self.rollout])
            # the engines' load time (with max_staleness > 0: of the previous update, loaded in the background)
            metrics["rollout/weight_load_s"] = self.sync_weights()
            if self.cfg.rollout.weight_sync != "cuda_ipc":  # what one sync sent (the adapter's tensors alone with one)
                if self.sync_bytes is None:  # the same every step: asked once, so pipelined syncs never wait on it
                    self.sync_bytes = float(ray.get(self.learners.workers[0].last_sync_bytes.remote()))
                metrics["rollout/sync_bytes"] = self.sync_bytes
        if self.swap_phases:  # the KV cache comes back after the learner has left the device
            metrics["memory/learner_gpu_gib_loaded"] = self.learners.gpu_memory_gib()
            with _timer(timing, "swap"):
                self.learners.offload_states()
                metrics["memory/learner_gpu_gib_offloaded"] = self.learners.gpu_memory_gib()
                ray.get([w.wake.remote(["kv_cache"]) for w in self.rollout])
        return self.step_metrics(batch, metrics, train_metrics, timing, time.perf_counter() - t_start)

    def advantages(self, batch: Batch, rewards: torch.Tensor, token_rewards: torch.Tensor | None) -> torch.Tensor:
        return estimate_advantages(batch, rewards, token_rewards, self.adv_fn,
                                   as_container(self.cfg.algorithm.advantage_params), self.cfg.reward.failed_samples)

    def kl_shaped_rewards(self, batch: Batch, metrics: dict[str, float]) -> torch.Tensor:
        """The rewards the advantages are computed from: minus the KL to the reference when `kl_in_reward`;
        the behaviour policy's KL is logged either way."""
        a, rewards = self.cfg.algorithm, batch.rewards
        if self.need_ref:
            behaviour = batch.old_logp if batch.old_logp is not None else batch.rollout_logp
            penalised, seq_kl = kl_in_reward(rewards, behaviour, batch.ref_logp, batch.response_mask,
                                             a.kl_coef, a.kl_estimator)
            metrics["actor/kl"] = float(seq_kl.sum() / batch.response_mask.sum().clamp(min=1))
            if a.kl_in_reward:
                rewards = penalised
        return rewards

    def token_rewards(self, batch: Batch) -> torch.Tensor:
        """`[N, L]` rewards per token for a token-level estimator (GAE): the outcome on the last token, minus
        `kl_coef` times each token's KL to the reference when the KL is in the reward."""
        a = self.cfg.algorithm
        out = outcome_token_rewards(batch.rewards, batch.response_mask)
        if self.need_ref and a.kl_in_reward:
            behaviour = batch.old_logp if batch.old_logp is not None else batch.rollout_logp
            out = out - a.kl_coef * kl_penalty(behaviour, batch.ref_logp, a.kl_estimator) * batch.response_mask
        return out

    def update_critic(self, batch: Batch, token_rewards: torch.Tensor) -> dict[str, float]:
        """The critic's clipped value regression onto the GAE returns of the values it gave before the update
        (`ppo_epochs` passes over `mini_batches`, as the policy)."""
        a, c = self.cfg.algorithm, self.cfg.critic
        values = batch.extras["values"].value
        gamma, lam = (as_container(a.advantage_params).get(k, self.adv_params[k].default) for k in ("gamma", "lam"))
        _, returns = gae_advantages_and_returns(token_rewards, values, batch.response_mask, gamma, lam)
        batch.set_extra("old_values", values, pad="right")
        batch.set_extra("returns", returns, pad="right")
        results = [self.critic.train_step(mb, self.grad_accum, "value_clip", {"clip": c.value_clip, "agg": "token-mean"})
                   for mb in self.mini_batches(batch, self.cfg.seed * 37 + self.step_idx)]
        mask = batch.response_mask.bool()
        residual_var = float((returns - values)[mask].var())
        out = {f"critic/{k}": sum(r[k] for r in results) / len(results)
               for k in ("loss", "grad_norm", "value_clip_frac", "values_mean")}
        out["critic/explained_variance"] = 1.0 - residual_var / max(float(returns[mask].var()), 1e-8)
        out["critic/returns_mean"] = float(returns[mask].mean())
        return out

    def update(self, batch: Batch) -> list[dict[str, float]]:
        """`ppo_epochs` passes over `mini_batches` shuffled mini-batches, one optimizer step each."""
        cfg, a = self.cfg, self.cfg.algorithm
        correction = {"level": a.is_correction, "mode": a.is_mode, "cap": a.is_cap}
        return [self.learners.train_step(mb, self.grad_accum, a.loss, self.loss_params, need_entropy=True,
                                         rollout_correction=correction, **self.sampling_distribution)
                for mb in self.mini_batches(batch, cfg.seed * 31 + self.step_idx)]

    def mini_batches(self, batch: Batch, seed: int):
        """`ppo_epochs` passes over `mini_batches` mini-batches of `batch`, reshuffled each pass (seeded)."""
        a = self.cfg.algorithm
        gen = torch.Generator().manual_seed(seed)
        for _ in range(a.ppo_epochs):
            order = torch.randperm(len(batch), generator=gen) if a.mini_batches > 1 else torch.arange(len(batch))
            yield from batch.select(order).split(a.mini_batches)

    def step_metrics(self, batch: Batch, metrics: dict[str, float], train_metrics: list[dict[str, float]],
                     timing: dict[str, float], step_s: float) -> dict[str, float]:
        timing["other"] = max(0.0, step_s - sum(timing.values()))
        lengths = batch.response_attn.sum(-1).float()
        n_tokens = float(lengths.sum())
        # With KL in the loss, the loss's own KL (policy being trained vs reference) replaces the
        # behaviour-policy KL measured above.
        for k in train_metrics[0] if train_metrics else ():  # none while only the critic warms up
            metrics[f"actor/{k}"] = sum(m[k] for m in train_metrics) / len(train_metrics)
        metrics.update({
            "reward/mean": float(batch.rewards.mean()), "reward/std": float(batch.rewards.std()),
            "reward/failures": float(batch.reward_failed.sum()),
            "reward/solve_all_frac": float(_group_frac(batch, lambda r: r.min() > 0)),
            "reward/solve_none_frac": float(_group_frac(batch, lambda r: r.max() <= 0)),
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/truncated_frac": float(batch.truncated.float().mean()),
            "perf/step_s": step_s, "perf/tokens": n_tokens, "perf/tokens_per_s": n_tokens / step_s,
            "policy_version": float(self.step_idx), "batch/samples": float(len(batch)),
            "rollout/restarts": float(self.rollout_restarts),
        })
        metrics.update({f"reward/{k}": v for k, v in component_means(batch.reward_components).items()})
        metrics.update(episode_metrics(batch))
        if (engine_s := engine_seconds(batch)) is not None:  # generation itself, overlapped or not
            metrics["rollout/engine_s"] = engine_s
        if self.ceilings_to_check:  # after the first synchronous step, every role idle and warm
            self.ceilings_to_check = False
            dtype = self.cfg.model.dtype
            self.hardware["learner"] = ceilings(self.learners.workers[0], dtype, self.cfg.learner.threads, again=True)
            self.hardware["rollout"] = ceilings(self.rollout[0], dtype, self.cfg.rollout.threads, again=True)
        metrics.update(utilisation(batch, timing, step_s, self.hardware, self.cfg, train_passes=len(train_metrics),
                                   logprob_passes=int(batch.old_logp is not None) + int(batch.ref_logp is not None)))
        for k, v in timing.items():
            metrics[f"time/{k}"] = v
        return metrics

    def collect(self, timing: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """Generate and score `prompts_per_step` groups of `n` samples.

        With `algorithm.dynamic_sampling` (DAPO), groups whose rewards are all equal carry no signal and
        are dropped; more prompts are sampled until the batch is full or `max_sampling_rounds` is reached
        (then the batch is filled up with the dropped groups, so its size never changes).
        """
        cfg, a = self.cfg, self.cfg.algorithm
        n, want = cfg.rollout.n, cfg.trainer.prompts_per_step
        kept: list[Batch] = []
        dropped: list[Batch] = []
        have, rounds, seen, informative_seen = 0, 0, 0, 0
        staleness: list[int] = []
        sampler_metrics: dict[str, float] = {}  # the prompt sampler's, after its last observed batch
        timing["generate"] = timing["reward"] = 0.0
        while have < want and rounds < (a.max_sampling_rounds if a.dynamic_sampling else 1):
            batch = self._generate_round(rounds, timing)
            staleness.append(self.step_idx - batch.policy_version)
            sampler_metrics.update(self._score_round(batch, timing))
            rounds += 1
            seen += want
            if not a.dynamic_sampling:
                kept.append(batch)
                have = want
                break
            informative, rest, groups = split_informative(batch)
            informative_seen += groups
            take = informative[:(want - have) * n]
            if take:
                kept.append(batch.select(take))
                have += len(take) // n
            if rest:
                dropped.append(batch.select(rest))
        if have < want:  # the cap was reached: fill up with uninformative groups (zero advantage)
            kept.append(Batch.concat(dropped).select(list(range((want - have) * n))))
        metrics: dict[str, float] = {"rollout/staleness": float(max(staleness)), **sampler_metrics}
        if a.dynamic_sampling:
            metrics["sampling/rounds"] = float(rounds)
            metrics["sampling/informative_frac"] = informative_seen / max(1, seen)
        return Batch.concat(kept), metrics

    def _generate_round(self, rounds: int, timing: dict[str, float]) -> Batch:
        """The first round's rollout from the pipeline (submitted up to max_staleness steps ago; the next step's
        is submitted so that it overlaps this step's update); a dynamic-sampling top-up, generated now."""
        t0 = time.perf_counter()
        if rounds == 0:
            self._fill_pipeline()
            pending = self.pending.pop(0)
            self._fill_pipeline()
        else:
            pending = self._submit(self.step_idx, rounds)
        batch = self._gather_rollout(pending)
        batch.check_groups(self.cfg.rollout.n)
        timing["generate"] += time.perf_counter() - t0
        return batch

    def _score_round(self, batch: Batch, timing: dict[str, float]) -> dict[str, float]:
        """Rewards and length shaping into `batch`; the prompt sampler's metrics when it adapts to scored
        samples (curriculum)."""
        t0 = time.perf_counter()
        attach_rewards(batch, self.score(batch), self.tokenizer,
                       failed_leave_loss=self.cfg.reward.failed_samples == "exclude")
        apply_length_shaping(batch, self.cfg.algorithm, self.cfg.rollout.max_new_tokens)
        metrics = self.sampler.observe(batch) if hasattr(self.sampler, "observe") else {}
        timing["reward"] += time.perf_counter() - t0
        return metrics

    def score(self, batch: Batch) -> list[dict]:
        """The reward service's scores for `batch`, within `trainer.deadlines.reward_s` (the service itself
        kills and restarts a reward process that stops answering and scores its samples again)."""
        d, r = self.cfg.trainer.deadlines, self.cfg.reward
        limit = d.reward_s or r.timeout_s * -(-len(batch) // max(1, r.num_workers)) * len(r.functions) + 300.0
        try:
            return ray.get(self.rewards.score.remote(reward_items(batch)), timeout=limit)
        except ray.exceptions.GetTimeoutError as exc:
            raise RuntimeError(f"the reward service did not answer within {limit:g} s (trainer.deadlines.reward_s) "
                               f"at step {self.step_idx + 1}; the run stopped") from exc

    # ------------------------------------------------------------------ rollout pipeline
    def _submit(self, step: int, round_: int) -> PendingRollout:
        """Draw the prompts of (`step`, `round_`) and submit their generation; seeds and group ids
        depend only on (step, round), so synchronous and pipelined runs sample the same prompts."""
        cfg, want = self.cfg, self.cfg.trainer.prompts_per_step
        sampler_state = self.sampler.state()
        rows = [self.rows[i] for i in self.sampler.next(want)]

        def submit() -> list[Any]:
            return submit_generation(
                self.rollout, self.tokenizer, cfg, rows, temperature=cfg.rollout.temperature, n=cfg.rollout.n,
                seed=cfg.seed * 1_000_003 + step + 7919 * round_,
                group_base=(step * cfg.algorithm.max_sampling_rounds + round_) * want)
        return PendingRollout(step, submit(), sampler_state, submit)

    def _gather_rollout(self, pending: PendingRollout) -> Batch:
        """The batch of a submitted rollout. A rollout worker that dies meanwhile is restarted by Ray
        (`rollout.max_restarts`); it then gets the current weights and the whole rollout is generated
        again from the same prompts and seeds, so no sample is lost or counted twice."""
        for attempt in range(self.cfg.rollout.max_restarts + 1):
            try:
                self._kill_stuck_rollout_workers(pending.refs, "generate_s",
                                                 f"finish step {pending.step + 1}'s generation")
                return _gather(pending.refs)
            except (ray.exceptions.RayActorError, RolloutWorkerRestarted, RolloutWorkerStuck) as exc:
                if attempt == self.cfg.rollout.max_restarts:
                    raise RuntimeError(f"rollout for step {pending.step + 1} failed {attempt + 1} times; last "
                                       f"error: {exc}") from exc
                print(f"[looprl] a rollout worker died or was stuck during step {pending.step + 1} "
                      f"({type(exc).__name__}: {exc}); regenerating its rollout", flush=True)
                self.rollout_restarts += 1
                self._resync_rollout_workers()
                pending.refs = pending.resubmit()
        raise AssertionError("unreachable")

    def _kill_stuck_rollout_workers(self, refs: list[Any], deadline: str, doing: str) -> None:
        """Wait up to `trainer.deadlines.<deadline>` for `refs` (one per rollout worker, in worker order); a
        worker whose call is not done by then is stuck (alive, not answering): kill it so that Ray restarts it
        and raise `RolloutWorkerStuck`, which the caller recovers from as from a dead worker."""
        limit = self.cfg.trainer.deadlines[deadline]
        stuck = unfinished(refs, limit)
        if stuck:
            for i in stuck:
                ray.kill(self.rollout[i], no_restart=False)
            raise RolloutWorkerStuck(f"rollout worker(s) {stuck} did not {doing} within {limit:g} s "
                                     f"(trainer.deadlines.{deadline}); killed for a restart")

    def _init_collective_sync(self) -> None:
        """Form the weight-sync process group: learner rank 0 and every rollout worker (NCCL when the
        roles have GPUs, else gloo). Formed again after a rollout worker is restarted."""
        host, port = ray.get(self.learners.workers[0].weight_sync_endpoint.remote())
        world = 1 + len(self.rollout)
        backend = "nccl" if self.placement.gpus_per_actor else "gloo"
        senders = [w.init_weight_sync_group.remote(host, port, world, backend) for w in self.learners.workers]
        receivers = [r.init_weight_sync_group.remote(host, port, i + 1, world, backend)
                     for i, r in enumerate(self.rollout)]
        self.sync_meta = ray.get(senders)[0]
        ray.get(receivers)

    def _resync_rollout_workers(self) -> None:
        """Wait until every rollout worker is alive again and give them all the current weights."""
        deadline = time.monotonic() + 600
        for i, w in enumerate(self.rollout):
            while True:
                try:
                    ray.get(w.pid.remote(), timeout=60)
                    break
                except ray.exceptions.ActorDiedError as exc:
                    raise RuntimeError(f"rollout worker {i} is dead and was not restarted (rollout.max_restarts="
                                       f"{self.cfg.rollout.max_restarts} exhausted): {exc}") from exc
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as exc:
                    if time.monotonic() > deadline:  # still restarting (loading its model) after 10 minutes
                        raise RuntimeError(f"rollout worker {i} did not come back within 600 s: {exc}") from exc
                    time.sleep(0.5)
        state = self.learners.workers[0].weights_for_sync.remote()
        ray.get([w.load_weights.remote(state, self.step_idx) for w in self.rollout])
        if self.cfg.rollout.weight_sync == "collective":  # the restarted worker left the old group
            self._init_collective_sync()

    def _fill_pipeline(self) -> None:
        """Keep the rollouts of steps `step_idx .. step_idx + max_staleness` submitted (never past the
        last step). With max_staleness k, the rollout of step t+k is generated by the weights of step t."""
        last = min(self.step_idx + self.cfg.trainer.max_staleness, self.cfg.trainer.steps - 1)
        self.next_submit = max(self.next_submit, self.step_idx)
        while self.next_submit <= last:
            self.pending.append(self._submit(self.next_submit, 0))
            self.next_submit += 1

    def sync_weights(self) -> float:
        """Learner rank 0's full weights (ZeRO-3 gathers first) into every rollout engine.

        Synchronous runs wait for the rollout engines to load them and return the longest load time.
        With max_staleness > 0 the loads are queued behind the in-flight generations (each rollout
        worker runs its calls in order) and this returns at once; their times are read on the next call.
        """
        if self.cfg.rollout.weight_sync == "collective":
            bucket = self.cfg.rollout.sync_bucket_mb << 20
            sends = [w.broadcast_weights.remote(bucket) for w in self.learners.workers]
            loads = [r.receive_weights.remote(self.step_idx, self.sync_meta, bucket) for r in self.rollout]
            self.learners.get_all(sends, "the weight broadcast")
            self._kill_stuck_rollout_workers(loads, "sync_s", "load the weights")
            return max(ray.get(loads))
        if self.cfg.rollout.weight_sync == "cuda_ipc":  # rollout worker i reads learner rank i's GPU buckets
            bucket, keep = self.cfg.rollout.sync_bucket_mb << 20, self.cfg.trainer.max_staleness + 1
            refs = [w.share_weights_ipc.remote(bucket, keep) for w in self.learners.workers]
            loads = [r.load_weights_ipc.remote(refs[i], self.step_idx) for i, r in enumerate(self.rollout)]
        else:
            refs = [w.weights_for_sync.remote() for w in self.learners.workers]
            state = refs[0]  # an ObjectRef: moves actor-to-actor without passing through the driver
            loads = [r.load_weights.remote(state, self.step_idx) for r in self.rollout]
        if self.cfg.trainer.max_staleness == 0:
            ray.get(refs[1:])
            try:
                self._kill_stuck_rollout_workers(loads, "sync_s", "load the weights")
                return max(ray.get(loads))
            except (ray.exceptions.RayActorError, RolloutWorkerStuck):  # restart it with these weights
                self._resync_rollout_workers()
                return 0.0
        done, self.pending_loads = self.pending_loads, loads + refs[1:]
        times = []
        for ref in done:
            try:
                t = ray.get(ref)
            except ray.exceptions.RayActorError:  # a rollout worker died: recovered when its rollout is gathered
                continue
            if isinstance(t, float):
                times.append(t)
        return max(times) if times else 0.0

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        ckpt = self.out / "checkpoints" / f"step_{self.step_idx}"
        if ckpt.exists():
            shutil.rmtree(ckpt)
        # prompts already submitted for later steps are drawn again after a resume
        sampler = self.pending[0].sampler_state if self.pending else self.sampler.state()
        state = {"step": self.step_idx, "sampler": sampler,
                 "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
        self.learners.save_checkpoint(str(ckpt), state)
        if self.critic is not None:
            self.critic.save_checkpoint(str(ckpt / "critic"), {})
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": self.step_idx, "sampler": sampler}))
        (ckpt / "COMPLETE").write_text("")
        prune_checkpoints(self.out / "checkpoints", self.cfg.trainer.keep_checkpoints)
        return ckpt

    def load_checkpoint(self, ckpt: Path) -> None:
        state = self.learners.load_checkpoint(str(ckpt))
        if self.critic is not None:
            self.critic.load_checkpoint(str(ckpt / "critic"))
        self.step_idx = int(state["step"])
        self.sampler.load(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.sync_weights()

    def restore(self, ckpt: Path) -> None:
        """Checkpoint `ckpt` into the live run after its last step (the checkpoint `trainer.select_by` chose), in
        the learners and the rollout engines, with the phases in the state a step leaves them in."""
        if self.swap_phases:  # as in a step: the engines sleep while the learner is on the device
            ray.get([w.sleep.remote() for w in self.rollout])
            self.learners.reload_states()
            ray.get([w.wake.remote(["weights"]) for w in self.rollout])
        self.load_checkpoint(ckpt)
        if self.swap_phases:
            self.learners.offload_states()
            ray.get([w.wake.remote(["kv_cache"]) for w in self.rollout])

    def _ask_learners_and_rollout(self, method: str) -> dict[str, Any]:
        """`method()` of every learner rank and rollout worker, keyed learner0.., rollout0.."""
        roles = {"learner": self.learners.workers, "rollout": self.rollout}
        refs = {f"{role}{i}": getattr(w, method).remote() for role, ws in roles.items() for i, w in enumerate(ws)}
        return dict(zip(refs, ray.get(list(refs.values()))))

    def peak_memory(self) -> dict[str, float]:
        """Peak resident memory (GiB) of every actor of the run and of the driver."""
        from rollout.probes import peak_rss_gib
        out = self._ask_learners_and_rollout("peak_rss_gib")
        out["reward_service"] = ray.get(self.rewards.peak_rss_gib.remote())
        out["driver"] = peak_rss_gib()
        return out

    def actor_nodes(self) -> dict[str, str]:
        """The Ray node id each learner rank and rollout worker runs on."""
        return self._ask_learners_and_rollout("node_id")

    def close(self) -> None:
        self.learners.shutdown()
        if self.critic is not None:
            self.critic.shutdown()
        for w in self.rollout:
            ray.kill(w)


# ---------------------------------------------------------------------- helpers shared with other stages
# The ceilings measured in this driver process, by (node, dtype, threads per actor): a node's matmul and copy rates
# do not change between the runs of one process (the stages of a pipeline, a test session), and measuring them costs
# about a second per role and run, in which nothing else may run.
_CEILINGS: dict[tuple[str, str, int], dict[str, float]] = {}


def ceilings(actor: Any, dtype: str, threads: int, again: bool = False) -> dict[str, float]:
    """The hardware rates that `perf/mfu` and `perf/mbu` divide by (`rollout.probes.hardware_rates`) for a role whose
    first actor is `actor`: measured by that actor, unless one with the same `threads` on the same node measured
    them in `dtype` earlier in this process. `again` measures anew and keeps each rate's best (a ceiling)."""
    key = (ray.get(actor.node_id.remote()), dtype, threads)
    if key in _CEILINGS and not again:
        return _CEILINGS[key]
    _CEILINGS[key] = best_rates(ray.get(actor.hardware_rates.remote(dtype, again=again)), _CEILINGS.get(key))
    return _CEILINGS[key]


def make_learner_group(cfg: DictConfig, model_path: str, placement: Placement, *, lr: float, weight_decay: float,
                       micro_batch_size: int, grad_accum: int, scheduler: Any, warmup_steps: int, total_steps: int,
                       with_ref: bool = False, family: str | None = None, wait: bool = True) -> LearnerGroup:
    """A DeepSpeed learner group on the placement's learner bundles; stage-specific optimisation
    settings are arguments, everything else comes from the recipe's `learner`/`model` sections (`family`:
    another model family than the policy's, e.g. a reward model's `sequence_score`)."""
    lc = cfg.learner
    return LearnerGroup(
        lc.world_size, model_path, placement_group=placement.group, bundle_indices=placement.learner_bundles,
        num_cpus=lc.num_cpus, num_gpus=placement.gpus_per_actor, env=actor_env(),
        lr=lr, weight_decay=weight_decay, optimizer=as_container(lc.optimizer), scheduler=as_container(scheduler),
        family=family or model_family(cfg, model_path), zero_stage=lc.zero_stage, micro_batch_size=micro_batch_size,
        grad_accum=grad_accum, grad_clip=lc.grad_clip, dtype=cfg.model.dtype, backend=lc.backend, with_ref=with_ref,
        warmup_steps=warmup_steps, total_steps=total_steps, gradient_checkpointing=cfg.model.gradient_checkpointing,
        seed=cfg.seed, threads=lc.threads, trust_remote_code=cfg.model.trust_remote_code,
        offload_between_phases=lc.offload_between_phases, pack_sequences=lc.pack_sequences,
        deadline_s=cfg.trainer.deadlines.learner_s,
        logprob_chunk_tokens=lc.logprob_chunk_tokens, max_tokens_per_micro_batch=lc.max_tokens_per_micro_batch,
        attn_implementation=lc.attn_implementation,
        adapter=as_container(lc.adapter) if lc.adapter and family is None else None,  # the policy's adapter
        share_prompts=lc.share_prompts and family is None,
        compile_position_wise=lc.compile_position_wise and family is None, wait=wait)


def make_critic_group(cfg: DictConfig, model_path: str, placement: Placement, grad_accum: int,
                      wait: bool = True) -> LearnerGroup:
    """The value model's DeepSpeed group, on the learner bundles beside the policy's ranks (they take turns)."""
    lc, c = cfg.learner, cfg.critic
    return LearnerGroup(
        lc.world_size, c.model_path or model_path, placement_group=placement.group,
        bundle_indices=placement.learner_bundles, num_cpus=0, num_gpus=placement.gpus_per_actor, env=actor_env(),
        lr=c.lr, weight_decay=lc.weight_decay, optimizer=as_container(lc.optimizer), family="value",
        zero_stage=lc.zero_stage, micro_batch_size=lc.micro_batch_size, grad_accum=grad_accum, grad_clip=c.grad_clip,
        dtype=cfg.model.dtype, backend=lc.backend, total_steps=cfg.trainer.steps * cfg.algorithm.ppo_epochs
        * cfg.algorithm.mini_batches, gradient_checkpointing=cfg.model.gradient_checkpointing, seed=cfg.seed,
        threads=lc.threads, trust_remote_code=cfg.model.trust_remote_code, pack_sequences=lc.pack_sequences,
        deadline_s=cfg.trainer.deadlines.learner_s, max_tokens_per_micro_batch=lc.max_tokens_per_micro_batch,
        attn_implementation=lc.attn_implementation, wait=wait)


def adapter_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The rollout engine's share of `learner.adapter`: the engines hold the base model wrapped with the same
    adapter, and the weight sync sends the adapter's tensors alone."""
    return {"adapter": as_container(cfg.learner.adapter)} if cfg.learner.adapter else {}


def make_rollout_workers(cfg: DictConfig, model_path: str, placement: Placement, wait: bool = True) -> list[Any]:
    """One rollout worker per rollout bundle; `wait=False` returns while they still start (wait on `pid`)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    cls = ray.remote(RolloutWorker)
    workers = []
    # vLLM must be built with sleep mode to free its memory between phases
    sleep_kwargs = {"enable_sleep_mode": True} if cfg.rollout.sleep_between_phases and cfg.rollout.engine == "vllm" else {}
    for b in placement.rollout_bundles:
        opts: dict[str, Any] = {"num_cpus": cfg.rollout.num_cpus, "runtime_env": {"env_vars": actor_env()},
                                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                    placement_group=placement.group, placement_group_bundle_index=b)}
        if placement.gpus_per_actor:
            opts["num_gpus"] = placement.gpus_per_actor
        # restarted by Ray if its process dies; the trainer then resends the weights and regenerates
        opts["max_restarts"] = cfg.rollout.max_restarts
        workers.append(cls.options(**opts).remote(
            cfg.rollout.engine, model_path, threads=cfg.rollout.threads, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
            batch_size=cfg.rollout.generation_batch_size,
            device="cuda" if placement.gpus_per_actor else "cpu", **{**sleep_kwargs, **adapter_kwargs(cfg),
                                                                     **as_container(cfg.rollout.engine_params)}))
    if wait:
        ray.get([w.pid.remote() for w in workers])
    return workers


def submit_generation(workers: list[Any], tokenizer: Any, cfg: DictConfig, rows: list[dict], *,
                      temperature: float, n: int, seed: int, group_base: int = 0, evaluation: bool = False,
                      sampling_overrides: dict[str, Any] | None = None) -> list[Any]:
    """Spread prompts over the rollout workers without waiting; returns the workers' ObjectRefs
    (`Batch.concat(ray.get(refs))` is the prompt-major batch). Each worker runs its calls in order, so
    a generation submitted before a weight update samples from the weights before it. `evaluation` picks
    the recipe's evaluation decoding method instead of the rollout one; `sampling_overrides` replace sampling
    parameters (top_p, exit_at_step) for an evaluation protocol."""
    d = cfg.data
    prompts = [format_prompt(r[d.prompt_column], tokenizer, d.prompt_prefix, d.chat_template) for r in rows]
    answers = [r.get(d.answer_column) for r in rows]
    k = min(len(workers), len(prompts))
    bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
    futures = []
    for w in range(k):
        lo, hi = bounds[w], bounds[w + 1]
        sampling = {"n": n, "temperature": temperature, "top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k,
                    "max_new_tokens": cfg.rollout.max_new_tokens, "seed": seed * 131 + w,
                    "stop": list(cfg.rollout.stop) or None}
        r = cfg.rollout
        decoding, params = (r.eval_decoding, r.eval_decoding_params) if evaluation else (r.decoding, r.decoding_params)
        if decoding is not None:
            sampling.update(decoding=decoding, decoding_params=as_container(params))
        sampling.update(sampling_overrides or {})
        groups = list(range(group_base + lo, group_base + hi))
        meta = [{"row": group_base + i, **{c: rows[i].get(c) for c in d.metadata_columns}} for i in range(lo, hi)]
        if r.env is not None:  # multi-turn episodes of an environment
            env = {"name": r.env, "params": as_container(r.env_params), "max_turns": r.max_turns,
                   "max_episode_tokens": r.max_episode_tokens, "opponent_path": r.env_opponent_path}
            rows_w = [{**row, "answer": row.get(d.answer_column)} for row in rows[lo:hi]]
            futures.append(workers[w].run_episodes.remote(prompts[lo:hi], rows_w, sampling, groups, env, meta))
        else:
            futures.append(workers[w].generate.remote(prompts[lo:hi], sampling, groups, answers[lo:hi], meta))
    return futures


def generate(workers: list[Any], tokenizer: Any, cfg: DictConfig, rows: list[dict], *, temperature: float,
             n: int, seed: int, group_base: int = 0, evaluation: bool = False,
             sampling_overrides: dict[str, Any] | None = None) -> Batch:
    """Spread prompts over the rollout workers; returns one Batch (prompt-major rows), within
    `trainer.deadlines.generate_s`."""
    refs = submit_generation(workers, tokenizer, cfg, rows, temperature=temperature, n=n, seed=seed,
                             group_base=group_base, evaluation=evaluation, sampling_overrides=sampling_overrides)
    limit = cfg.trainer.deadlines.generate_s
    if unfinished(refs, limit):
        raise TimeoutError(f"generation on the rollout workers did not finish within {limit:g} s "
                           f"(trainer.deadlines.generate_s)")
    return _gather(refs)


def _gather(refs: list[Any]) -> Batch:
    parts = ray.get(refs)
    batch = Batch.concat(parts)
    # a batch mixes the versions of its workers only if they were out of step: keep the oldest
    batch.policy_version = min(p.policy_version for p in parts)
    return batch


def split_informative(batch: Batch) -> tuple[list[int], list[int], int]:
    """The rows of groups whose rewards differ (they carry a signal), the rows of the other groups, and the
    number of informative groups (DAPO's dynamic sampling keeps the first)."""
    informative = {g for g in torch.unique(batch.group_id).tolist()
                   if batch.rewards[batch.group_id == g].unique().numel() > 1}
    rows = [i for i in range(len(batch)) if int(batch.group_id[i]) in informative]
    rest = [i for i in range(len(batch)) if int(batch.group_id[i]) not in informative]
    return rows, rest, len(informative)


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


@contextmanager
def _timer(timing: dict[str, float], key: str):
    """Adds the time spent inside to `timing[key]`."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0


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


def engine_seconds(batch: Batch) -> float | None:
    """Seconds the rollout engines spent generating `batch`, summed over workers (each row carries its share of its
    chunk's decode time, `gen_s`, in its metadata: the `hf` engine reports it); None unless every row does."""
    reported = [m["gen_s"] for m in batch.metadata if isinstance(m, dict) and "gen_s" in m]
    return float(sum(reported)) if reported and len(reported) == len(batch) else None


def cached_reads(batch: Batch) -> float:
    """Cached positions the decode reads for `batch`: each fed token of a row reads its cache, `(r - 1) p + r (r - 1)
    / 2` for a prompt of p and a response of r tokens."""
    lengths = batch.response_attn.sum(-1).tolist()
    prompt_lengths = batch.prompt_mask.sum(-1).tolist()
    return float(sum((r - 1) * p + r * (r - 1) / 2 for p, r in zip(prompt_lengths, lengths) if r > 0))


def utilisation(batch: Batch, timing: dict[str, float], step_s: float, hardware: dict[str, dict[str, float]],
                cfg: DictConfig, train_passes: int, logprob_passes: int) -> dict[str, float]:
    """How close each phase ran to the machine's limits, against ceilings measured in the actors.

    * `perf/mfu`: learner model-FLOPs utilisation, `(6 N T x updates + 2 N T x logprob passes) / (time of the
      train and logprob phases x ranks x matmul FLOP/s)`, N the matmul parameters, T the batch's real tokens
      (an update is one pass over its share: `ppo_epochs` passes of the batch in all).
    * `perf/decode_mfu`: generation's FLOPs (`2 N` per prompt and generated token) over the rollout workers'
      matmul rate during their generation time (as the engines report it); `perf/mbu`: generation's reads of
      the weights (once per decode step; a worker decodes its rows in chunks of `rollout.generation_batch_size`,
      each as many steps as its longest response) and of the KV cache (each fed token of a row reads its
      cached positions: `(r - 1) p + r (r - 1) / 2` for a prompt of p and a response of r tokens), over the
      measured copy bandwidth. Decoding is bound by whichever of the two floors is higher.
    * `perf/floor_s`: the step's floor (learner FLOPs at the full matmul rate plus the binding decode floor)
      and `perf/step_over_floor` the step's time over it. The critic's work is not counted.
    """
    from rl.batch import sequence_tokens
    n, weight_bytes = hardware["model"]["matmul_params"], hardware["model"]["param_bytes"]
    peak_l, peak_r = hardware["learner"]["matmul_flops"], hardware["rollout"]["matmul_flops"]
    bandwidth = hardware["rollout"]["copy_bytes_per_s"]
    ranks, workers = cfg.learner.world_size, cfg.rollout.num_workers
    tokens = float(sum(sequence_tokens(batch)))
    updates = train_passes / max(1, cfg.algorithm.mini_batches)  # passes over the whole batch
    learner_flops = 6 * n * tokens * updates + 2 * n * tokens * logprob_passes
    generated = float(batch.response_attn.sum())
    decode_flops = 2 * n * (generated + float(batch.prompt_mask.sum()))
    lengths = batch.response_attn.sum(-1).tolist()
    per_worker = -(-len(lengths) // workers)
    chunk = cfg.rollout.generation_batch_size
    steps = sum(max(lengths[i:i + chunk]) for w in range(workers)
                for i in range(w * per_worker, min(len(lengths), (w + 1) * per_worker), chunk))
    # all workers' steps (they run in parallel) and every row's reads of its cached keys and values
    decode_bytes = weight_bytes * steps + hardware["model"].get("kv_bytes_per_token", 0.0) * cached_reads(batch)
    learner_s = timing.get("train", 0.0) + timing.get("logprobs", 0.0)
    # the workers' own generation time, which an overlapped rollout hides from the step's `generate` phase; else
    # the phase times the workers
    reported = engine_seconds(batch)
    worker_s = reported if reported is not None else timing.get("generate", 0.0) * workers
    out = {"perf/mfu": learner_flops / max(learner_s * ranks * peak_l, 1e-9) if learner_flops else 0.0,
           "perf/decode_mfu": decode_flops / max(worker_s * peak_r, 1e-9),
           "perf/mbu": decode_bytes / max(worker_s * bandwidth, 1e-9)}
    floor = learner_flops / (ranks * peak_l) + max(decode_flops / (workers * peak_r), decode_bytes / (workers * bandwidth))
    out.update({"perf/floor_s": floor, "perf/step_over_floor": step_s / max(floor, 1e-9),
                "perf/learner_floor_s": learner_flops / (ranks * peak_l),
                "perf/decode_floor_s": max(decode_flops / (workers * peak_r), decode_bytes / (workers * bandwidth))})
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


def _group_frac(batch: Batch, pred) -> float:
    ids = torch.unique(batch.group_id)
    return sum(bool(pred(batch.rewards[batch.group_id == g])) for g in ids) / max(1, len(ids))


def latest_checkpoint(output_dir: str | Path, folder: str = "checkpoints") -> Path | None:
    """The newest complete `step_N` checkpoint in `output_dir/folder`."""
    root = Path(output_dir) / folder
    done = [p for p in root.glob("step_*") if (p / "COMPLETE").exists()] if root.exists() else []
    return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints, and the selected one (`best.json`, `trainer.select_by`)."""
    best = selected_checkpoint(root.parent)
    done = sorted((p for p in root.glob("step_*") if (p / "COMPLETE").exists()),
                  key=lambda p: int(p.name.split("_")[1]))
    for p in done[:-keep] if keep > 0 else []:
        if best is None or p.name != best["checkpoint"]:
            shutil.rmtree(p, ignore_errors=True)


def selected_checkpoint(output_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint `trainer.select_by` chose so far: {checkpoint (folder name), step, metric, value}."""
    path = Path(output_dir) / "checkpoints" / "best.json"
    return json.loads(path.read_text()) if path.exists() else None


def improves(value: float, best: dict[str, Any] | None, mode: str) -> bool:
    """Whether `value` beats the selected checkpoint's (the first evaluation always does; ties keep the earlier)."""
    if best is None:
        return True
    return value > best["value"] if mode == "max" else value < best["value"]
