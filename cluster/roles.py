"""The actor groups of an RL run, made from the recipe: the learner group, the critic, the rollout workers."""

from __future__ import annotations

from typing import Any

import ray
from omegaconf import DictConfig

from cluster.learner import LearnerGroup
from cluster.ray_utils import Placement, actor_env
from rl.config import as_container
from rl.recipe import engine_options, model_family
from rollout.worker import RolloutWorker


def shared_learner_options(cfg: DictConfig, placement: Placement) -> dict[str, Any]:
    """What every learner group of a run takes from the recipe's `learner`, `model` and `trainer` sections: its
    ranks' placement, precision, ZeRO stage, micro-batching and deadline."""
    lc = cfg.learner
    return dict(placement_group=placement.group, bundle_indices=placement.learner_bundles,
                num_gpus=placement.gpus_per_actor, env=actor_env(), optimizer=as_container(lc.optimizer),
                zero_stage=lc.zero_stage, dtype=cfg.model.dtype, backend=lc.backend,
                gradient_checkpointing=cfg.model.gradient_checkpointing, seed=cfg.seed, threads=lc.threads,
                trust_remote_code=cfg.model.trust_remote_code, pack_sequences=lc.pack_sequences,
                deadline_s=cfg.trainer.deadlines.learner_s, max_tokens_per_micro_batch=lc.max_tokens_per_micro_batch,
                attn_implementation=lc.attn_implementation)


def make_learner_group(cfg: DictConfig, model_path: str, placement: Placement, *, lr: float, weight_decay: float,
                       micro_batch_size: int, grad_accum: int, scheduler: Any, warmup_steps: int, total_steps: int,
                       with_ref: bool = False, teacher_path: str | None = None, family: str | None = None,
                       wait: bool = True) -> LearnerGroup:
    """A DeepSpeed learner group on the placement's learner bundles; stage-specific optimisation
    settings are arguments, everything else comes from the recipe's `learner`/`model` sections (`family`:
    another model family than the policy's, e.g. a reward model's `sequence_score`)."""
    lc, policy = cfg.learner, family is None
    return LearnerGroup(
        lc.world_size, model_path, **shared_learner_options(cfg, placement), num_cpus=lc.num_cpus,
        lr=lr, weight_decay=weight_decay, scheduler=as_container(scheduler),
        family=family or model_family(cfg, model_path), micro_batch_size=micro_batch_size,
        grad_accum=grad_accum, grad_clip=lc.grad_clip, with_ref=with_ref, warmup_steps=warmup_steps,
        teacher_path=teacher_path,
        total_steps=total_steps, offload_between_phases=lc.offload_between_phases,
        logprob_chunk_tokens=lc.logprob_chunk_tokens,
        adapter=as_container(lc.adapter) if lc.adapter and policy else None,  # the policy's adapter
        share_prompts=lc.share_prompts and policy, compile_position_wise=lc.compile_position_wise and policy,
        sequence_parallel_size=lc.sequence_parallel_size if policy else 1, wait=wait)


def make_critic_group(cfg: DictConfig, model_path: str, placement: Placement, grad_accum: int,
                      wait: bool = True) -> LearnerGroup:
    """The value model's DeepSpeed group, on the learner bundles beside the policy's ranks (they take turns)."""
    lc, c, a = cfg.learner, cfg.critic, cfg.algorithm
    return LearnerGroup(
        lc.world_size, c.model_path or model_path, **shared_learner_options(cfg, placement), num_cpus=0,
        lr=c.lr, weight_decay=lc.weight_decay, family="value", micro_batch_size=lc.micro_batch_size,
        grad_accum=grad_accum, grad_clip=c.grad_clip, total_steps=cfg.trainer.steps * a.ppo_epochs * a.mini_batches,
        wait=wait)


def adapter_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The rollout engine's share of `learner.adapter`: the engines hold the base model wrapped with the same
    adapter, and the weight sync sends the adapter's tensors alone."""
    return {"adapter": as_container(cfg.learner.adapter)} if cfg.learner.adapter else {}


def make_rollout_workers(cfg: DictConfig, model_path: str, placement: Placement, wait: bool = True) -> list[Any]:
    """One rollout worker per rollout bundle; `wait=False` returns while they still start (wait on `pid`)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    # weights arrive on a thread of their own while the engine generates (RolloutWorker.receive_weights_staged)
    cls = ray.remote(concurrency_groups={"weight_sync": 1})(RolloutWorker)
    workers = []
    # vLLM must be built with sleep mode to free its memory between phases
    sleep_kwargs = {"enable_sleep_mode": True} if cfg.rollout.sleep_between_phases and cfg.rollout.engine == "vllm" else {}
    for b in placement.rollout_bundles:
        opts: dict[str, Any] = {"num_cpus": cfg.rollout.num_cpus, "runtime_env": {"env_vars": actor_env()},
                                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                    placement_group=placement.group, placement_group_bundle_index=b)}
        if placement.rollout_gpus_per_actor:
            opts["num_gpus"] = placement.rollout_gpus_per_actor
        # restarted by Ray if its process dies; the trainer then resends the weights and regenerates
        opts["max_restarts"] = cfg.rollout.max_restarts
        workers.append(cls.options(**opts).remote(
            cfg.rollout.engine, model_path, threads=cfg.rollout.threads, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
            batch_size=cfg.rollout.generation_batch_size,
            **({"tensor_parallel_size": cfg.rollout.tensor_parallel_size} if cfg.rollout.tensor_parallel_size > 1 else {}),
            device="cuda" if placement.gpus_per_actor else "cpu", **{**sleep_kwargs, **adapter_kwargs(cfg),
                                                                     **engine_options(cfg.rollout.engine_params, cfg.rollout.engine, "rollout.engine_params")}))
    if wait:
        ray.get([w.pid.remote() for w in workers])
    return workers
