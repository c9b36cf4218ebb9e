"""The data stages chained on one cluster, through Ray: BLISS selects from a noisy pool, EP-Order orders the
selection, the SFT stage trains on it in that order."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.rl.methods.test_ep_order import purity


# CI: bliss in tests/rl/methods/test_bliss.py, ep_order in test_ep_order.py, the SFT stage in
# tests/rl/test_sft_data.py
@pytest.mark.extended
@pytest.mark.slow
def test_select_then_order_then_sft(ray_cluster, tmp_path):
    """bliss: proxy and target warm-ups on the learner group, the target's log-probabilities from a frozen
    actor, two data-parallel bilevel ranks, per-round top shares of the scored pool; ep_order: the selection
    clustered by domain and chained; sft: the ordered selection drawn sequentially from the warmed-up target."""
    from cluster.pipeline import run
    from rl import config
    from tests.cluster.test_pipeline import ROOT, TINY
    out = tmp_path / "run"
    stages = ("stages=[{name: model}, {name: data}, {name: bliss, params: {ratio: 0.5, rounds: 2, "
              "outer_steps: 3, batch_size: 8, val_batch_size: 2, inner_steps: 2, z_loops: 2, lr: 1e-3, "
              "score_lr: 1e-3, gamma: 0.01, proxy: {hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
              "intermediate_size: 64}, proxy_warmup_steps: 2, target_warmup_steps: 2, world_size: 2, "
              "target_steps_per_round: 2}}, "
              "{name: ep_order, params: {k: 6, warmup_fraction: 0.2, warmup_epochs: 2, two_opt: true, "
              "embed_tokens: all, restarts: 3}}, {name: sft}]")
    summary = run(config.load(ROOT / "recipes/bliss_select_sft_tiny.yaml", [
        f"output_dir={out}", *TINY, "data.synthetic.num_train=600", "data.synthetic.num_eval=10", "sft.steps=2",
        "sft.batch_size=8", stages]))
    pool = [json.loads(x) for x in (out / "data" / "sft.jsonl").read_text().splitlines()]
    bliss = out / "stages" / "bliss"
    scores = pd.read_parquet(bliss / "bliss_scores.parquet")
    assert sorted(scores["row"]) == list(range(len(pool))) and scores["score"].between(0, 1).all()
    assert set(scores["round"]) == {0, 1}
    report = json.loads((bliss / "bliss_selection.json").read_text())
    per_round = report["selected_per_round"]
    for rnd, chosen in enumerate(per_round):  # each round keeps the top half of its shard
        shard = scores[scores["round"] == rnd].sort_values(["score", "row"], ascending=[False, True])
        assert sorted(chosen) == sorted(shard["row"][:len(shard) // 2])
    assert len(report["history"]) == 6 and all(h["z_norm"] > 0 for h in report["history"])
    # the second round's KL term read the target trained on the first round's selection
    first, second = report["target_per_round"]
    assert first.endswith("target") and second.endswith("target_round1")
    assert (Path(second) / "config.json").exists()
    chosen = sorted(sum(per_round, []))
    selected = [json.loads(x) for x in (bliss / "sft_selected.jsonl").read_text().splitlines()]
    assert selected == [{"prompt": pool[i]["prompt"], "target": pool[i]["target"]} for i in chosen]

    # ep_order on the selection: clusters follow the domains, every selected row once, a short chain
    order = json.loads((out / "stages" / "ep_order" / "ep_order.json").read_text())
    domains = np.unique([pool[i]["domain"] for i in chosen], return_inverse=True)[1]
    # corrupted rows (random targets) pull the centroids: the clusters follow the domains, less cleanly than on
    # clean data (purity > 0.9 there: tests/rl/methods/test_ep_order.py); chance would be about 1/6
    clean = np.array([pool[i]["clean"] for i in chosen])
    assert order["k"] == 6 and purity(np.array(order["labels"])[clean], domains[clean]) > 0.6
    assert sorted(order["source_rows"]) == list(range(len(chosen)))
    assert order["path_length"] <= order["random_path_length_median"]
    ordered = [json.loads(x) for x in (out / "stages" / "ep_order" / "sft_ordered.jsonl").read_text().splitlines()]
    assert ordered == [selected[i] for i in order["source_rows"]]

    # sft: the warmed-up target, the ordered selection drawn in order, held-out loss on the clean split
    assert summary["sft_sampler"] == "sequential" and summary["sft_rows"] == len(selected)
    assert summary["sft_eval_rows"] == 10 and "sft_eval_loss" in summary
    assert summary["stages"]["bliss"]["artifacts"]["policy"].endswith("target")
