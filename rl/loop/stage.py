"""The `rl` stage: the RL loop with a held-out evaluation before it, evaluations and checkpoints every few steps,
checkpoint selection by a held-out metric (`trainer.select_by`), `resume`, and metrics logging. The actors come
from the driver's runtime (`ctx.runtime.start_rl_roles`); they stay alive for the stages after it (export,
evaluate)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from models.tokenizer import load_tokenizer
from rl.algorithm import RLAlgorithm
from rl.config import ConfigError, as_container
from rl.data import load_rows, prompt_row_columns
from rl.loop.checkpoints import improves, latest_checkpoint, prune_checkpoints, selected_checkpoint
from rl.loop.roles import LearnerFailed
from rl.loop.tracking import MetricsLogger, truncate_metrics
from rl.loop.trainer import RLTrainer
from rl.registry import register
from rl.stages import Stage, StageContext, say, stage_cfg


@register("stage", "rl")
class RLStage(Stage):
    """The RL loop (`rl.loop.trainer`) on the stage's policy and training rows."""
    reads, publishes = ("train", "policy", "base_model"), ("checkpoint",)  # checked against the recipe's order
    runs_in_driver = True

    def run(self, ctx: StageContext) -> dict[str, str]:
        run = RLRun(ctx)
        run.evaluate_before()
        last = run.train()
        return run.finish(last)


