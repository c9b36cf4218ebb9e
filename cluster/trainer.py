"""The RL loop: rollout → reward → logprobs → advantages → DeepSpeed update → weight sync.

One `RLTrainer.step()` is the whole algorithm; the roles it drives (rollout workers, reward
service, learner group) are Ray actors placed by `cluster.ray_utils.make_placement`.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import DictConfig

from cluster.checkpoints import prune_checkpoints
from cluster.colocation import Colocation
from cluster.perf import ceilings, engine_seconds, utilisation
from cluster.ray_utils import Placement, unfinished
from cluster.roles import make_critic_group, make_learner_group, make_rollout_workers
from cluster.rollout_pipeline import PendingRollout, gather_rollout, split_informative, submit_generation
from cluster.weight_sync import make_transport
from cluster.weight_sync.object_store import ObjectStoreTransport
from rl.algorithm import RLAlgorithm
from rl.batch import Batch
from rl.recipe import as_container
from rl.registry import lookup
from rl.step import (
    apply_length_shaping,
    attach_rewards,
    component_means,
    episode_metrics,
    group_fraction,
    reward_items,
)
from rl.validation import check_weight_sync
from rollout.worker import RolloutWorkerRestarted, RolloutWorkerStuck


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
        self.sampler = lookup("sampler", ps.name)(train_rows, cfg.seed, **as_container(ps.params))
        self.algorithm = RLAlgorithm(cfg)
        samples_per_update = cfg.trainer.prompts_per_step * cfg.rollout.n // cfg.algorithm.mini_batches
        lc = cfg.learner
        self.grad_accum = max(1, math.ceil(samples_per_update / lc.world_size / lc.micro_batch_size))
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
        r = cfg.rollout
        self.weight_sync = make_transport(r.weight_sync, self.learners, self.rollout, bucket_mb=r.sync_bucket_mb,
                                          gpus=bool(placement.gpus_per_actor),
                                          keep_versions=cfg.trainer.max_staleness + 1)

    def _start_roles(self) -> None:
        """The learner group (and critic), then the rollout workers. They start side by side (model loading and
        imports overlap); with offloading, the engines start only once the learner's states have left the
        device, so that they see the free memory."""
        cfg, a, lc = self.cfg, self.cfg.algorithm, self.cfg.learner
        together = not lc.offload_between_phases
        self.learners = make_learner_group(
            cfg, self.model_path, self.placement, lr=lc.lr, weight_decay=lc.weight_decay,
            micro_batch_size=lc.micro_batch_size, grad_accum=self.grad_accum, with_ref=self.algorithm.need_ref,
            scheduler=lc.scheduler, warmup_steps=lc.warmup_steps,
            total_steps=cfg.trainer.steps * a.ppo_epochs * a.mini_batches, wait=not together)
        self.critic = (make_critic_group(cfg, self.model_path, self.placement, self.grad_accum, wait=not together)
                       if self.algorithm.critic else None)
        if lc.offload_between_phases:  # the engines start once the learner's states have left the device
            self.learners.offload_states()
        self.rollout = make_rollout_workers(cfg, self.model_path, self.placement, wait=not together)
        self.phases = Colocation(self.learners, self.rollout,
                                 swap=cfg.rollout.sleep_between_phases or lc.offload_between_phases)
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
        t_start, timing = time.perf_counter(), {}
        self.phases.rollout_turn()  # colocated roles take turns on a device (cluster.colocation)
        batch, metrics = self.collect(timing)  # generate and score (dynamic sampling tops up)
        self.phases.learner_turn(timing)
        with _timer(timing, "logprobs"):
            self.logprob_passes(batch)  # old policy, reference, critic values: what the algorithm needs
        token_rewards = self.algorithm.advantages(batch, metrics)
        with _timer(timing, "train"):
            train_metrics = self.update(batch, token_rewards, metrics)
        self.step_idx += 1
        with _timer(timing, "sync"):
            self.phases.weights_turn()
            metrics.update(self.sync_weights_and_measure())
        metrics.update(self.phases.cache_turn(timing))
        return self.step_metrics(batch, metrics, train_metrics, timing, time.perf_counter() - t_start)

    def logprob_passes(self, batch: Batch) -> None:
        """The learners' forward passes the algorithm needs, into `batch`: the old policy's logprobs (the PPO
        ratio's denominator after the first update), the reference's (KL), the critic's values."""
        algo = self.algorithm
        if algo.need_old_logp:
            batch.old_logp = self.learners.compute_logprobs(batch, "policy", **algo.sampling)
        if algo.need_ref:
            batch.ref_logp = self.learners.compute_logprobs(batch, "ref", **algo.sampling)
        if self.critic is not None:
            batch.set_extra("values", self.critic.compute_logprobs(batch, output="values"), pad="right")

    def update(self, batch: Batch, token_rewards: torch.Tensor | None, metrics: dict[str, float]
               ) -> list[dict[str, float]]:
        """The critic's update (when there is one), then the policy's: `ppo_epochs` passes over `mini_batches`
        shuffled mini-batches, one optimizer step each (none while the critic warms up)."""
        algo = self.algorithm
        if self.critic is not None:
            returns = algo.critic_targets(batch, token_rewards)
            results = [self.critic.train_step(mb, self.grad_accum, "value_clip",
                                              {"clip": algo.value_clip, "agg": "token-mean"})
                       for mb in algo.mini_batches(batch, algo.seed * 37 + self.step_idx)]
            metrics.update(algo.critic_metrics(batch, returns, results))
            if self.step_idx < algo.critic_warmup_steps:
                return []
        return [self.learners.train_step(mb, self.grad_accum, **algo.policy_loss_kwargs())
                for mb in algo.mini_batches(batch, algo.seed * 31 + self.step_idx)]

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
            "reward/solve_all_frac": float(group_fraction(batch, lambda r: r.min() > 0)),
            "reward/solve_none_frac": float(group_fraction(batch, lambda r: r.max() <= 0)),
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
                return gather_rollout(pending.refs)
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
        # the current weights through the object store (every learner rank takes part: ZeRO-3 gathers them)
        waits, loads = ObjectStoreTransport(self.learners, self.rollout).push(self.step_idx)
        ray.get(waits + loads)
        self.weight_sync.reset()  # a collective's group is formed again: the restarted worker left it

    def _fill_pipeline(self) -> None:
        """Keep the rollouts of steps `step_idx .. step_idx + max_staleness` submitted (never past the
        last step). With max_staleness k, the rollout of step t+k is generated by the weights of step t."""
        last = min(self.step_idx + self.cfg.trainer.max_staleness, self.cfg.trainer.steps - 1)
        self.next_submit = max(self.next_submit, self.step_idx)
        while self.next_submit <= last:
            self.pending.append(self._submit(self.next_submit, 0))
            self.next_submit += 1

    def sync_weights_and_measure(self) -> dict[str, float]:
        """The sync after an update, with the engines' load time (with max_staleness > 0: of the previous update,
        loaded in the background) and the bytes one sync sends (the adapter's tensors alone with one)."""
        metrics = {"rollout/weight_load_s": self.sync_weights()}
        if self.cfg.rollout.weight_sync != "cuda_ipc":
            if self.sync_bytes is None:  # the same every step: asked once, so pipelined syncs never wait on it
                self.sync_bytes = float(ray.get(self.learners.workers[0].last_sync_bytes.remote()))
            metrics["rollout/sync_bytes"] = self.sync_bytes
        return metrics

    def sync_weights(self) -> float:
        """Learner rank 0's full weights (ZeRO-3 gathers first) into every rollout engine, by the recipe's
        transport (`cluster.weight_sync`).

        Synchronous runs wait for the rollout engines to load them and return the longest load time.
        With max_staleness > 0 the loads of a pipelined transport are queued behind the in-flight generations
        (each rollout worker runs its calls in order) and this returns at once; their times are read on the
        next call.
        """
        waits, loads = self.weight_sync.push(self.step_idx)
        if not self.weight_sync.pipelined:
            self._kill_stuck_rollout_workers(loads, "sync_s", "load the weights")
            return max(ray.get(loads))
        if self.cfg.trainer.max_staleness == 0:
            ray.get(waits)
            try:
                self._kill_stuck_rollout_workers(loads, "sync_s", "load the weights")
                return max(ray.get(loads))
            except (ray.exceptions.RayActorError, RolloutWorkerStuck):  # restart it with these weights
                self._resync_rollout_workers()
                return 0.0
        done, self.pending_loads = self.pending_loads, loads + waits
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
        self.phases.learner_turn({})  # as in a step: the engines sleep while the learner is on the device
        self.phases.weights_turn()
        self.load_checkpoint(ckpt)
        self.phases.cache_turn({})

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


@contextmanager
def _timer(timing: dict[str, float], key: str):
    """Adds the time spent inside to `timing[key]`."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0


