"""The stage pipeline of one recipe: model → data → (SFT warm-up) → RL → evaluation → export.

Each stage reads and writes artifacts by path inside `output_dir`, so a re-run (or `resume=auto`)
skips what is already complete.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import DictConfig

from cluster.learner import LearnerDied
from cluster.ray_utils import actor_env, init_ray, make_placement
from rewards.service import RewardService, RewardSpec
from rl.config import as_container, to_yaml
from rl.data import format_prompt, load_rows
from rl.evaluate import evaluate
from rl.registry import check_params
from rl.sft import run_sft
from rl.tracking import MetricsLogger
from rl.trainer import RLTrainer, latest_checkpoint, make_learner_group, model_family
from rollout.hf_engine import load_tokenizer


def prepare_model(cfg: DictConfig, out: Path) -> str:
    """The base model folder: `model.path`, or a tiny model and tokenizer built in code."""
    if cfg.model.path:
        if not Path(cfg.model.path).exists():
            raise FileNotFoundError(f"model.path: {cfg.model.path!r} does not exist")
        return str(cfg.model.path)
    from models.tiny import save_tiny
    path = out / "base_model"
    key = fingerprint(cfg.seed, cfg.model.tiny)
    if not _artifact_matches(path, key):
        t = cfg.model.tiny
        shutil.rmtree(path, ignore_errors=True)
        save_tiny(path, seed=cfg.seed, arch=t.arch, loops=t.loops, hidden_size=t.hidden_size, num_layers=t.num_layers,
                  num_heads=t.num_heads, intermediate_size=t.intermediate_size,
                  max_position_embeddings=t.max_position_embeddings)
        _mark_artifact(path, key)
    return str(path)


ARTIFACT_MARKER = "LOOPRL_ARTIFACT"


def fingerprint(*parts: Any) -> str:
    """Stable hash of the config parts an artifact was built from."""
    blob = json.dumps([as_container(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fingerprint_file(model_dir: str) -> str:
    """Identity of a model folder: its marker when looprl built it, else its path."""
    marker = Path(model_dir) / ARTIFACT_MARKER
    return marker.read_text().strip() if marker.exists() else str(Path(model_dir).resolve())


def _artifact_matches(path: Path, key: str) -> bool:
    """An artifact folder is reused only when it is complete and was built from the same config."""
    marker = path / ARTIFACT_MARKER
    return marker.exists() and marker.read_text().strip() == key


def _mark_artifact(path: Path, key: str) -> None:
    (path / ARTIFACT_MARKER).write_text(key)


def prepare_data(cfg: DictConfig, out: Path) -> dict[str, str | None]:
    """Paths of the sft/train/eval sets; the embedded synthetic task fills what the recipe leaves null."""
    d = cfg.data
    paths: dict[str, str | None] = {"train": d.train_path, "eval": d.eval_path, "sft": d.sft_path}
    need_sft = cfg.sft.enabled and d.sft_path is None
    if d.train_path is None or need_sft:
        s = d.synthetic
        if s.task in ("facts", "plans"):  # facts: its evidence corpus lands in the same folder, data/corpus.txt
            from rl.synthetic_facts import write_facts_task
            from rl.synthetic_plans import write_plans_task
            write_task = {"facts": write_facts_task, "plans": write_plans_task}[s.task]
            n_sft = int(s.num_train * s.sft_fraction)
            synth = write_task(out / "data", num_sft=n_sft, num_train=s.num_train - n_sft, num_eval=s.num_eval,
                               seed=s.seed)
        else:
            from rl.synthetic import write_synthetic_task
            synth = write_synthetic_task(out / "data", num_train=s.num_train, num_eval=s.num_eval,
                                         sft_fraction=s.sft_fraction, wrong_order_fraction=s.wrong_order_fraction,
                                         seed=s.seed)
        if d.train_path is None:  # the synthetic task's held-out split goes with its training split
            paths["train"] = synth["train"]
            paths["eval"] = d.eval_path or (synth["eval"] if s.num_eval > 0 else None)
        if need_sft:
            paths["sft"] = synth["sft"]
    return paths


def check_components(cfg: DictConfig, model_path: str) -> None:
    """Resolve every named component of the recipe and check its parameters before any actor starts:
    advantage, loss (its inputs against the model family's outputs), optimizer, schedulers."""
    from rl.batch import NAMED_FIELDS
    from rl.losses import LOSS_INPUTS
    from rl.registry import get, required_parameters
    a, lc = cfg.algorithm, cfg.learner
    check_params("advantage", a.advantage, as_container(a.advantage_params), "algorithm.advantage_params",
                 supplied=("rewards", "group_id", "response_mask", *NAMED_FIELDS))
    family_name = model_family(cfg, model_path)
    family = get("family", family_name)
    check_params("loss", a.loss, as_container(a.loss_params), "algorithm.loss_params",
                 supplied=(*LOSS_INPUTS, *family.outputs))
    missing = [n for n in required_parameters(get("loss", a.loss))[4:]
               if n not in (*LOSS_INPUTS, *family.outputs, *NAMED_FIELDS, *a.loss_params)]
    if missing:
        raise ValueError(f"algorithm.loss: loss {a.loss!r} needs {missing}, which model family {family_name!r} "
                         f"(model.family: {cfg.model.family}) does not provide; it provides {list(family.outputs)}")
    check_params("optimizer", lc.optimizer.name, as_container(lc.optimizer.params), "learner.optimizer.params",
                 supplied=("params", "lr", "weight_decay"))
    if getattr(get("optimizer", lc.optimizer.name), "forward_only", False) and lc.zero_stage != 0:
        raise ValueError(f"learner.optimizer {lc.optimizer.name!r} is forward-only (it perturbs the full weights on "
                         f"every rank): it needs learner.zero_stage 0, got {lc.zero_stage}")
    for key, sched in (("learner.scheduler", lc.scheduler), ("sft.scheduler", cfg.sft.scheduler)):
        check_params("scheduler", sched.name, as_container(sched.params), f"{key}.params",
                     supplied=("optimizer", "warmup_steps", "total_steps"))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _say(msg: str) -> None:
    print(f"[looprl] {msg}", file=sys.stderr, flush=True)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run every stage of the recipe and return the summary (also written to summary.json)."""
    t_run = time.perf_counter()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    seed_everything(cfg.seed)

    model_path = prepare_model(cfg, out)
    tokenizer = load_tokenizer(model_path)
    paths = prepare_data(cfg, out)
    d = cfg.data
    train_rows = load_rows(paths["train"], [d.prompt_column, d.answer_column], "data.train_path")
    eval_rows = load_rows(paths["eval"], [d.prompt_column, d.answer_column], "data.eval_path") \
        if paths["eval"] else []
    sft_rows = load_rows(paths["sft"], [d.prompt_column, d.target_column], "data.sft_path") \
        if cfg.sft.enabled else []

    ckpt = None
    if cfg.resume == "auto":
        ckpt = latest_checkpoint(out)
    elif cfg.resume != "no":
        ckpt = Path(cfg.resume)

    check_components(cfg, model_path)
    check_params("engine", cfg.rollout.engine, as_container(cfg.rollout.engine_params), "rollout.engine_params",
                 supplied=("model_path", "dtype", "device", "trust_remote_code", "batch_size"))
    for name, judge in cfg.reward.judges.items():
        check_params("engine", judge.engine, as_container(judge.engine_params), f"reward.judges.{name}.engine_params",
                     supplied=("model_path", "dtype", "device"))
    specs = [RewardSpec(f.remote or f.name, f.weight, as_container(f.params), f.label, f.eval_only)
             for f in cfg.reward.functions]
    RewardService(specs, num_workers=1).close()  # load plugins in the driver: a bad one fails here, early
    from rewards.remote import check_health, is_remote
    for spec in specs:
        if is_remote(spec.name):
            check_health(spec.name)
    mode = init_ray(cfg.cluster.address, cfg.cluster.num_cpus)
    _say(f"ray: {mode} cluster, resources {ray.cluster_resources()}")
    reward_service = ray.remote(RewardService).options(
        num_cpus=0, runtime_env={"env_vars": actor_env()}).remote(
        specs, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
        failure_reward=cfg.reward.failure_reward)
    use_gpu = torch.cuda.is_available() or ray.cluster_resources().get("GPU", 0) > 0
    lc = cfg.learner
    placement = make_placement(lc.world_size, cfg.rollout.num_workers, lc.num_cpus, cfg.rollout.num_cpus,
                               cfg.cluster.placement, cfg.cluster.placement_strategy, use_gpu=use_gpu,
                               learner_resources=as_container(cfg.cluster.learner_resources),
                               rollout_resources=as_container(cfg.cluster.rollout_resources))
    summary: dict[str, Any] = {}
    trainer = None
    try:
        policy_path = model_path
        if cfg.sft.enabled:
            policy_path = str(out / "sft_model")
            key = fingerprint(cfg.seed, cfg.model, cfg.sft, cfg.data, cfg.learner.world_size, cfg.learner.zero_stage,
                              cfg.learner.micro_batch_size, cfg.learner.grad_clip, fingerprint_file(model_path))
            if not _artifact_matches(Path(policy_path), key):
                shutil.rmtree(policy_path, ignore_errors=True)
                summary.update(_sft_stage(cfg, model_path, policy_path, tokenizer, sft_rows, placement))
                _mark_artifact(Path(policy_path), key)
            else:
                _say(f"sft: reusing {policy_path} (built from the same recipe)")

        judges = _start_judges(cfg, policy_path, reward_service, summary)
        trainer = RLTrainer(cfg, policy_path, tokenizer, train_rows, placement, reward_service)
        before_path = out / "eval_before.json"
        if ckpt is None:  # a fresh run: no metrics from an earlier run in this folder
            (out / "metrics.jsonl").unlink(missing_ok=True)
        else:
            trainer.load_checkpoint(ckpt)
            _truncate_metrics(out / "metrics.jsonl", trainer.step_idx)
            _say(f"resumed from {ckpt} at step {trainer.step_idx}")
        if eval_rows and before_path.exists() and ckpt is not None:
            before = json.loads(before_path.read_text())
        elif eval_rows:
            before = evaluate(trainer.rollout, reward_service, tokenizer, cfg, eval_rows)
            before_path.write_text(json.dumps(before))
        else:
            before = None
        if before is not None:
            _say(f"held-out accuracy before RL: {before['accuracy']:.3f} ({int(before['num_prompts'])} prompts)")

        tc = cfg.trainer
        logger = MetricsLogger(out, tc.steps, tensorboard=cfg.logging.tensorboard,
                               wandb_project=cfg.logging.wandb_project, progress_bar=cfg.logging.progress_bar,
                               config=as_container(cfg), start_step=trainer.step_idx)
        last: dict[str, float] = {}
        t_rl = time.perf_counter()
        try:
            while trainer.step_idx < tc.steps:
                try:
                    metrics = trainer.step()
                except LearnerDied as exc:
                    ckpt = latest_checkpoint(out)
                    where = (f"resume with resume=auto from {ckpt}" if ckpt is not None else
                             "no checkpoint had been written yet (set trainer.checkpoint_every)")
                    raise LearnerDied(f"{exc} at step {trainer.step_idx + 1}; the run stopped, {where}") from exc
                step = trainer.step_idx
                if eval_rows and tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
                    ev = evaluate(trainer.rollout, reward_service, tokenizer, cfg, eval_rows)
                    metrics["eval/accuracy"] = ev["accuracy"]
                    metrics.update({f"eval/reward/{k}": v for k, v in ev["components"].items()})
                logger.log(step, metrics)
                last = metrics
                if tc.checkpoint_every and step % tc.checkpoint_every == 0:
                    trainer.save_checkpoint()
        finally:
            logger.close()
        rl_s = time.perf_counter() - t_rl
        if not tc.checkpoint_every or trainer.step_idx % tc.checkpoint_every:
            trainer.save_checkpoint()
        summary.update({k: v for k, v in last.items()})
        summary["steps"] = trainer.step_idx
        summary["rl_wall_s"] = rl_s
        summary["peak_rss_gib"] = trainer.peak_memory()
        summary["actor_nodes"] = trainer.actor_nodes()
        if eval_rows:
            after = evaluate(trainer.rollout, reward_service, tokenizer, cfg, eval_rows)
            summary["accuracy_before_rl"] = before["accuracy"]
            summary["accuracy_after_rl"] = after["accuracy"]
            summary["heldout_rewards_before_rl"] = before.get("components", {})
            summary["heldout_rewards_after_rl"] = after["components"]
            summary["eval_examples_after_rl"] = after["examples"]
            _say(f"held-out accuracy: before RL {before['accuracy']:.3f} -> after RL {after['accuracy']:.3f}")
        if tc.save_hf:
            hf_dir = out / "hf_model"
            trainer.learners.save_hf(str(hf_dir), tokenizer_path=model_path)
            summary["hf_model"] = str(hf_dir)
        for name, client in judges.items():  # a judge never receives weights: show it
            if name in summary.get("judges", {}):
                summary["judges"][name]["weights_sha256_end"] = client.weights_sha256()
    finally:
        if trainer is not None:
            trainer.close()
        ray.kill(reward_service)
        placement.remove()
    summary["wall_s"] = time.perf_counter() - t_run
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _start_judges(cfg: DictConfig, policy_path: str, reward_service: Any, summary: dict) -> dict[str, Any]:
    """Start `reward.judges` (null model paths: the initial policy) and hand them to the reward service;
    judges record the digest of their weights now and at the end of the run."""
    if not cfg.reward.judges:
        return {}
    from rewards.judges import start_judges
    judges = as_container(cfg.reward.judges)
    for judge in judges.values():  # the grader of a chat policy is asked the way the policy is
        if judge["chat_template"] is None:
            judge["chat_template"] = cfg.data.chat_template
    clients = start_judges(judges, policy_path, env=actor_env())
    ray.get(reward_service.set_judges.remote(clients))
    summary["judges"] = {name: {"model": judges[name]["model_path"] or policy_path, "engine": judges[name]["engine"],
                                "weights_sha256_start": clients[name].weights_sha256()}
                         for name in clients}
    started = [f"{name} ({len(c.workers)} x {judges[name]['engine']})" for name, c in clients.items()]
    _say("judges: " + ", ".join(started))
    return clients


def _sft_stage(cfg: DictConfig, model_path: str, out_path: str, tokenizer: Any, rows: list[dict],
               placement: Any) -> dict[str, float]:
    s, lc, d = cfg.sft, cfg.learner, cfg.data
    _say(f"sft: {s.steps} steps, batch {s.batch_size}, lr {s.lr}")
    grad_accum = max(1, -(-s.batch_size // (lc.world_size * lc.micro_batch_size)))
    group = make_learner_group(cfg, model_path, placement, lr=s.lr, weight_decay=s.weight_decay,
                               micro_batch_size=min(lc.micro_batch_size, s.batch_size // lc.world_size),
                               grad_accum=grad_accum, scheduler=s.scheduler, warmup_steps=s.warmup_steps,
                               total_steps=s.steps)
    out = Path(out_path)
    log_path = Path(cfg.output_dir) / "sft_metrics.jsonl"
    log_path.unlink(missing_ok=True)
    from tqdm import tqdm
    bar = tqdm(total=s.steps, desc="sft", file=sys.stderr, mininterval=2.0, disable=not cfg.logging.progress_bar)

    def log(step: int, m: dict) -> None:
        with log_path.open("a") as f:
            f.write(json.dumps({"step": step, **m}) + "\n")
        bar.set_postfix({"loss": f"{m['sft/loss']:.3f}"}, refresh=False)
        bar.update(1)

    t0 = time.perf_counter()
    try:
        hist = run_sft(group, tokenizer, rows, prompt_key=d.prompt_column, target_key=d.target_column,
                       steps=s.steps, batch_size=s.batch_size, grad_accum=grad_accum, seed=cfg.seed,
                       format_prompt=lambda p: format_prompt(p, tokenizer, d.prompt_prefix, d.chat_template),
                       log=log)
        bar.close()
        group.save_hf(str(out), tokenizer_path=model_path)
    finally:
        group.shutdown()
    return {"sft_final_loss": hist[-1]["sft/loss"], "sft_wall_s": time.perf_counter() - t0}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines written after the checkpoint we resume from (they will be produced again)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))
