"""The driver's runtime: what the stages that run in the driver share (Ray, the reward service, the placement of
the learner and rollout actors, the live RL run's actors) and the capabilities it lends them (`rl.stages.StageRuntime`):
fine-tuning, rollout workers, scoring, judges, tasks and actors in the reserved resources."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import DictConfig

from cluster.local_ray import init_ray
from cluster.ray_utils import actor_env, bundle_options, free_port, make_placement
from cluster.rl_roles import RayRLRoles
from cluster.roles import make_learner_group, make_rollout_workers
from cluster.rollout_pipeline import generate
from rewards.judges import start_judges, stop_judges
from rewards.service import RewardService, RewardSpec
from rl.algorithm import RLAlgorithm
from rl.config import as_container
from rl.loop.checkpoints import latest_checkpoint
from rl.loop.tracking import truncate_metrics
from rl.recipe import needs_critic
from rl.sft import run_sft
from rl.stages import StageContext, say
from rl.step import reward_items


class Runtime:
    """What the driver stages share: Ray, the reward service, the placement of the learner and rollout
    actors (made on first use, so that stages before SFT have the whole cluster), the live RL run's actors."""

    def __init__(self, cfg: DictConfig, specs: list[RewardSpec]):
        self.cfg = cfg
        self.ray = init_ray(cfg.cluster.address, cfg.cluster.num_cpus, cfg.cluster.join_running)
        say(self.ray.note)
        self.reward_service = ray.remote(RewardService).options(
            num_cpus=0, runtime_env={"env_vars": actor_env()}).remote(
            specs, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
            failure_reward=cfg.reward.failure_reward)
        self._placement = None
        self.rl_roles: RayRLRoles | None = None
        self.judges: dict[str, Any] = {}

    @property
    def placement(self) -> Any:
        if self._placement is None:
            cfg, lc = self.cfg, self.cfg.learner
            use_gpu = torch.cuda.is_available() or ray.cluster_resources().get("GPU", 0) > 0
            self._placement = make_placement(
                lc.world_size, cfg.rollout.num_workers, lc.num_cpus, cfg.rollout.num_cpus, cfg.cluster.placement,
                cfg.cluster.placement_strategy, use_gpu=use_gpu,
                learner_resources=as_container(cfg.cluster.learner_resources),
                rollout_resources=as_container(cfg.cluster.rollout_resources),
                learner_roles=2 if needs_critic(cfg) else 1, timeout_s=cfg.cluster.wait_for_resources_s,
                can_grow=self.ray.mode == "connected", rollout_gpus=cfg.rollout.tensor_parallel_size)
        return self._placement

    def close(self) -> None:
        if self.rl_roles is not None:
            self.rl_roles.close()
        ray.kill(self.reward_service)
        if self._placement is not None:
            self._placement.remove()

    # ------------------------------------------------------------------ capabilities lent to the stages
    def run_task(self, fn: Callable[..., Any], *args: Any, bundle: int = 0, num_gpus: float = 0.0, **kwargs: Any) -> Any:
        task = ray.remote(fn).options(**bundle_options(self.placement, bundle, num_gpus))
        return ray.get(task.remote(*args, **kwargs))

    def start_actor(self, cls: type, *args: Any, bundle: int = 0, num_gpus: float = 0.0) -> Any:
        return ray.remote(cls).options(**bundle_options(self.placement, bundle, num_gpus)).remote(*args)

    def call(self, actor: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(actor, method).remote(*args, **kwargs)

    def wait(self, refs: Any, timeout: float | None = None) -> Any:
        return ray.get(refs, timeout=timeout)

    def rendezvous(self, world_size: int) -> tuple[str, int]:
        port = free_port()
        return ("127.0.0.1" if world_size == 1 else ray.util.get_node_ip_address()), port

    def fine_tune(self, cfg: DictConfig, model_path: str, out_path: str, tokenizer: Any, examples: list, *,
                  eval_examples: list | None = None, fingerprint: str = "", shuffle: bool = True) -> dict[str, float]:
        return fine_tune(cfg, model_path, out_path, tokenizer, examples, self.placement, eval_examples=eval_examples,
                         fingerprint=fingerprint, shuffle=shuffle)

    def learner_group(self, cfg: DictConfig, model_path: str, **params: Any) -> Any:
        return make_learner_group(cfg, model_path, self.placement, **params)

    def start_rollout_workers(self, cfg: DictConfig, model_path: str) -> list[Any]:
        return make_rollout_workers(cfg, model_path, self.placement)

    def start_rl_roles(self, cfg: DictConfig, algorithm: RLAlgorithm, model_path: str, tokenizer: Any) -> RayRLRoles:
        self.rl_roles = RayRLRoles(cfg, algorithm, model_path, tokenizer, self.placement, self.reward_service)
        return self.rl_roles

    def release_trainer(self) -> None:
        if self.rl_roles is not None:
            self.rl_roles.close()
            self.rl_roles = None

    @contextmanager
    def rollout_workers(self, ctx: StageContext, cfg: DictConfig) -> Iterator[list[Any]]:
        if self.rl_roles is not None:
            yield self.rl_roles.rollout
            return
        workers = self.start_rollout_workers(cfg, ctx.require("policy"))
        try:
            yield workers
        finally:
            self.stop_actors(workers)

    def stop_actors(self, actors: list[Any]) -> None:
        for actor in actors:
            ray.kill(actor)

    def generate(self, workers: list[Any], tokenizer: Any, cfg: DictConfig, rows: list[dict], **sampling: Any) -> Any:
        return generate(workers, tokenizer, cfg, rows, **sampling)

    def score(self, batch: Any, evaluation: bool = False) -> list[dict]:
        return self.score_items(reward_items(batch), evaluation=evaluation)

    def score_items(self, items: list[dict], evaluation: bool = False) -> list[dict]:
        return ray.get(self.reward_service.score.remote(items, evaluation=evaluation))

    def start_judges(self, judges: dict[str, Any], policy_path: str) -> dict[str, Any]:
        return start_judges(judges, policy_path, env=actor_env())

    def stop_judges(self, clients: Any) -> None:
        stop_judges(clients)

    def serve_reward_judges(self, cfg: DictConfig, policy_path: str, summary: dict,
                            artifact: Callable[[str], str]) -> dict[str, Any]:
        """Start `reward.judges` (null model paths: the initial policy; `artifact:NAME`: an earlier stage's
        artifact, e.g. the `reward_model` stage's) and hand them to the reward service; judges record the
        digest of their weights now and at the end of the run."""
        if not cfg.reward.judges:
            return {}
        judges = as_container(cfg.reward.judges)
        for judge in judges.values():  # the grader of a chat policy is asked the way the policy is
            if str(judge["model_path"] or "").startswith("artifact:"):
                judge["model_path"] = artifact(judge["model_path"].split(":", 1)[1])
            if judge["chat_template"] is None:
                judge["chat_template"] = cfg.data.chat_template
        clients = self.start_judges(judges, policy_path)
        ray.get(self.reward_service.set_judges.remote(clients))
        summary["judges"] = {name: {"model": judges[name]["model_path"] or policy_path,
                                    "engine": judges[name]["engine"],
                                    "weights_sha256_start": clients[name].weights_sha256()}
                             for name in clients}
        started = [f"{name} ({len(c.workers)} x {judges[name]['engine']})" for name, c in clients.items()]
        say("judges: " + ", ".join(started))
        return clients


# ---------------------------------------------------------------------------------------------- fine-tuning
def fine_tune(cfg: DictConfig, model_path: str, out_path: str, tokenizer: Any, examples: list, placement: Any, *,
              eval_examples: list | None = None, fingerprint: str = "", shuffle: bool = True) -> dict[str, float]:
    """`sft` on tokenized `examples` (`rl.sft_data`) from `model_path`, saved as an HF model at `out_path`;
    `sft.save_every` checkpoints in `output_dir/sft_checkpoints` (tagged with the stage `fingerprint`), from
    which `resume: auto` continues a run of the same stage."""
    s, lc = cfg.sft, cfg.learner
    steps = max(1, math.ceil(s.epochs * len(examples) / s.batch_size)) if s.epochs > 0 else s.steps
    say(f"sft: {steps} steps, batch {s.batch_size}, lr {s.lr}, {len(examples)} sequences"
        + (f", {len(eval_examples)} held out" if eval_examples else ""))
    grad_accum = max(1, -(-s.batch_size // (lc.world_size * lc.micro_batch_size)))
    group = make_learner_group(cfg, model_path, placement, lr=s.lr, weight_decay=s.weight_decay,
                               micro_batch_size=min(lc.micro_batch_size, s.batch_size // lc.world_size),
                               grad_accum=grad_accum, scheduler=s.scheduler, warmup_steps=s.warmup_steps,
                               total_steps=steps)
    log_path = Path(cfg.output_dir) / "sft_metrics.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm
    bar = tqdm(total=steps, desc="sft", file=sys.stderr, mininterval=2.0, disable=not cfg.logging.progress_bar)
    log, save = _sft_logger(log_path, bar), _sft_saver(group, Path(cfg.output_dir) / "sft_checkpoints",
                                                       fingerprint, s.keep_checkpoints)
    t0 = time.perf_counter()
    try:
        resume = _sft_resume(cfg, group, log_path, bar, fingerprint)
        hist = run_sft(group, examples, pad_id=tokenizer.pad_token_id, steps=steps, batch_size=s.batch_size,
                       grad_accum=grad_accum, seed=cfg.seed, log=log, loop_readouts=s.loop_readouts,
                       eval_examples=eval_examples, eval_every=s.eval_every, save=save, save_every=s.save_every,
                       resume=resume, shuffle=shuffle)
        bar.close()
        group.save_hf(str(Path(out_path)), tokenizer_path=model_path)
    finally:
        group.shutdown()
    summary = {"sft_steps": steps, "sft_wall_s": time.perf_counter() - t0}
    if hist:
        summary["sft_final_loss"] = hist[-1]["sft/loss"]
        if "sft/eval_loss" in hist[-1]:
            summary["sft_eval_loss"] = hist[-1]["sft/eval_loss"]
    return summary


def _sft_logger(log_path: Path, bar: Any) -> Callable[[int, dict], None]:
    def log(step: int, m: dict) -> None:
        with log_path.open("a") as f:
            f.write(json.dumps({"step": step, **m}) + "\n")
        bar.set_postfix({"loss": f"{m['sft/loss']:.3f}"}, refresh=False)
        bar.update(1)
    return log


def _sft_saver(group: Any, ckpt_root: Path, fingerprint: str, keep: int) -> Callable[[int, dict], None]:
    def save(step: int, state: dict) -> None:
        ckpt = ckpt_root / f"step_{step}"
        shutil.rmtree(ckpt, ignore_errors=True)
        group.save_checkpoint(str(ckpt), state)
        (ckpt / "sft_state.json").write_text(json.dumps({**state, "fingerprint": fingerprint}))
        (ckpt / "COMPLETE").write_text("")
        done = sorted((p for p in ckpt_root.glob("step_*") if (p / "COMPLETE").exists()),
                      key=lambda p: int(p.name.split("_")[1]))
        for old in done[:-max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
    return save


def _sft_resume(cfg: DictConfig, group: Any, log_path: Path, bar: Any, fingerprint: str) -> dict | None:
    """The state of the newest SFT checkpoint of this same stage (`resume: auto`), or None after clearing what an
    earlier run left."""
    resume = None
    ckpt = latest_checkpoint(cfg.output_dir, "sft_checkpoints") if cfg.resume == "auto" else None
    if ckpt is not None and json.loads((ckpt / "sft_state.json").read_text())["fingerprint"] != fingerprint:
        say(f"sft: {ckpt} was written by a different SFT stage (recipe or data); starting over")
    elif ckpt is not None:
        resume = group.load_checkpoint(str(ckpt))
        truncate_metrics(log_path, int(resume["step"]))
        bar.update(int(resume["step"]))
        say(f"sft: resumed from {ckpt} at step {resume['step']}")
    if resume is None:
        log_path.unlink(missing_ok=True)
        shutil.rmtree(Path(cfg.output_dir) / "sft_checkpoints", ignore_errors=True)
    return resume
