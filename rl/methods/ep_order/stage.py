"""The `ep_order` stage: EP-Order over the SFT data (`rl.methods.ep_order.core`; [RECONSTRUCTION], see that module).

1. Warm-up: the policy is fine-tuned for `warmup_epochs` on a seeded random `warmup_fraction` of the SFT rows, with
   the recipe's `sft` settings, on the learner group; the warmed-up model serves only to embed.
2. Embed: a Ray task loads it and takes, per row, the mean last hidden state over the trained tokens (or all
   tokens) and the warm-up loss (`models.families.sequence_embeddings`).
3. Cluster (spherical k-means, `k` or the spec's default, or the best silhouette over `k_candidates`), chain the
   clusters from the easiest (lowest mean warm-up loss; `start: farthest` begins at the cluster farthest from the
   others) by nearest centroids (+ `two_opt`), order the samples with mixed transition regions; with `replay` > 0
   that share of each segment's rows moves to random later positions (`core.spread_replay`).

Artifacts: `sft` (the rows in the new order, JSONL, read by the SFT stage with a sequential sampler under
`sft.sampler: auto`), `sft_ordering` (the report: order, cluster of every row, the path and its length against
100 random cluster orders, the zone proportions), `sft_embeddings` (`.npy`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from rl.methods.ep_order.core import (
    choose_k,
    cosine_distances,
    greedy_chain,
    mixed_order,
    path_length,
    spherical_kmeans,
    spread_replay,
    two_opt,
    within_cluster_order,
    zone_proportions,
)
from rl.registry import register, register_alias
from rl.stages import Stage, StageContext, StageError, policy_sft_data, say


def embed_examples(model_path: str, examples: list, pad_id: int, batch_size: int, tokens: str, dtype: str,
                   trust_remote_code: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """`[N, d]` embeddings and `[N]` token-mean NLL of `examples` under the model at `model_path`."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.families import sequence_embeddings
    from rl.batch import batch_of_examples
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code).eval()
    if torch.cuda.is_available():
        model = model.cuda()
    embs, losses = [], []
    for i in range(0, len(examples), batch_size):
        batch = batch_of_examples(examples[i:i + batch_size], pad_id)
        emb, logp = sequence_embeddings(model, batch, tokens)
        mask = batch.response_mask
        embs.append(emb.numpy())
        losses.append((-(logp * mask).sum(1) / mask.sum(1).clamp(min=1)).numpy())
    return np.concatenate(embs), np.concatenate(losses)


