"""The `bliss` stage: BLISS data selection over the SFT pool (`rl.methods.bliss.core`; rl/methods/bliss/README.md).

1. Proxy: `proxy.path` (a small model sharing the policy's tokenizer, e.g. pythia-160m for a Pythia target) or a
   model of the policy's architecture shrunk to `proxy.hidden_size`/`num_layers`/... and initialised at random,
   warmed up for `proxy_warmup_steps` SFT steps on random pool rows on the learner group.
2. Target: the policy (the model that will train on the selection) in a frozen actor that returns its
   log-probabilities for the KL term (`target_num_gpus`); with `target_warmup_steps`, first warmed up on random
   pool rows as the paper's reference model is (published as the `policy` the following stages train).
3. Per round (the pool in `rounds` shards, as data arrives in the paper): the proxy is reset to its warm-up, a
   score model is built on its backbone, `outer_steps` bilevel steps run on `world_size` data-parallel Ray
   actors (gloo/NCCL, the softmax over the global batch of `batch_size` rows; both learning rates warmed up
   linearly over the first `warmup_fraction` of them, the released scripts' 10%), then the shard is scored and its
   top `ratio` kept. The ranks and the target actor run in the run's learner bundles (no learner holds them
   during this stage): `num_gpus_per_rank` + `target_num_gpus` must fit one device.
4. Between rounds, with `target_steps_per_round`, the target continues training on the round's selection for
   that many SFT steps (the paper continues the target's pretraining on each round's selection) and the next
   round's KL term reads the trained target. The published `policy` stays the warmed-up target: the SFT stage
   after this one trains on the whole selection.

Artifacts: `sft` (the selected rows, JSONL, for the SFT stage that follows), `bliss_scores` (Parquet: row, round,
score), `bliss_selection` (JSON: selected rows per round, the bilevel metrics).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from rl.registry import register, register_alias
from rl.stages import Stage, StageContext, StageError, say, stage_cfg


class TargetLogprobs:
    """A frozen target model that returns `[N, L, V]` log-probabilities at the response positions of a batch."""

    def __init__(self, model_path: str, dtype: str = "float32", trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                          trust_remote_code=trust_remote_code).eval()
        if torch.cuda.is_available():
            self.model = self.model.cuda()

    @torch.no_grad()
    def logprobs(self, batch: Any) -> torch.Tensor:
        device = next(self.model.parameters()).device
        P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        inputs = {k: v.to(device) for k, v in batch.model_inputs().items()}
        logits = self.model(**inputs, use_cache=False).logits[:, P - 1:P - 1 + L].float()
        return torch.log_softmax(logits, -1).cpu()


class BlissWorker:
    """One data-parallel rank of the bilevel optimisation (`rl.methods.bliss.core.BilevelSelector`)."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, hyper: dict[str, Any],
                 threads: int = 1):
        import os

        import torch.distributed as dist
        torch.set_num_threads(threads)
        self.rank, self.hyper = rank, hyper
        if world_size > 1:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size)

    def reset(self, proxy_path: str, seed: int) -> None:
        """The proxy from its warm-up checkpoint and a new score model on its backbone (head seeded)."""
        from transformers import AutoModelForCausalLM

        from rl.methods.bliss.core import BilevelSelector, ScoreModel
        proxy = AutoModelForCausalLM.from_pretrained(proxy_path, attn_implementation="eager")  # double backward
        torch.manual_seed(seed)
        self.selector = BilevelSelector(proxy.train(), ScoreModel(proxy).train(), **self.hyper)

    def outer_step(self, batch: Any, val_batch: Any, target_logp: torch.Tensor | None) -> dict[str, float]:
        return self.selector.outer_step(batch, val_batch, target_logp)

    def scores(self, batch: Any) -> torch.Tensor:
        self.selector.score_model.eval()
        return self.selector.scores(batch)


