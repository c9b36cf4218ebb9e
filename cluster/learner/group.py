"""The driver's handle on a learner group: `world_size` LearnerWorker Ray actors, a batch split over their ranks and
micro-batches, and failure detection (a dead or stuck rank stops the run; it resumes from a checkpoint)."""

from __future__ import annotations

from typing import Any

import ray
import torch

from cluster.learner.worker import LearnerWorker
from cluster.ray_utils import free_port, unfinished
from rl.batch import (
    Batch,
    contiguous_plan,
    micro_batches_of,
    plan_micro_batches,
    plan_prompt_groups,
    sequence_tokens,
)
from rl.loop.roles import LearnerFailed


class LearnerDied(LearnerFailed):
    """A learner rank's process died (killed, out of memory, a crashed collective)."""


class LearnerStuck(LearnerFailed):
    """A learner call did not finish within its deadline (`trainer.deadlines.learner_s`)."""


class LearnerGroup:
    """Driver-side handle on `world_size` LearnerWorker actors."""

    def __init__(self, world_size: int, model_path: str, *, placement_group=None, bundle_indices=None,
                 num_cpus: float = 0.5, num_gpus: float = 0.0, env: dict[str, str] | None = None,
                 max_tokens_per_micro_batch: int = 0, deadline_s: float = 0.0, wait: bool = True,
                 share_prompts: bool = False, sequence_parallel_size: int = 1, **worker_kwargs: Any):
        """`max_tokens_per_micro_batch > 0` forms micro-batches by token count (`rl.batch.plan_micro_batches`)
        instead of `grad_accum` equal splits of each rank's share; logprob passes use it too. `share_prompts`: the
        rows that repeat a prompt share its forward, so a token budget keeps them in one micro-batch and counts the
        prompt once. `sequence_parallel_size`: groups of that many consecutive ranks get the same micro-batches
        (`models.sequence_parallel`); the batch is split over `world_size / s` data-parallel shares. `deadline_s > 0`
        bounds every call on the ranks (`LearnerStuck` past it). `wait=False` returns while the ranks still start
        (other actors can start meanwhile); call `wait_ready` before using them."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.world_size = world_size
        self.sp = sequence_parallel_size
        self.data_ranks = world_size // sequence_parallel_size
        if sequence_parallel_size > 1:
            worker_kwargs["sequence_parallel_size"] = sequence_parallel_size
        self.max_tokens = max_tokens_per_micro_batch
        self.share_prompts = share_prompts
        if share_prompts:
            worker_kwargs["share_prompts"] = True
        self.deadline_s = deadline_s
        self.broken = False  # a rank missed its deadline: shutdown skips the barrier it would never reach
        self.logprob_micro_batch_size = 64  # sequences per logprob forward without a token budget
        port = free_port()
        addr = "127.0.0.1" if placement_group is None else ray.util.get_node_ip_address()
        actor_cls = ray.remote(LearnerWorker)
        self.workers = []
        for rank in range(world_size):
            opts: dict[str, Any] = {"num_cpus": num_cpus, "runtime_env": {"env_vars": env or {}}}
            if num_gpus:
                opts["num_gpus"] = num_gpus
            if placement_group is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_indices[rank])
            self.workers.append(actor_cls.options(**opts).remote(rank, world_size, addr, port, model_path,
                                                                 **worker_kwargs))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until every rank has loaded its model and joined the process group (raises a rank's start-up error)."""
        ray.get([w.__ray_ready__.remote() for w in self.workers])

    def get_all(self, futures: list[Any], what: str) -> list[Any]:
        """`ray.get` of one call per rank; a dead rank becomes a `LearnerDied` naming it, a call still running
        after `deadline_s` a `LearnerStuck` naming the ranks (a DeepSpeed rank cannot rejoin its process
        group, so the run stops and resumes from a checkpoint)."""
        stuck = unfinished(futures, self.deadline_s)
        if stuck:
            self.broken = True  # no graceful shutdown: the stuck ranks will not reach the barrier
            raise LearnerStuck(f"learner rank(s) {stuck} did not finish {what} within {self.deadline_s:g} s "
                               f"(trainer.deadlines.learner_s)")
        try:
            return ray.get(futures)
        except ray.exceptions.RayActorError as exc:
            dead = []
            for rank, f in enumerate(futures):
                try:
                    ray.get(f, timeout=10)
                except ray.exceptions.RayActorError:
                    dead.append(rank)
                except Exception:  # noqa: BLE001 - a rank that failed otherwise, or is still busy, is not dead
                    pass
            raise LearnerDied(f"learner rank(s) {dead or '?'} died during {what}") from exc

    def plan(self, batch: Batch, micro_batches: int) -> list[list[list[int]]]:
        """Row indices per rank and micro-batch: by token budget when one is set, else contiguous shards
        split into `micro_batches` each; the ranks of a sequence-parallel group get the same."""
        if self.max_tokens and self.share_prompts:
            shares = plan_prompt_groups(batch, self.data_ranks, self.max_tokens)
        elif self.max_tokens:
            shares = plan_micro_batches(sequence_tokens(batch), self.data_ranks, self.max_tokens)
        else:
            shares = contiguous_plan(len(batch), self.data_ranks, micro_batches)
        return [share for share in shares for _ in range(self.sp)]

    def _one_per_group(self, results: list[Any]) -> list[Any]:
        """One result per data-parallel share (the ranks of a sequence-parallel group return the same)."""
        return results[::self.sp]

    def compute_logprobs(self, batch: Batch, which: str = "policy", temperature: float = 1.0, top_k: int = 0,
                         top_p: float = 1.0, output: str = "logp") -> torch.Tensor:
        """`[N, L]` sampled-token logprobs of `batch` (or the family's `output`, e.g. a critic's `values`, a
        looped model's `[N, L, T]` `loop_logp`)."""
        per_rank = -(-len(batch) // self.data_ranks)
        plan = self.plan(batch, max(1, -(-per_rank // self.logprob_micro_batch_size)))
        futures = [w.compute_logprobs.remote(mbs, which, temperature, top_k, top_p, output)
                   for w, mbs in zip(self.workers, micro_batches_of(batch, plan))]
        out = None
        for bins, parts in zip(plan[::self.sp], self._one_per_group(self.get_all(futures, f"{which} logprobs"))):
            for rows, logp in zip(bins, parts):
                if out is None:
                    out = torch.zeros((*batch.response_ids.shape, *logp.shape[2:]))
                if rows:  # empty bins ran a filler row
                    out[rows, :logp.shape[1]] = logp
        return out

    def train_step(self, batch: Batch, grad_accum: int, loss_fn_spec: str, loss_params: dict[str, Any],
                   temperature: float = 1.0, need_entropy: bool = False,
                   rollout_correction: dict[str, Any] | None = None, top_k: int = 0, top_p: float = 1.0
                   ) -> dict[str, float]:
        """Split `batch` over ranks and micro-batches (`plan`); one optimizer step."""
        mask = batch.response_mask
        params = dict(loss_params)
        params["num_tokens"] = float(mask.sum())
        params["num_seqs"] = float((mask.sum(-1) > 0).sum())
        futures = [w.train_step.remote(mbs, loss_fn_spec, params, temperature, need_entropy, rollout_correction,
                                       top_k, top_p)
                   for w, mbs in zip(self.workers, micro_batches_of(batch, self.plan(batch, grad_accum)))]
        results = self._one_per_group(self.get_all(futures, "a training step"))
        out = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
        out["loss"] = sum(r["loss"] for r in results)
        out["grad_norm"] = results[0]["grad_norm"]
        return out

    def sft_step(self, batch: Batch, grad_accum: int, loop_readouts: str = "final") -> dict[str, float]:
        num_tokens = float(batch.response_mask.sum())
        results = self._one_per_group(self.get_all(
            [w.sft_step.remote(mbs, num_tokens, loop_readouts)
             for w, mbs in zip(self.workers, micro_batches_of(batch, self.plan(batch, grad_accum)))], "an SFT step"))
        # a forward-only optimizer's figures (`zo/...`: the same step on every rank) come along
        return {"loss": sum(r["loss"] for r in results), "grad_norm": results[0]["grad_norm"],
                "lr": results[0]["lr"], **{k: v for k, v in results[0].items() if k.startswith("zo/")}}

    def counters(self) -> list[dict[str, int]]:
        """Every rank's counters (backward passes run)."""
        return self.get_all([w.counters.remote() for w in self.workers], "reading counters")

    def offload_states(self) -> float:
        return max(self.get_all([w.offload_states.remote() for w in self.workers], "offloading learner states"))

    def gpu_memory_gib(self) -> float:
        """The largest GPU memory any rank's tensors hold now (0 on CPU)."""
        return max(ray.get([w.gpu_memory_gib.remote() for w in self.workers]))

    def reload_states(self) -> float:
        return max(self.get_all([w.reload_states.remote() for w in self.workers], "reloading learner states"))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return ray.get([w.full_state_dict.remote() for w in self.workers])[0]

    def save_checkpoint(self, path: str, client_state: dict) -> None:
        self.get_all([w.save_checkpoint.remote(path, client_state) for w in self.workers], "a checkpoint save")

    def load_checkpoint(self, path: str) -> dict:
        return ray.get([w.load_checkpoint.remote(path) for w in self.workers])[0]

    def save_hf(self, path: str, tokenizer_path: str | None = None) -> None:
        ray.get([w.save_hf.remote(path, tokenizer_path) for w in self.workers])

    def shutdown(self) -> None:
        try:
            if self.broken:
                raise RuntimeError("a rank is stuck")
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception:  # a rank that is already gone cannot take part in the barrier
            pass
        for w in self.workers:
            ray.kill(w)
