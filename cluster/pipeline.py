"""The built-in stages of a recipe and the run that drives them: model → data → sft → rl → export → evaluate
(the default `stages:` list; see `rl/stages.py` for the contract, fingerprints and reuse).

Stage artifacts: `model` publishes `policy` (and `base_model`), `data` the `train`/`eval`/`sft` data files,
`sft` the warmed-up `policy`, `rl` its final `checkpoint`, `export` the trained `policy` (`hf_model/`).
A user stage placed among them replaces what it publishes for the stages after it (e.g. a data-selection
stage's `train`). `export` comes before `evaluate` so that an evaluation re-run after a reused RL stage
can load the exported policy; both read the same weights, so the order changes no figure.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import DictConfig

from cluster.evaluation import evaluate, worker_protocol
from cluster.roles import make_learner_group
from cluster.runtime import Runtime
from cluster.stage_runner import check_only_stage, make_stage, run_stages
from models.tokenizer import load_tokenizer
from rewards.remote import check_health, is_remote
from rewards.service import RewardService, RewardSpec
from rl.config import ConfigError, as_container, to_yaml
from rl.data import load_rows, prompt_row_columns
from rl.recipe import model_family
from rl.registry import lookup, register
from rl.sft_data import load_sft_rows, sft_examples
from rl.stages import Stage, StageContext, StageError, check_stage_order, say, stage_cfg
from rl.tools import SANDBOX_ENV
from rl.validation import check_components
from rollout.weight_sync import pack_state


def prepare_model(cfg: DictConfig, out: Path) -> str:
    """The base model folder: `model.path`, or a tiny model and tokenizer built in code."""
    if cfg.model.path:
        if not Path(cfg.model.path).exists():
            raise FileNotFoundError(f"model.path: {cfg.model.path!r} does not exist")
        return str(cfg.model.path)
    # built again whenever the model stage runs (its record decides reuse); seeded, so the same folder
    from models.tiny import save_tiny
    path = out / "base_model"
    t = cfg.model.tiny
    shutil.rmtree(path, ignore_errors=True)
    added = list(t.added_tokens) + (list(getattr(lookup("task", cfg.data.synthetic.task), "added_tokens", []))
                                    if t.task_tokens else [])
    save_tiny(path, seed=cfg.seed, arch=t.arch, loops=t.loops, added_tokens=added, norm_placement=t.norm_placement,
              hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
              intermediate_size=t.intermediate_size, max_position_embeddings=t.max_position_embeddings)
    return str(path)


def prepare_data(cfg: DictConfig, out: Path) -> dict[str, str | None]:
    """Paths of the sft/train/eval sets; the embedded synthetic task fills what the recipe leaves null."""
    d = cfg.data
    paths: dict[str, str | None] = {"train": d.train_path, "eval": d.eval_path, "sft": d.sft_path}
    need_sft = cfg.sft.enabled and d.sft_path is None
    if d.train_path is None or need_sft:
        s = d.synthetic
        common = {k: v for k, v in as_container(s).items() if k != "params"}
        synth = lookup("task", s.task)(out / "data", **common, **as_container(s.params))
        if d.train_path is None:  # the synthetic task's held-out split goes with its training split
            paths["train"] = synth["train"]
            paths["eval"] = d.eval_path or (synth["eval"] if s.num_eval > 0 else None)
        if need_sft:
            paths["sft"] = synth["sft"]
        paths.update({k: v for k, v in synth.items() if k not in ("train", "eval", "sft")})  # e.g. solver_eval
    return paths


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@register("stage", "model")
class ModelStage(Stage):
    """The base model folder: `model.path`, or a tiny model and tokenizer built in code."""
    reads, publishes = (), ("base_model", "policy")  # checked against the recipe's order
    config_keys = ("seed", "model.path", "model.tiny", "data.synthetic.task")  # the task's phrases may be tokens
    runs_in_driver = True

    def input_files(self, cfg: DictConfig) -> list[str | None]:
        return [cfg.model.path]

    def run(self, ctx: StageContext) -> dict[str, str]:
        path = prepare_model(ctx.cfg, ctx.output_dir)
        return {"base_model": path, "policy": path}


@register("stage", "data")
class DataStage(Stage):
    """The sft/train/eval data files; the embedded synthetic task fills what the recipe leaves null."""
    reads, publishes = (), ("train", "eval", "sft", "sft_val")  # checked against the recipe's order
    config_keys = ("data", "sft.enabled")
    runs_in_driver = True

    def input_files(self, cfg: DictConfig) -> list[str | None]:
        return [cfg.data.train_path, cfg.data.eval_path, cfg.data.sft_path]

    def run(self, ctx: StageContext) -> dict[str, str]:
        cfg, d = ctx.cfg, ctx.cfg.data
        paths = {k: v for k, v in prepare_data(cfg, ctx.output_dir).items() if v}
        # read every split now: a missing file, column or empty set fails here, before any training
        for split, path in paths.items():
            if split in ("train", "eval"):
                load_rows(path, prompt_row_columns(d), f"data.{split}_path", bad_rows=d.bad_rows)
            elif split == "sft" and cfg.sft.enabled:
                load_sft_rows(path, "data.sft_path", cfg.sft, d)
        return paths


@register("stage", "sft")
class SFTStage(Stage):
    """Supervised fine-tuning of the policy on the learner group (`sft`; nothing when `sft.enabled` is false), on
    `data.sft_path` (prompt/response or chat rows, `rl.sft_data`) or the synthetic task's SFT split; held-out loss
    on `sft.eval_path` or an `sft.eval_fraction` of the rows; checkpoints every `sft.save_every` steps, from which
    `resume: auto` continues."""
    reads, publishes = ("policy",), ("policy",)  # checked against the recipe's order
    config_keys = ("seed", "model", "sft", "data", "learner.world_size", "learner.zero_stage",
                   "learner.micro_batch_size", "learner.grad_clip", "learner.optimizer", "learner.pack_sequences",
                   "learner.max_tokens_per_micro_batch", "learner.share_prompts")
    runs_in_driver = True

    def input_files(self, cfg: DictConfig) -> list[str | None]:
        return [cfg.sft.eval_path]

    def run(self, ctx: StageContext) -> dict[str, str]:
        cfg = stage_cfg(ctx)
        if not cfg.sft.enabled:
            return {}
        s = cfg.sft
        path = ctx.artifact("sft")
        if path is None:
            raise ConfigError("sft.enabled: no SFT data (set data.sft_path, or a data.synthetic task with an SFT split)")
        base = ctx.require("policy")
        tokenizer = load_tokenizer(base)
        examples, dropped = sft_examples(tokenizer, path, "data.sft_path", s, cfg.data)
        held_path = s.eval_path or ctx.artifact("sft_val")
        if held_path:
            held_out, _ = sft_examples(tokenizer, held_path, "sft.eval_path", s, cfg.data)
        else:
            examples, held_out = split_held_out(examples, s.eval_fraction, cfg.seed)
        if dropped:
            say(f"sft: dropped {sum(dropped.values())} bad rows of {path} ({dropped})")
        out_path = str(ctx.output_dir / "sft_model")
        shutil.rmtree(out_path, ignore_errors=True)
        ordered = s.sampler == "sequential" or (s.sampler == "auto" and ctx.artifact("sft_ordering") is not None)
        if ordered:
            say("sft: the rows are drawn in their order (sequential sampler)")
        ctx.runtime.release_trainer()  # an RL stage before this one holds the learner bundles the fine-tune needs
        summary = ctx.runtime.fine_tune(cfg, base, out_path, tokenizer, examples, eval_examples=held_out,
                                         fingerprint=ctx.fingerprint, shuffle=not ordered)
        ctx.summary.update(summary, sft_rows=len(examples), sft_eval_rows=len(held_out), sft_dropped_rows=dropped,
                           sft_sampler="sequential" if ordered else "shuffle")
        return {"policy": out_path}


def split_held_out(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """A seeded held-out share `fraction` of `examples` (at least one when `fraction > 0`; at least one stays)."""
    if fraction <= 0:
        return examples, []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n = min(len(examples) - 1, max(1, round(fraction * len(examples))))
    held = set(order[:n])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def _learners_with_rl_weights(ctx: StageContext) -> Any:
    """The live RL run's learners, or (RL reused from an earlier run) a learner group loaded from its checkpoint."""
    if ctx.runtime.rl_roles is not None:
        return ctx.runtime.rl_roles.learners, False
    cfg = ctx.cfg
    group = make_learner_group(cfg, ctx.require("policy"), ctx.runtime.placement, lr=cfg.learner.lr,
                               weight_decay=cfg.learner.weight_decay, micro_batch_size=cfg.learner.micro_batch_size,
                               grad_accum=1, scheduler=cfg.learner.scheduler, warmup_steps=0, total_steps=1)
    group.load_checkpoint(ctx.require("checkpoint"))
    return group, True


