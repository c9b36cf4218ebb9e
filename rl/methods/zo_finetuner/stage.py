"""The `zo_finetuner` stage: the ZO Fine-tuner's learning-to-learn job, run once per base model
(`rl.methods.zo_finetuner.optimizer.learn_to_learn`; rl/methods/zo_finetuner/README.md).

A Ray task in the run's first learner bundle loads the policy, follows a first-order trajectory on the meta-training
task's sequences (`data_path`, prompt/target rows; the run's SFT data when none is given: the paper meta-trains on
one task, COPA, and fine-tunes on others) and trains one perturbation network per parameter tensor so that a virtual
ZO step lowers the loss; the bundle is saved with the touched-embedding-rows estimate it was trained with (15 × the
batch size, the released rule).

Artifacts: `pert_bundle` (the saved `PertBundle`), which a later stage's forward-only optimizer reads as
`learner.optimizer: {name: zo_finetuner, params: {bundle: artifact:pert_bundle}}`, and `pert_bundle_log` (JSON: the
meta-loss and σ per step). The policy is unchanged.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rl.batch import pad_token_rows
from rl.registry import register
from rl.sft_data import sft_examples
from rl.stages import Stage, StageContext, StageError, policy_sft_data, say


def learn_bundle(model_path: str, out_path: str, sequences: list[tuple[list[int], list[int]]], pad_id: int, *,
                 steps: int, batch_size: int, eps: float, lr_update: float, lr_mlp: float, lr_llm: float,
                 momentum: float, restart_every: int, hidden: int, embedding_rows: int, seed: int, dtype: str,
                 trust_remote_code: bool = False) -> list[dict[str, float]]:
    """Train and save a `PertBundle` for the model at `model_path` on `steps` batches of (prompt, response) token
    sequences (the loss on the response tokens); returns the per-step log."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl.methods.zo_finetuner.optimizer import learn_to_learn
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code).to(device).train()
    rng = random.Random(seed)

    def batches():
        for _ in range(steps):
            chunk = [sequences[rng.randrange(len(sequences))] for _ in range(batch_size)]
            ids, mask = pad_token_rows([p + r for p, r in chunk], pad_id, "right")
            labels = ids.masked_fill(mask == 0, -100)
            for row, (p, _) in enumerate(chunk):
                labels[row, :len(p)] = -100  # the loss of the response tokens
            yield {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}

    history: list[dict[str, float]] = []

    def log(step: int, row: dict[str, float]) -> None:
        history.append({"step": step, **row})
        if step % max(1, steps // 10) == 0:
            say(f"zo_finetuner: step {step}/{steps} loss {row['loss']:.4f} meta-loss {row['meta_loss']:.4f} "
                f"sigma {row['sigma_mean']:.3f}")

    bundle = learn_to_learn(model, lambda forward, batch: forward(**batch).loss, batches(), eps=eps,
                            lr_update=lr_update, lr_mlp=lr_mlp, lr_llm=lr_llm, momentum=momentum,
                            restart_every=restart_every, hidden=hidden, embedding_rows=embedding_rows, seed=seed,
                            log=log)
    bundle.save(out_path)
    return history


@register("stage", "zo_finetuner")
class ZOFinetunerStage(Stage):
    reads, publishes = ("policy",), ("pert_bundle", "pert_bundle_log")  # checked against the recipe's order
    config_keys = ("seed", "model", "data", "sft.max_length", "sft.format", "sft.messages_column", "sft.bad_rows")
    runs_in_driver = True

    def __init__(self, steps: int = 1000, batch_size: int = 16, eps: float = 1e-3, lr_update: float = 1e-6,
                 lr_mlp: float = 1e-3, lr_llm: float = 0.01, momentum: float = 0.8, restart_every: int = 100,
                 hidden: int = 64, embedding_rows: int | None = None, data_path: str | None = None,
                 num_gpus: float = 0.0):
        """`steps` learning-to-learn steps of `batch_size` sequences; `eps` the ZO perturbation, `lr_update` the
        virtual ZO step's rate, `lr_mlp` the networks' SGD rate, `lr_llm`, `momentum` and `restart_every` the
        first-order trajectory (restarted from the initial weights, its rate decayed linearly within each period);
        `hidden` the networks' width (the released defaults); `embedding_rows` the touched-embedding-rows estimate
        (None: 15 × `batch_size`, the released rule); `data_path` the meta-training task's prompt/target rows
        (None: the run's SFT data); `num_gpus` of the task."""
        if steps < 1 or batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
        self.steps, self.batch_size, self.eps, self.lr_update = steps, batch_size, float(eps), float(lr_update)
        self.lr_mlp, self.lr_llm, self.momentum = float(lr_mlp), float(lr_llm), float(momentum)
        self.restart_every, self.hidden, self.num_gpus = restart_every, hidden, num_gpus
        self.embedding_rows = embedding_rows if embedding_rows is not None else 15 * batch_size
        self.data_path = data_path

    def run(self, ctx: StageContext) -> dict[str, str]:
        cfg, base, tokenizer, _, examples, _ = policy_sft_data(ctx, "meta-training sequences")
        if self.data_path:
            examples, _ = sft_examples(tokenizer, self.data_path, f"stages.{ctx.name}.params.data_path", cfg.sft,
                                       cfg.data)
        if not examples:
            raise StageError(f"{ctx.name}: no meta-training sequences")
        out = Path(ctx.stage_dir)
        say(f"{ctx.name}: learning to learn for {self.steps} steps of {self.batch_size} sequences "
            f"({len(examples)} available), embedding rows {self.embedding_rows}")
        history = ctx.runtime.run_task(
            learn_bundle, base, str(out / "pert_bundle.pt"),
            [(e.prompt_ids, e.response_ids) for e in examples], tokenizer.pad_token_id, num_gpus=self.num_gpus,
            **self._params(), seed=cfg.seed, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
        log_path = out / "pert_bundle_log.json"
        log_path.write_text(json.dumps(history))
        first, last = history[:10], history[-10:]
        ctx.summary[ctx.name] = {"steps": len(history),
                                 "meta_loss_first": sum(h["meta_loss"] for h in first) / len(first),
                                 "meta_loss_last": sum(h["meta_loss"] for h in last) / len(last),
                                 "sigma_mean_last": history[-1]["sigma_mean"]}
        return {"pert_bundle": str(out / "pert_bundle.pt"), "pert_bundle_log": str(log_path)}

    def _params(self) -> dict[str, Any]:
        return {"steps": self.steps, "batch_size": self.batch_size, "eps": self.eps, "lr_update": self.lr_update,
                "lr_mlp": self.lr_mlp, "lr_llm": self.lr_llm, "momentum": self.momentum,
                "restart_every": self.restart_every, "hidden": self.hidden, "embedding_rows": self.embedding_rows}