def make_proxy(base: str, out_dir: Path, spec: dict[str, Any], seed: int) -> str:
    """`spec.path`, or the base model's architecture shrunk to `spec`'s sizes, initialised at random and saved
    with the base tokenizer."""
    if spec.get("path"):
        return str(spec["path"])
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.tokenizer import load_tokenizer
    config = AutoConfig.from_pretrained(base)
    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}
    sizes.update({k: v for k, v in spec.items() if k != "path"})
    if "num_key_value_heads" in config.to_dict():
        sizes.setdefault("num_key_value_heads", sizes["num_attention_heads"])
    for key, value in sizes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    load_tokenizer(base).save_pretrained(out_dir)
    return str(out_dir)


@register("stage", "bliss")
class BlissStage(Stage):
    reads, publishes = ("policy",), ("sft", "bliss_scores", "bliss_selection")  # checked against the recipe's order
    config_keys = ("seed", "model", "sft", "data", "learner")
    runs_in_driver = True

    def __init__(self, ratio: float = 0.2, rounds: int = 1, outer_steps: int = 3000, batch_size: int = 64,
                 val_batch_size: int = 4, inner_steps: int = 5, z_loops: int = 3, lr: float = 1e-5,
                 score_lr: float = 1e-5, weight_decay: float = 0.1, grad_clip: float = 1.0, reg: float = 1e-7,
                 gamma: float = 1e-2, lr_z: float = 1e-2, lamb: float = 1e-2, proxy: dict[str, Any] | None = None,
                 proxy_warmup_steps: int = 200, world_size: int = 1, num_gpus_per_rank: float = 0.0,
                 target_num_gpus: float = 0.0, target_warmup_steps: int = 0, val_path: str | None = None,
                 log_every: int = 20, warmup_fraction: float = 0.1, target_steps_per_round: int = 0):
        if not 0 < ratio <= 1 or rounds < 1:
            raise ValueError(f"ratio must be in (0, 1] ({ratio}) and rounds >= 1 ({rounds})")
        self.ratio, self.rounds, self.outer_steps = ratio, rounds, outer_steps
        self.batch_size, self.val_batch_size = batch_size, val_batch_size
        # YAML reads `1e-3` (no dot) as a string: the rates are taken as numbers here
        self.hyper = {"lr": float(lr), "score_lr": float(score_lr), "weight_decay": float(weight_decay),
                      "grad_clip": float(grad_clip), "reg": float(reg), "gamma": float(gamma),
                      "inner_steps": int(inner_steps), "z_loops": int(z_loops), "lr_z": float(lr_z), "lamb": float(lamb),
                      "warmup_steps": int(float(warmup_fraction) * outer_steps)}
        self.target_steps_per_round = target_steps_per_round
        self.proxy = dict(proxy or {})
        self.proxy_warmup_steps, self.world_size = proxy_warmup_steps, world_size
        self.num_gpus_per_rank, self.target_num_gpus = num_gpus_per_rank, target_num_gpus
        self.val_path, self.log_every, self.target_warmup_steps = val_path, log_every, target_warmup_steps
        if batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must divide over world_size ({world_size}) ranks")

    def input_files(self, cfg: Any) -> list[str | None]:
        return [self.val_path, self.proxy.get("path")]

    def run(self, ctx: StageContext) -> dict[str, str]:
        from models.tokenizer import load_tokenizer
        from rl.sft_data import sft_examples, sft_rows_and_examples
        cfg = stage_cfg(ctx)
        pool_path = ctx.artifact("sft")
        val_path = self.val_path or cfg.sft.eval_path or ctx.artifact("sft_val")
        if pool_path is None or val_path is None:
            raise StageError(f"{ctx.name}: needs the pool (data.sft_path) and a validation set (params.val_path, "
                             f"sft.eval_path or a synthetic task's sft_val split)")
        tok = load_tokenizer(ctx.require("policy"))
        rows, pool, dropped = sft_rows_and_examples(tok, pool_path, "data.sft_path", cfg.sft, cfg.data)
        val, _ = sft_examples(tok, val_path, f"{ctx.name} validation set", cfg.sft, cfg.data)
        base, produced = self._warm_up(ctx, cfg, tok, pool)
        shards = [list(range(len(pool)))[r::self.rounds] for r in range(self.rounds)]
        scores, selected, history, targets = self._select(ctx, cfg, tok, base, pool, val, shards)
        return {**produced, **self._write(ctx, rows, pool, dropped, shards, scores, selected, history, targets)}

    def _warm_up(self, ctx: StageContext, cfg: Any, tok: Any, pool: list) -> tuple[str, dict[str, str]]:
        """The proxy warmed up on random pool rows (at `stage_dir/proxy`), and the target: the policy, or the
        policy warmed up the same way when `target_warmup_steps` (as the paper's reference model), then
        published as the stage's `policy`."""
        from omegaconf import OmegaConf
        out, base = ctx.stage_dir, ctx.require("policy")
        proxy_init = make_proxy(base, out / "proxy_init", self.proxy, cfg.seed)
        warm_cfg = OmegaConf.merge(cfg, {"output_dir": str(out / "proxy_warmup"), "resume": "no",
                                         "sft": {"epochs": 0, "steps": self.proxy_warmup_steps, "save_every": 0}})
        say(f"{ctx.name}: proxy warm-up, {self.proxy_warmup_steps} steps on random pool rows")
        ctx.runtime.fine_tune(warm_cfg, proxy_init, str(out / "proxy"), tok, pool)
        if not self.target_warmup_steps:
            return base, {}
        target_path = out / "target"
        say(f"{ctx.name}: target warm-up, {self.target_warmup_steps} steps on random pool rows")
        ctx.runtime.fine_tune(OmegaConf.merge(warm_cfg, {"output_dir": str(out / "target_warmup"),
                                                         "sft": {"steps": self.target_warmup_steps}}), base,
                              str(target_path), tok, pool)
        return str(target_path), {"policy": str(target_path)}

    def _select(self, ctx: StageContext, cfg: Any, tok: Any, target_path: str, pool: list, val: list,
                shards: list[list[int]]) -> tuple[torch.Tensor, list[list[int]], list[dict], list[str]]:
        """Per round: a new score model trained by `outer_steps` bilevel steps on its shard, then the shard scored
        and its top `ratio` kept; with `target_steps_per_round`, the target trained on the selection before the
        next round. Returns the scores, the selection per round, the step history and each round's target."""
        rng, scores = random.Random(cfg.seed), torch.zeros(len(pool))
        selected, history, targets = [], [], []
        for rnd, shard in enumerate(shards):
            targets.append(target_path)
            history += self._round(ctx, cfg, target_path, pool, val, shard, rng, scores, tok.pad_token_id, rnd)
            keep = max(1, int(len(shard) * self.ratio))
            selected.append(sorted(sorted(shard, key=lambda i: (-float(scores[i]), i))[:keep]))
            if self.target_steps_per_round and rnd < len(shards) - 1:
                target_path = self._train_target(ctx, cfg, tok, target_path, [pool[i] for i in selected[-1]], rnd)
        return scores, selected, history, targets

    def _round(self, ctx: StageContext, cfg: Any, target_path: str, pool: list, val: list, shard: list[int],
               rng: random.Random, scores: torch.Tensor, pad: int, rnd: int) -> list[dict]:
        """One round's bilevel steps on actors of its own (rank r in learner bundle r, the target beside rank 0),
        and the shard's scores into `scores`; returns the round's step history."""
        from rl.batch import batch_of_examples
        rt, history = ctx.runtime, []
        target = rt.start_actor(TargetLogprobs, target_path, cfg.model.dtype, cfg.model.trust_remote_code,
                                num_gpus=self.target_num_gpus)
        addr, port = rt.rendezvous(self.world_size)
        workers = [rt.start_actor(BlissWorker, r, self.world_size, addr, port, self.hyper, cfg.learner.threads,
                                  bundle=r, num_gpus=self.num_gpus_per_rank) for r in range(self.world_size)]
        try:
            rt.wait([rt.call(w, "reset", str(ctx.stage_dir / "proxy"), cfg.seed + rnd) for w in workers])
            for step in range(1, self.outer_steps + 1):
                metrics = self._outer_step(rt, target, workers, pool, val, shard, rng, pad)
                history.append({"round": rnd, "step": step, **metrics})
                if step % self.log_every == 0 or step == self.outer_steps:
                    say(f"{ctx.name}: round {rnd} step {step}/{self.outer_steps} val CE {metrics['val_ce']:.4f}")
            for start in range(0, len(shard), 256):
                chunk = shard[start:start + 256]
                scores[chunk] = rt.wait(rt.call(workers[0], "scores", batch_of_examples([pool[i] for i in chunk], pad)))
        finally:
            rt.stop_actors([target, *workers])
        return history

    def _train_target(self, ctx: StageContext, cfg: Any, tok: Any, target_path: str, examples: list,
                      rnd: int) -> str:
        """The target after `target_steps_per_round` SFT steps on round `rnd`'s selection (the next round's)."""
        from omegaconf import OmegaConf
        out = ctx.stage_dir
        say(f"{ctx.name}: target trained {self.target_steps_per_round} steps on round {rnd}'s selection")
        train_cfg = OmegaConf.merge(cfg, {"output_dir": str(out / f"target_round{rnd + 1}_run"), "resume": "no",
                                          "sft": {"epochs": 0, "steps": self.target_steps_per_round,
                                                  "save_every": 0}})
        ctx.runtime.fine_tune(train_cfg, target_path, str(out / f"target_round{rnd + 1}"), tok, examples)
        return str(out / f"target_round{rnd + 1}")

    def _outer_step(self, rt: Any, target: Any, workers: list[Any], pool: list, val: list, shard: list[int],
                    rng: random.Random, pad: int) -> dict[str, float]:
        """One bilevel step of every rank on its share of a global batch drawn from the shard."""
        from rl.batch import batch_of_examples
        per_rank = self.batch_size // self.world_size
        idx = rng.sample(shard, min(self.batch_size, len(shard)))
        idx += rng.sample(shard, self.batch_size - len(idx))  # a shard smaller than a batch repeats rows
        target_logp = (rt.wait(rt.call(target, "logprobs", batch_of_examples([pool[i] for i in idx], pad)))
                       if self.hyper["gamma"] else None)
        futures = []
        for r, w in enumerate(workers):
            part = batch_of_examples([pool[i] for i in idx[r * per_rank:(r + 1) * per_rank]], pad)
            vb = batch_of_examples(rng.sample(val, min(self.val_batch_size, len(val))), pad)
            tl = None
            if target_logp is not None:
                tl = target_logp[r * per_rank:(r + 1) * per_rank, :part.response_ids.shape[1]]
            futures.append(rt.call(w, "outer_step", part, vb, tl))
        return rt.wait(futures)[0]

    def _write(self, ctx: StageContext, rows: list[dict], pool: list, dropped: dict, shards: list[list[int]],
               scores: torch.Tensor, selected: list[list[int]], history: list[dict], targets: list[str]
               ) -> dict[str, str]:
        """The selected rows, every row's score and the selection report; the stage's artifacts."""
        import pandas as pd
        out = ctx.stage_dir
        scores_path = out / "bliss_scores.parquet"
        round_of = {i: r for r, shard in enumerate(shards) for i in shard}
        pd.DataFrame({"row": [e.row for e in pool], "round": [round_of[i] for i in range(len(pool))],
                      "score": scores.tolist()}).to_parquet(scores_path)
        chosen = sorted(i for part in selected for i in part)
        selected_path = out / "sft_selected.jsonl"
        selected_path.write_text("".join(json.dumps(rows[pool[i].row], default=str) + "\n" for i in chosen))
        report = {"pool_rows": len(pool), "dropped_rows": dropped, "selected_rows": len(chosen),
                  "selected_per_round": [[pool[i].row for i in part] for part in selected],
                  "target_per_round": targets, "history": history}
        report_path = out / "bliss_selection.json"
        report_path.write_text(json.dumps(report))
        ctx.summary[ctx.name] = {"pool_rows": len(pool), "selected_rows": len(chosen),
                                 "final_val_ce": history[-1]["val_ce"] if history else None}
        say(f"{ctx.name}: selected {len(chosen)} of {len(pool)} rows")
        return {"sft": str(selected_path), "bliss_scores": str(scores_path), "bliss_selection": str(report_path)}


register_alias("stage", "select_bliss", "bliss")