@register("stage", "export")
class ExportStage(Stage):
    """`save_pretrained` export of the trained policy to `output_dir/hf_model` (when `trainer.save_hf`)."""
    reads, publishes = ("base_model",), ("policy",)  # checked against the recipe's order
    config_keys = ("trainer.save_hf",)
    runs_in_driver = True

    def run(self, ctx: StageContext) -> dict[str, str]:
        if not ctx.cfg.trainer.save_hf or ctx.artifact("checkpoint") is None:
            return {}
        learners, own = _learners_with_rl_weights(ctx)
        hf_dir = ctx.output_dir / "hf_model"
        try:
            learners.save_hf(str(hf_dir), tokenizer_path=ctx.require("base_model"))
        finally:
            if own:
                learners.shutdown()
        ctx.summary["hf_model"] = str(hf_dir)
        return {"policy": str(hf_dir)}


@register("stage", "evaluate")
class EvaluateStage(Stage):
    """Held-out evaluation of the trained policy (`data.eval_path`; greedy at `rollout.eval_temperature`,
    `trainer.eval_max_prompts` prompts), scored by every reward function including eval_only judges.

    With `runs > 0`, also the benchmark protocol of `rl.evaluate` on the same prompts: mean@k over `runs`
    sampled runs (`temperature`, `top_p`, seeds `seed + r`), with `compare_before` the same runs of the
    policy before RL and their paired comparison, with `loops` greedy accuracy after each loop (looped
    models). The report is `output_dir/eval_after.json`."""
    reads, publishes = ("base_model", "policy"), ("report",)  # checked against the recipe's order
    config_keys = ("data", "rollout", "trainer.eval_max_prompts", "reward")
    runs_in_driver = True

    def __init__(self, runs: int = 0, temperature: float = 0.2, top_p: float = 0.95, seed: int = 0,
                 loops: list[int] | None = None, compare_before: bool = False):
        self.runs, self.temperature, self.top_p, self.seed = runs, temperature, top_p, seed
        self.loops, self.compare_before = list(loops or []), compare_before

    def run(self, ctx: StageContext) -> dict[str, str]:
        cfg, rt = stage_cfg(ctx), ctx.runtime
        d = cfg.data
        eval_rows = ctx.rows("eval", prompt_row_columns(d))
        if not eval_rows:
            return {}
        # RL was reused: evaluate its exported policy
        if rt.rl_roles is None and ctx.artifact("checkpoint") is not None and not cfg.trainer.save_hf:
            raise StageError("stage 'evaluate' needs the RL policy: set trainer.save_hf (export) or re-run rl")
        tokenizer = load_tokenizer(ctx.require("base_model"))
        with rt.rollout_workers(ctx, cfg) as workers:
            after = evaluate(workers, rt.reward_service, tokenizer, cfg, eval_rows)
            if self.runs or self.loops:
                after["protocol"] = self.protocol(ctx, workers, tokenizer, eval_rows)
        ctx.summary.update(accuracy_after_rl=after["accuracy"], heldout_rewards_after_rl=after["components"],
                           eval_examples_after_rl=after["examples"])
        if "protocol" in after:
            ctx.summary["eval_protocol"] = after["protocol"]
        record = ctx.output_dir / "eval_after.json"
        record.write_text(json.dumps(after))
        before = ctx.output_dir / "eval_before.json"
        before_acc = f"before RL {json.loads(before.read_text())['accuracy']:.3f} -> " if before.exists() else ""
        trained = "after RL" if ctx.artifact("checkpoint") is not None else "of the policy"
        say(f"held-out accuracy: {before_acc}{trained} {after['accuracy']:.3f}")
        return {"report": str(record)}

    def protocol(self, ctx: StageContext, workers: list[Any], tokenizer: Any, rows: list[dict]) -> dict[str, Any]:
        from rl.evaluate import mean_at_k, paired_comparison, per_loop_accuracy, protocol_scores
        cfg, rt = stage_cfg(ctx), ctx.runtime
        generate, score = worker_protocol(workers, rt.reward_service, tokenizer, cfg, rows)
        runs = dict(runs=self.runs, temperature=self.temperature, top_p=self.top_p, seed=self.seed)
        out: dict[str, Any] = {"config": {**runs, "loops": self.loops}}
        after = protocol_scores(generate, score, **runs) if self.runs else None
        if after is not None:
            out["mean_at_k"] = mean_at_k(after)
        if self.loops:
            out["per_loop_accuracy"] = per_loop_accuracy(generate, score, self.loops, seed=self.seed)
        if self.compare_before and after is not None:
            # the same workers with the policy the RL stage started from, then the RL weights back
            before_path = ctx.artifact_before("policy", "checkpoint")
            state = pack_state(lookup("family", model_family(cfg, before_path))().load(before_path).state_dict())
            ray.get([w.load_weights.remote(state, -1) for w in workers])
            before = protocol_scores(generate, score, **runs)
            out.update(before_policy=before_path, mean_at_k_before=mean_at_k(before),
                       paired=paired_comparison(after, before))
            if rt.rl_roles is not None:
                rt.rl_roles.sync_weights(rt.rl_roles.version)
        return out