class RLRun:
    """One `rl` stage's run: its recipe, rows, tokenizer, trainer (resumed with `resume`) and output folder."""

    def __init__(self, ctx: StageContext):
        self.cfg = cfg = stage_cfg(ctx)
        self.summary, self.out, d = ctx.summary, ctx.output_dir, cfg.data
        train_path = ctx.require("train")
        train_rows = load_rows(train_path, prompt_row_columns(d), "data.train_path", bad_rows=d.bad_rows)
        self.summary.update(rl_train_path=train_path, rl_train_rows=len(train_rows))
        self.eval_rows = ctx.rows("eval", prompt_row_columns(d))
        policy_path = ctx.require("policy")
        tokenizer = load_tokenizer(ctx.require("base_model"))
        rt = ctx.runtime
        rt.judges = rt.serve_reward_judges(cfg, policy_path, ctx.summary, ctx.require)
        algorithm = RLAlgorithm(cfg)
        roles = rt.start_rl_roles(cfg, algorithm, policy_path, tokenizer)
        self.trainer = RLTrainer(cfg, algorithm, roles, tokenizer, train_rows)
        self.roles = roles
        self._resume()

    def _resume(self) -> None:
        """The checkpoint `resume` names (`auto`: the newest complete one); a fresh run clears the metrics and
        selection an earlier run left in the folder."""
        cfg, out = self.cfg, self.out
        ckpt = latest_checkpoint(out) if cfg.resume == "auto" else None if cfg.resume == "no" else Path(cfg.resume)
        if ckpt is None:
            for name in ("metrics.jsonl", "checkpoints/best.json", "eval_before.json"):
                (out / name).unlink(missing_ok=True)
            return
        self.trainer.load_checkpoint(ckpt)
        truncate_metrics(out / "metrics.jsonl", self.trainer.step_idx)
        say(f"resumed from {ckpt} at step {self.trainer.step_idx}")

    def evaluate_before(self) -> None:
        """The held-out evaluation before RL (read back when a resumed run recorded it)."""
        if not self.eval_rows:
            return
        path = self.out / "eval_before.json"
        if path.exists():
            before = json.loads(path.read_text())
        else:
            before = self.roles.evaluate(self.eval_rows)
            path.write_text(json.dumps(before))
        say(f"held-out accuracy before RL: {before['accuracy']:.3f} ({int(before['num_prompts'])} prompts)")
        self.summary["accuracy_before_rl"] = before["accuracy"]
        self.summary["heldout_rewards_before_rl"] = before.get("components", {})

    def train(self) -> dict[str, float]:
        """The RL steps up to `trainer.steps`: held-out evaluations, checkpoint selection, metrics, checkpoints;
        returns the last step's metrics."""
        cfg, tc, trainer, last = self.cfg, self.cfg.trainer, self.trainer, {}
        logger = MetricsLogger(self.out, tc.steps, tensorboard=cfg.logging.tensorboard,
                               wandb_project=cfg.logging.wandb_project, progress_bar=cfg.logging.progress_bar,
                               config=as_container(cfg), start_step=trainer.step_idx,
                               mlflow_tracking_uri=cfg.logging.mlflow_tracking_uri,
                               mlflow_experiment=cfg.logging.mlflow_experiment)
        t0 = time.perf_counter()
        try:
            while trainer.step_idx < tc.steps:
                metrics = self._step_or_explain()
                step = trainer.step_idx
                self._evaluate(step, metrics)
                # wall time of this process's RL steps so far, evaluations included: the x-axis of a curve
                # against wall time (perf/step_s leaves out what runs between steps)
                metrics["perf/elapsed_s"] = time.perf_counter() - t0
                logger.log(step, metrics)
                last = metrics
                if (tc.checkpoint_every and step % tc.checkpoint_every == 0
                        and not (self.out / "checkpoints" / f"step_{step}").exists()):
                    trainer.save_checkpoint()
        finally:
            logger.close()
        self.summary["rl_wall_s"] = time.perf_counter() - t0
        return last

    def _step_or_explain(self) -> dict[str, float]:
        """One RL step; a learner that failed stops the run with the step and where it can resume from."""
        try:
            return self.trainer.step()
        except LearnerFailed as exc:
            ckpt = latest_checkpoint(self.out)
            where = (f"resume with resume=auto from {ckpt}" if ckpt is not None else
                     "no checkpoint had been written yet (set trainer.checkpoint_every)")
            raise type(exc)(f"{exc} at step {self.trainer.step_idx + 1}; the run stopped, {where}") from exc

    def _evaluate(self, step: int, metrics: dict[str, float]) -> None:
        """The held-out evaluation every `trainer.eval_every` steps (and of the last step when selecting), into
        `metrics`; with `trainer.select_by`, the checkpoint selection."""
        tc = self.cfg.trainer
        # with select_by the last step is a candidate too, so it is evaluated like the others
        evaluates = tc.eval_every and step % tc.eval_every == 0 and (step < tc.steps or tc.select_by)
        if not self.eval_rows or not (evaluates or (tc.select_by and step == tc.steps)):
            return
        t0 = time.perf_counter()
        ev = self.roles.evaluate(self.eval_rows)
        metrics["time/eval"] = time.perf_counter() - t0
        metrics["eval/accuracy"] = ev["accuracy"]
        if ev["runs"] > 1:
            metrics["eval/accuracy_std_over_runs"] = ev["accuracy_std_over_runs"]
        metrics.update({f"eval/reward/{k}": v for k, v in ev["components"].items()})
        if tc.select_by:
            self._select_checkpoint(metrics)

    def _select_checkpoint(self, metrics: dict[str, float]) -> None:
        """`trainer.select_by`: a checkpoint of this step when its held-out metric beats the selected one's."""
        tc, out, trainer = self.cfg.trainer, self.out, self.trainer
        if tc.select_by not in metrics:
            raise ConfigError(f"trainer.select_by: the evaluation logged no {tc.select_by!r}; it logged "
                              f"{sorted(k for k in metrics if k.startswith('eval/'))}")
        value, best = float(metrics[tc.select_by]), selected_checkpoint(out)
        if not improves(value, best, tc.select_mode):
            return
        ckpt = out / "checkpoints" / f"step_{trainer.step_idx}"
        if not (ckpt / "COMPLETE").exists():
            ckpt = trainer.save_checkpoint()
        (out / "checkpoints" / "best.json").write_text(json.dumps(
            {"checkpoint": ckpt.name, "step": trainer.step_idx, "metric": tc.select_by, "value": value}))
        prune_checkpoints(out / "checkpoints", tc.keep_checkpoints)  # the one selected before may go now

    def finish(self, last: dict[str, float]) -> dict[str, str]:
        """The final checkpoint and the summary; with `trainer.select_by`, the selected checkpoint restored into
        the live run for the stages after it (export, evaluate)."""
        trainer, out = self.trainer, self.out
        final = out / "checkpoints" / f"step_{trainer.step_idx}"
        if not (final / "COMPLETE").exists():
            final = trainer.save_checkpoint()
        self.summary.update(last)
        self.summary.update(steps=trainer.step_idx, peak_rss_gib=self.roles.peak_memory(),
                            actor_nodes=self.roles.actor_nodes(), last_checkpoint=str(final))
        best = selected_checkpoint(out) if self.cfg.trainer.select_by else None
        if best is None:
            return {"checkpoint": str(final)}
        # the later stages (export, evaluate) use the selected checkpoint
        self.summary.update(selected_step=best["step"], selected_by=best["metric"], selected_value=best["value"])
        say(f"selected checkpoint: step {best['step']} ({best['metric']} = {best['value']:.4f})")
        selected = out / "checkpoints" / best["checkpoint"]
        if selected != final:
            trainer.restore(selected)
        return {"checkpoint": str(selected)}