@register("stage", "ep_order")
class EPOrderStage(Stage):
    reads, publishes = ("policy",), ("sft", "sft_ordering", "sft_embeddings")  # checked against the recipe's order
    config_keys = ("seed", "model", "sft", "data", "learner")
    runs_in_driver = True

    def __init__(self, warmup_fraction: float = 0.1, warmup_epochs: float = 1.0, k: int = 0,
                 k_candidates: list[int] = (), restarts: int = 10, two_opt: bool = False, zone: float = 0.2,
                 mix: list[float] = (0.2, 0.6, 0.2), end_mix: list[float] = (0.0, 0.75, 0.25),
                 within: str = "shuffle", start: str = "easiest", embed_tokens: str = "response",
                 embed_batch_size: int = 32, embed_num_gpus: float = 0.0, replay: float = 0.0):
        if not 0 < warmup_fraction <= 1:
            raise ValueError(f"warmup_fraction must be in (0, 1], got {warmup_fraction}")
        if within not in ("shuffle", "loss") or start not in ("easiest", "farthest"):
            raise ValueError(f"within must be shuffle or loss ({within!r}), start easiest or farthest ({start!r})")
        if embed_tokens not in ("response", "all"):
            raise ValueError(f"embed_tokens must be response or all, got {embed_tokens!r}")
        if abs(sum(mix) - 1) > 1e-6 or abs(sum(end_mix) - 1) > 1e-6 or not 0 <= zone <= 0.5:
            raise ValueError(f"mix {list(mix)} and end_mix {list(end_mix)} must each sum to 1, zone {zone} be in [0, 0.5]")
        if not 0 <= replay < 1:
            raise ValueError(f"replay (the share of each segment's rows moved later, core.spread_replay) must be in "
                             f"[0, 1), got {replay}")
        self.warmup_fraction, self.warmup_epochs, self.replay = warmup_fraction, warmup_epochs, replay
        self.k, self.k_candidates, self.restarts, self.two_opt = k, list(k_candidates), restarts, two_opt
        self.zone, self.mix, self.end_mix = zone, tuple(mix), tuple(end_mix)
        self.within, self.start, self.embed_tokens = within, start, embed_tokens
        self.embed_batch_size, self.embed_num_gpus = embed_batch_size, embed_num_gpus

    def run(self, ctx: StageContext) -> dict[str, str]:
        cfg, base, tokenizer, rows, examples, dropped = policy_sft_data(ctx, "SFT data to order")
        out = ctx.stage_dir
        warm_path = out / "warmup_model"
        warm = self._warm_up(ctx, cfg, base, tokenizer, examples, warm_path)
        # embed every row (a Ray task beside the cluster's actors)
        emb, losses = ctx.runtime.run_task(embed_examples, str(warm_path), examples, tokenizer.pad_token_id,
                                           self.embed_batch_size, self.embed_tokens, cfg.model.dtype,
                                           cfg.model.trust_remote_code, num_gpus=self.embed_num_gpus)
        report = self._order(ctx, emb, losses, cfg.seed, len(examples))
        ordered_path = out / "sft_ordered.jsonl"
        with ordered_path.open("w") as f:
            for i in report["order"]:
                f.write(json.dumps(rows[examples[i].row], default=str) + "\n")
        np.save(out / "embeddings.npy", emb)
        report.update(rows=len(examples), dropped_rows=dropped, warmup=warm,
                      source_rows=[examples[i].row for i in report["order"]])
        report_path = out / "ep_order.json"
        report_path.write_text(json.dumps(report))
        ctx.summary[ctx.name] = {k_: report[k_] for k_ in ("rows", "k", "path", "path_length",
                                                            "random_path_length_median", "zone_proportions")}
        say(f"{ctx.name}: {report['k']} clusters, path length {report['path_length']:.3f} "
            f"(median of 100 random orders {report['random_path_length_median']:.3f})")
        return {"sft": str(ordered_path), "sft_ordering": str(report_path), "sft_embeddings": str(out / "embeddings.npy")}

    def _warm_up(self, ctx: StageContext, cfg: Any, base: str, tokenizer: Any, examples: list, warm_path: Path
                 ) -> dict[str, float]:
        """SFT of the policy on a random `warmup_fraction` of the rows, saved at `warm_path`."""
        from omegaconf import OmegaConf
        share = sorted(random.Random(cfg.seed).sample(range(len(examples)),
                                                      max(1, round(self.warmup_fraction * len(examples)))))
        warm_cfg = OmegaConf.merge(cfg, {"output_dir": str(ctx.stage_dir), "resume": "no",
                                         "sft": {"epochs": self.warmup_epochs, "save_every": 0, "eval_fraction": 0.0,
                                                 "eval_path": None}})
        say(f"{ctx.name}: warm-up on {len(share)} of {len(examples)} rows")
        return ctx.runtime.fine_tune(warm_cfg, base, str(warm_path), tokenizer, [examples[i] for i in share])

    def _order(self, ctx: StageContext, emb: np.ndarray, losses: np.ndarray, seed: int, n: int) -> dict[str, Any]:
        """Cluster the embeddings, chain the clusters, and lay out the epoch's order with mixed regions."""
        k = self.k or choose_k(emb, seed, self.k_candidates, self.restarts)
        if k > n:
            raise StageError(f"{ctx.name}: k = {k} clusters for {n} rows")
        labels, centroids = spherical_kmeans(emb, k, seed, self.restarts)
        cluster_loss = {c: float(losses[labels == c].mean()) for c in range(k) if (labels == c).any()}
        present = sorted(cluster_loss)
        sub = cosine_distances(centroids)[np.ix_(present, present)]
        first = (min(range(len(present)), key=lambda i: cluster_loss[present[i]]) if self.start == "easiest"
                 else int(sub.sum(1).argmax()))
        chain = greedy_chain(sub, first)
        if self.two_opt:
            chain = two_opt(chain, sub)
        path_clusters = [present[i] for i in chain]
        members = within_cluster_order(labels, seed, losses if self.within == "loss" else None)
        order, segments = mixed_order(members, path_clusters, seed, self.zone, self.mix, self.end_mix)
        order, segments = spread_replay(order, segments, self.replay, seed)
        random_lengths = [path_length(random.Random(seed + r).sample(range(len(present)), len(present)), sub)
                          for r in range(100)]
        return {"k": k, "path": path_clusters, "path_length": path_length(chain, sub),
                "random_path_length_median": float(np.median(random_lengths)),
                "cluster_sizes": {int(c): int((labels == c).sum()) for c in present},
                "cluster_warmup_loss": {int(c): v for c, v in cluster_loss.items()},
                "zone_proportions": zone_proportions(segments, path_clusters), "order": order,
                "labels": labels.tolist(),
                "segments": [{k_: v for k_, v in s.items() if k_ != "drawn_from"} for s in segments]}


register_alias("stage", "order_ep", "ep_order")