def check_recipe(cfg: DictConfig, model_path: str | None, only_stage: str | None = None) -> None:
    """Everything about the recipe that can fail before Ray starts, the same for `looprl run`, `config show`,
    `submit` and `slurm`: its components and their parameters (`rl.validation.check_components`; where the model
    is on this machine or built in code), the reward plug-ins, and the stages (`check_stages`)."""
    if model_path is None or Path(model_path).exists():
        check_components(cfg, model_path)
    for f in cfg.reward.functions:  # a plug-in file that fails to import fails now, naming it
        if not (f.remote or is_remote(f.name)):
            lookup("reward", f.name)
    check_stages(cfg, only_stage)
    check_memory_plan(cfg, model_path)


def check_memory_plan(cfg: DictConfig, model_path: str | None) -> None:
    """An RL run whose roles cannot fit its GPUs is refused now, naming the change that would make it fit
    (`cluster.plan`); skipped without GPUs (a CPU run) or when the model's config is not on this machine."""
    from cluster.plan import check_fits, run_devices
    if not any(s.name == "rl" for s in cfg.stages) or not _config_here(model_path if model_path is not None
                                                                         else cfg.model.path):
        return
    devices = run_devices(cfg)
    if devices is not None:
        check_fits(cfg, devices, cfg.cluster.plan_prompt_tokens)


