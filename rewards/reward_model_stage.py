"""The `reward_model` stage: a Bradley–Terry reward model trained on pairwise preferences.

Reads local pairwise data (a prompt, a chosen and a rejected response per row: JSONL, Parquet, CSV or a
`datasets` folder), trains the policy's architecture with a one-output sequence head (models.families
`sequence_score`) on `-log sigmoid(r_chosen - r_rejected)` (rl.losses `bradley_terry`) through the DeepSpeed
learner group, saves it in transformers' format and measures its pair accuracy on held-out pairs with the
engine that serves it (`hf_classifier`). Its artifact `reward_model` is what a judge group serves to the
`reward_model` reward: `reward.judges.rm: {model_path: "artifact:reward_model", engine: hf_classifier}`.
"""

from __future__ import annotations

import random
import shutil
from typing import Any

from omegaconf import DictConfig

from rl.data import format_prompt, load_rows
from rl.registry import register
from rl.sft_data import make_sft_batch
from rl.stages import Stage, StageContext, say


def pair_batch(tokenizer: Any, rows: list[dict], prompt: str, chosen: str, rejected: str, chat_template: bool) -> Any:
    """Rows as (chosen, rejected) pairs of batch rows: chosen at even, rejected at odd positions."""
    prompts, responses = [], []
    for r in rows:
        p = format_prompt(r[prompt], tokenizer, chat_template=chat_template)
        prompts += [p, p]
        responses += [str(r[chosen]), str(r[rejected])]
    return make_sft_batch(tokenizer, prompts, responses)


@register("stage", "reward_model")
class RewardModelStage(Stage):
    """Bradley–Terry reward model on the pairs in `data` (`eval_data`, or the last `eval_fraction` of a seeded
    shuffle, held out); starts from `model_path` or the run's policy; `steps` optimizer steps of
    `batch_pairs` pairs at `lr` (learner.* gives ranks, ZeRO stage, optimizer, clipping)."""
    config_keys = ("seed", "model.dtype", "model.trust_remote_code", "data.chat_template", "learner.world_size",
                   "learner.zero_stage", "learner.grad_clip", "learner.optimizer", "learner.threads")
    runs_in_driver = True
    publishes = ("reward_model",)  # checked against the recipe's order

    def __init__(self, data: str, eval_data: str | None = None, prompt_column: str = "prompt",
                 chosen_column: str = "chosen", rejected_column: str = "rejected", model_path: str | None = None,
                 steps: int = 200, batch_pairs: int = 32, lr: float = 1e-4, eval_fraction: float = 0.1,
                 margin: float = 0.0):
        self.data, self.eval_data, self.model_path = data, eval_data, model_path
        self.reads = () if model_path else ("policy",)
        self.columns = (prompt_column, chosen_column, rejected_column)
        self.steps, self.batch_pairs, self.lr = steps, batch_pairs, lr
        self.eval_fraction, self.margin = eval_fraction, margin

    def input_files(self, cfg: DictConfig) -> list[str | None]:
        return [self.data, self.eval_data, self.model_path]

    def run(self, ctx: StageContext) -> dict[str, str]:
        from models.tokenizer import load_tokenizer
        from rollout.classifier_engine import ClassifierEngine
        cfg, key = ctx.cfg, "stages.reward_model.params"
        rows = load_rows(self.data, list(self.columns), f"{key}.data")
        if self.eval_data:
            held = load_rows(self.eval_data, list(self.columns), f"{key}.eval_data")
        else:
            random.Random(cfg.seed).shuffle(rows)
            cut = max(1, int(len(rows) * self.eval_fraction))
            rows, held = rows[:-cut], rows[-cut:]
        ws = cfg.learner.world_size
        if self.batch_pairs % ws:
            raise ValueError(f"{key}.batch_pairs: {self.batch_pairs} pairs do not split over learner.world_size {ws} "
                             f"ranks without separating a chosen from its rejected response")
        base = self.model_path or ctx.require("policy")
        tokenizer = load_tokenizer(base)
        say(f"reward model: {len(rows)} training pairs, {len(held)} held out, {self.steps} steps of "
            f"{self.batch_pairs} pairs")
        group = ctx.runtime.learner_group(cfg, base, lr=self.lr, weight_decay=cfg.learner.weight_decay,
                                          micro_batch_size=2 * self.batch_pairs // ws, grad_accum=1,
                                          scheduler=cfg.learner.scheduler, warmup_steps=0, total_steps=self.steps,
                                          family="sequence_score")
        rng, order, history = random.Random(cfg.seed), [], []
        out_path = str(ctx.output_dir / "reward_model")
        try:
            for step in range(1, self.steps + 1):
                if len(order) < self.batch_pairs:
                    perm = list(range(len(rows)))
                    rng.shuffle(perm)
                    order += perm
                idx, order = order[:self.batch_pairs], order[self.batch_pairs:]
                batch = pair_batch(tokenizer, [rows[i] for i in idx], *self.columns, cfg.data.chat_template)
                m = group.train_step(batch, 1, "bradley_terry", {"margin": self.margin})
                history.append({"loss": m["loss"], "pair_accuracy": m["pair_accuracy"]})
                if step % max(1, self.steps // 5) == 0 or step == self.steps:
                    say(f"reward model step {step}/{self.steps}: loss {m['loss']:.4f}, "
                        f"batch pair accuracy {m['pair_accuracy']:.2f}")
            shutil.rmtree(out_path, ignore_errors=True)
            group.save_hf(out_path, tokenizer_path=base)
        finally:
            group.shutdown()
        engine = ClassifierEngine(out_path, dtype=cfg.model.dtype)  # the engine a judge serves it with
        p, c, r = self.columns
        prompts = [format_prompt(x[p], tokenizer, chat_template=cfg.data.chat_template) for x in held]
        chosen = engine.score(prompts, [str(x[c]) for x in held])
        rejected = engine.score(prompts, [str(x[r]) for x in held])
        accuracy = sum(a > b for a, b in zip(chosen, rejected)) / len(held)
        say(f"reward model: held-out pair accuracy {accuracy:.3f} ({len(held)} pairs)")
        ctx.summary["reward_model"] = {"heldout_pair_accuracy": accuracy, "heldout_pairs": len(held),
                                       "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
                                       "steps": self.steps}
        return {"reward_model": out_path}
