"""The Ray actors of an RL run behind the loop's contract (`rl.loop.roles.RLRoles`): the learner group (and critic),
the rollout workers, the reward service, the weight-sync transport and the colocated turns; recovery from a rollout
worker that dies or stops answering; the hardware ceilings the utilisation metrics divide by."""

from __future__ import annotations

import time
from typing import Any

import ray
from omegaconf import DictConfig

from cluster.colocation import Colocation
from cluster.evaluation import evaluate
from cluster.perf import ceilings, engine_seconds, utilisation
from cluster.ray_utils import Placement, unfinished
from cluster.roles import make_critic_group, make_learner_group, make_rollout_workers
from cluster.rollout_pipeline import SubmittedRollout, gather_rollout, submit_generation
from cluster.weight_sync import make_transport
from cluster.weight_sync.object_store import ObjectStoreTransport
from rl.algorithm import RLAlgorithm
from rl.batch import Batch
from rl.step import reward_items
from rl.validation import check_tensor_parallel, check_weight_sync
from rollout.probes import peak_rss_gib
from rollout.worker import RolloutWorkerRestarted, RolloutWorkerStuck


class RayRLRoles:
    """The actors of `algorithm` on the policy at `model_path`, placed by `placement`, scored by `reward_service`."""

    def __init__(self, cfg: DictConfig, algorithm: RLAlgorithm, model_path: str, tokenizer: Any,
                 placement: Placement, reward_service: Any):
        check_weight_sync(cfg.rollout.weight_sync, bool(placement.gpus_per_actor),
                          cfg.cluster.placement == "colocated")
        check_tensor_parallel(cfg.rollout.tensor_parallel_size, bool(placement.gpus_per_actor),
                              cfg.cluster.placement == "colocated")
        self.cfg, self.tokenizer, self.rewards = cfg, tokenizer, reward_service
        self._start(algorithm, model_path, placement)
        self.hardware = self._measure_hardware()
        # At start-up another process may still share the cores (Ray's own agents start beside the roles): a run
        # of 3+ synchronous steps measures the ceilings again after its first step and keeps the better ones.
        self.ceilings_to_check = cfg.trainer.steps >= 3 and cfg.trainer.max_staleness == 0
        self.version = 0  # the policy version the engines hold (or are loading)
        self.pending_loads: list[tuple[Any, bool]] = []  # (call, is a load) not yet waited for (max_staleness > 0)
        self.rollout_restarts = 0  # rollouts regenerated because a rollout worker died
        self.sync_bytes: float | None = None  # bytes one weight sync sends (logged as rollout/sync_bytes)
        r = cfg.rollout
        self.weight_sync = make_transport(r.weight_sync, self.learners, self.rollout, bucket_mb=r.sync_bucket_mb,
                                          gpus=bool(placement.gpus_per_actor),
                                          keep_versions=cfg.trainer.max_staleness + 1,
                                          in_flight=r.in_flight_updates)

    def _start(self, algorithm: RLAlgorithm, model_path: str, placement: Placement) -> None:
        """The learner group (and critic), then the rollout workers. They start side by side (model loading and
        imports overlap); with offloading, the engines start only once the learner's states have left the
        device, so that they see the free memory."""
        cfg, lc = self.cfg, self.cfg.learner
        together = not lc.offload_between_phases
        self.learners = make_learner_group(
            cfg, model_path, placement, lr=lc.lr, weight_decay=lc.weight_decay, micro_batch_size=lc.micro_batch_size,
            grad_accum=algorithm.grad_accum, with_ref=algorithm.need_ref, teacher_path=algorithm.teacher_path,
            scheduler=lc.scheduler,
            warmup_steps=lc.warmup_steps, total_steps=algorithm.total_updates, wait=not together)
        self.critic = (make_critic_group(cfg, model_path, placement, algorithm.grad_accum, wait=not together)
                       if algorithm.critic else None)
        if lc.offload_between_phases:  # the engines start once the learner's states have left the device
            self.learners.offload_states()
        self.rollout = make_rollout_workers(cfg, model_path, placement, wait=not together)
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

    # ------------------------------------------------------------------ colocated turns
    def rollout_turn(self) -> None:
        self.phases.rollout_turn()

    def learner_turn(self, timing: dict[str, float]) -> None:
        self.phases.learner_turn(timing)

    def weights_turn(self) -> None:
        self.phases.weights_turn()

    def cache_turn(self, timing: dict[str, float]) -> dict[str, float]:
        return self.phases.cache_turn(timing)

    # ------------------------------------------------------------------ generation and scoring
    def submit_rollout(self, rows: list[dict], seed: int, group_base: int) -> SubmittedRollout:
        r = self.cfg.rollout

        def submit() -> list[Any]:
            return submit_generation(self.rollout, self.tokenizer, self.cfg, rows, temperature=r.temperature,
                                     n=r.n, seed=seed, group_base=group_base)
        return SubmittedRollout(submit(), submit)

    def gather_rollout(self, handle: SubmittedRollout, step: int) -> Batch:
        """A rollout worker that dies meanwhile is restarted by Ray (`rollout.max_restarts`); it then gets the
        current weights and the whole rollout is generated again from the same prompts and seeds, so no sample is
        lost or counted twice."""
        for attempt in range(self.cfg.rollout.max_restarts + 1):
            try:
                self._kill_stuck_rollout_workers(handle.refs, "generate_s", f"finish step {step + 1}'s generation")
                return gather_rollout(handle.refs)
            except (ray.exceptions.RayActorError, RolloutWorkerRestarted, RolloutWorkerStuck) as exc:
                if attempt == self.cfg.rollout.max_restarts:
                    raise RuntimeError(f"rollout for step {step + 1} failed {attempt + 1} times; last "
                                       f"error: {exc}") from exc
                print(f"[looprl] a rollout worker died or was stuck during step {step + 1} "
                      f"({type(exc).__name__}: {exc}); regenerating its rollout", flush=True)
                self.rollout_restarts += 1
                self._resync_rollout_workers()
                handle.refs = handle.resubmit()
        raise AssertionError("unreachable")

    def continue_responses(self, contexts: list[list[int]], max_new_tokens: list[int], seed: int
                           ) -> list[tuple[list[int], list[float], bool, int]]:
        r, k = self.cfg.rollout, len(self.rollout)
        sampling = {"n": 1, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                    "max_new_tokens": max(max_new_tokens), "stop": list(r.stop) or None}
        bounds = [round(i * len(contexts) / k) for i in range(k + 1)]
        refs = [w.continue_ids.remote(contexts[lo:hi], sampling, [seed + i for i in range(lo, hi)])
                for w, lo, hi in zip(self.rollout, bounds, bounds[1:]) if hi > lo]
        self._kill_stuck_rollout_workers(refs, "generate_s", "continue the partial responses")
        return [out for part in ray.get(refs) for out in part]

    def score(self, batch: Batch, step: int) -> list[dict]:
        """Within `trainer.deadlines.reward_s` (the service itself kills and restarts a reward process that stops
        answering and scores its samples again)."""
        d, r = self.cfg.trainer.deadlines, self.cfg.reward
        limit = d.reward_s or r.timeout_s * -(-len(batch) // max(1, r.num_workers)) * len(r.functions) + 300.0
        try:
            return ray.get(self.rewards.score.remote(reward_items(batch)), timeout=limit)
        except ray.exceptions.GetTimeoutError as exc:
            raise RuntimeError(f"the reward service did not answer within {limit:g} s (trainer.deadlines.reward_s) "
                               f"at step {step}; the run stopped") from exc

    def evaluate(self, rows: list[dict]) -> dict[str, Any]:
        return evaluate(self.rollout, self.rewards, self.tokenizer, self.cfg, rows)

    # ------------------------------------------------------------------ recovery
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
        waits, loads = ObjectStoreTransport(self.learners, self.rollout).push(self.version)
        ray.get(waits + loads)
        self.weight_sync.reset()  # a collective's group is formed again: the restarted worker left it

    # ------------------------------------------------------------------ weights
    def sync_weights(self, version: int) -> dict[str, float]:
        """The sync, with the engines' load time (with max_staleness > 0: of the previous update, loaded in the
        background) and the bytes one sync sends (the adapter's tensors alone with one)."""
        metrics = {"rollout/weight_load_s": self._push_weights(version)}
        if self.cfg.rollout.weight_sync != "cuda_ipc":
            if self.sync_bytes is None:  # the same every step: asked once, so pipelined syncs never wait on it
                self.sync_bytes = float(ray.get(self.learners.workers[0].last_sync_bytes.remote()))
            metrics["rollout/sync_bytes"] = self.sync_bytes
        return metrics

    def _push_weights(self, version: int) -> float:
        """Learner rank 0's full weights (ZeRO-3 gathers first) into every rollout engine, by the recipe's
        transport (`cluster.weight_sync`).

        Synchronous runs wait for the rollout engines to load them and return the longest load time.
        With max_staleness > 0 the loads of a pipelined transport are queued behind the in-flight generations
        (each rollout worker runs its calls in order) and this returns at once; their times are read on the
        next call.
        """
        self.version = version
        waits, loads = self.weight_sync.push(version)
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
        done, self.pending_loads = self.pending_loads, [(ref, True) for ref in loads] + [(ref, False) for ref in waits]
        times = []
        for ref, is_load in done:
            try:
                t = ray.get(ref)
            except ray.exceptions.RayActorError:  # a rollout worker died: recovered when its rollout is gathered
                continue
            if is_load:
                times.append(float(t))
        return max(times) if times else 0.0

    # ------------------------------------------------------------------ accounting
    def perf_metrics(self, batch: Batch, timing: dict[str, float], step_s: float, train_passes: int,
                     logprob_passes: int) -> dict[str, float]:
        metrics = {"rollout/restarts": float(self.rollout_restarts)}
        if (engine_s := engine_seconds(batch)) is not None:  # generation itself, overlapped or not
            metrics["rollout/engine_s"] = engine_s
        if self.ceilings_to_check:  # after the first synchronous step, every role idle and warm
            self.ceilings_to_check = False
            dtype = self.cfg.model.dtype
            self.hardware["learner"] = ceilings(self.learners.workers[0], dtype, self.cfg.learner.threads, again=True)
            self.hardware["rollout"] = ceilings(self.rollout[0], dtype, self.cfg.rollout.threads, again=True)
        metrics.update(utilisation(batch, timing, step_s, self.hardware, self.cfg, train_passes=train_passes,
                                   logprob_passes=logprob_passes))
        return metrics

    def _ask_learners_and_rollout(self, method: str) -> dict[str, Any]:
        """`method()` of every learner rank and rollout worker, keyed learner0.., rollout0.."""
        roles = {"learner": self.learners.workers, "rollout": self.rollout}
        refs = {f"{role}{i}": getattr(w, method).remote() for role, ws in roles.items() for i, w in enumerate(ws)}
        return dict(zip(refs, ray.get(list(refs.values()))))

    def peak_memory(self) -> dict[str, float]:
        out = self._ask_learners_and_rollout("peak_rss_gib")
        out["reward_service"] = ray.get(self.rewards.peak_rss_gib.remote())
        out["driver"] = peak_rss_gib()
        return out

    def actor_nodes(self) -> dict[str, str]:
        return self._ask_learners_and_rollout("node_id")

    def close(self) -> None:
        self.learners.shutdown()
        if self.critic is not None:
            self.critic.shutdown()
        for w in self.rollout:
            ray.kill(w)