def _config_here(path: str | None) -> bool:
    """Whether the model's `config.json` can be read without a download (the tiny model's is built in code)."""
    if path is None or Path(path).exists():
        return True
    from transformers import AutoConfig
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return False
    return True


def check_stages(cfg: DictConfig, only_stage: str | None = None) -> None:
    """Every stage built with its parameters (a bad name or parameter names its `stages[i]`), their order against
    the artifacts each reads and publishes, and `--stage`."""
    built = [(entry.label or entry.name, make_stage(entry.name, as_container(entry.params), f"stages[{i}]"))
             for i, entry in enumerate(cfg.stages)]
    check_stage_order(built)
    check_only_stage([label for label, _ in built], only_stage)


def run(cfg: DictConfig, only_stage: str | None = None) -> dict[str, Any]:
    """Run the recipe's stages (or only `only_stage`) and return the summary (also written to summary.json)."""
    t_run = time.perf_counter()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    seed_everything(cfg.seed)
    os.environ[SANDBOX_ENV] = cfg.rollout.sandbox  # where model-written code runs, here and in every actor
    check_recipe(cfg, cfg.model.path, only_stage)
    specs = [RewardSpec(f.remote or f.name, f.weight, as_container(f.params), f.label, f.eval_only)
             for f in cfg.reward.functions]
    RewardService(specs, num_workers=1).close()  # load plugins in the driver: a bad one fails here, early
    for spec in specs:
        if is_remote(spec.name):
            check_health(spec.name)
    runtime = Runtime(cfg, specs)
    try:
        summary = run_stages(cfg, runtime, only=only_stage)
        for name, client in runtime.judges.items():  # a judge never receives weights: show it
            if name in summary.get("judges", {}):
                summary["judges"][name]["weights_sha256_end"] = client.weights_sha256()
    finally:
        runtime.close()
    summary["wall_s"] = time.perf_counter() - t_run
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


