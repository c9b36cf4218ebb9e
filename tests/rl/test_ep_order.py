"""EP-Order ([RECONSTRUCTION], shared/specs/stages.md §4): clustering, the centroid chain, mixed regions, and the
`order_ep` stage through Ray feeding the SFT stage a sequential order."""

import json
import random

import numpy as np
import pytest

from rl.ep_order import (
    choose_k,
    cosine_distances,
    default_k,
    greedy_chain,
    mixed_order,
    path_length,
    spherical_kmeans,
    two_opt,
    within_cluster_order,
    zone_proportions,
)


def _blobs(k=6, per=60, dim=16, spread=0.15, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(k, dim))
    x = np.concatenate([c + spread * rng.normal(size=(per, dim)) for c in centers])
    return x, np.repeat(np.arange(k), per)


def purity(labels, truth):
    return sum(np.bincount(truth[labels == c]).max() for c in set(labels.tolist())) / len(labels)


def test_spherical_kmeans_recovers_the_domains_and_k_is_chosen():
    x, truth = _blobs()
    labels, centroids = spherical_kmeans(x, 6, seed=0, restarts=3)
    assert purity(labels, truth) > 0.9 and np.allclose(np.linalg.norm(centroids, axis=1), 1.0)
    # assignment is by cosine: scaling a row does not move it
    scaled = x.copy()
    scaled[0] *= 10
    assert (x / np.linalg.norm(x, axis=1, keepdims=True) @ centroids.T).argmax(1)[0] == labels[0]
    assert default_k(100) == 8 and default_k(50 * 20 ** 2) == 20 and default_k(10 ** 7) == 64
    assert choose_k(x, 0, candidates=[3, 6, 12], restarts=2) == 6


def test_the_greedy_chain_is_shorter_than_random_orders_and_two_opt_shortens_it_further():
    rng = np.random.default_rng(1)
    for _ in range(5):
        dist = cosine_distances(rng.normal(size=(12, 8)))
        chain = greedy_chain(dist, 0)
        assert sorted(chain) == list(range(12)) and chain[0] == 0
        randoms = [path_length(random.Random(r).sample(range(12), 12), dist) for r in range(100)]
        assert path_length(chain, dist) <= np.median(randoms)
        better = two_opt(chain, dist)
        assert better[0] == 0 and sorted(better) == list(range(12))
        assert path_length(better, dist) <= path_length(chain, dist) + 1e-12
    # hand-made: points on a line, starting at one end, visit in order
    pts = np.array([0.0, 3.0, 1.0, 2.0])
    line = np.abs(pts[:, None] - pts[None, :])
    assert greedy_chain(line, 0) == [0, 2, 3, 1] and path_length([0, 2, 3, 1], line) == 3.0


def test_mixed_order_sees_every_sample_once_with_the_zone_proportions():
    labels = np.repeat(np.arange(6), 200)
    members = within_cluster_order(labels, seed=0)
    path = [3, 1, 4, 0, 5, 2]
    order, segments = mixed_order(members, path, seed=0)
    assert sorted(order) == list(range(len(labels)))
    props = zone_proportions(segments, path)
    assert all(abs(p - q) <= 0.05 for p, q in zip(props, (0.2, 0.6, 0.2))), props
    # segments are contiguous with pure cores; an interior one away from the ends is as long as its cluster
    assert [seg["end"] - seg["start"] for seg in segments][2:4] == [200, 200]
    for seg in segments:
        assert seg["zone"] == 40
        core = order[seg["start"] + 40:seg["end"] - 40]
        assert {int(labels[i]) for i in core} == {seg["cluster"]}
    assert [seg["start"] for seg in segments[1:]] == [seg["end"] for seg in segments[:-1]]
    # the ends of the path: no previous cluster at the start, no next one at the end (0, 0.75, 0.25)
    first, last = segments[0]["drawn_from"], segments[-1]["drawn_from"]
    assert set(first) <= {3, 1} and first.count(1) == 2 * round(0.25 * 40)
    assert set(last) <= {5, 2}
    # uneven clusters still give every sample exactly once
    uneven = np.array([0] * 7 + [1] * 50 + [2] * 3 + [3] * 31 + [4] * 400 + [5] * 2)
    for path in ([2, 0, 3, 1, 4, 5], [5, 4, 2, 1, 0, 3], [4, 5, 2, 3, 0, 1]):
        order, _ = mixed_order(within_cluster_order(uneven, 1), path, seed=1)
        assert sorted(order) == list(range(len(uneven))), path
    assert mixed_order(within_cluster_order(uneven, 1), path, seed=1)[0] == order  # deterministic


def test_within_cluster_order_by_warm_up_loss():
    labels = np.array([0, 1, 0, 1, 0])
    losses = np.array([0.5, 0.1, 0.2, 0.9, 0.3])
    assert within_cluster_order(labels, 0, losses) == {0: [2, 4, 0], 1: [1, 3]}
    shuffled = within_cluster_order(labels, 0)
    assert sorted(shuffled[0]) == [0, 2, 4] and shuffled == within_cluster_order(labels, 0)


@pytest.mark.slow
def test_order_ep_stage_orders_the_sft_data_by_domain_and_sft_reads_it_in_order(ray_cluster, tmp_path):
    from rl import config
    from rl.pipeline import run
    from tests.rl.test_pipeline import ROOT, TINY
    out = tmp_path / "run"
    summary = run(config.load(ROOT / "recipes/ep_order_sft_tiny.yaml", [
        f"output_dir={out}", *TINY, "data.synthetic.num_train=720", "sft.epochs=0", "sft.steps=3", "sft.batch_size=8",
        "stages=[{name: model}, {name: data}, {name: order_ep, params: {k: 6, warmup_epochs: 2, two_opt: true, "
        "embed_tokens: all, restarts: 3}}, {name: sft}]"]))
    report = json.loads((out / "stages" / "order_ep" / "ep_order.json").read_text())
    sft_rows = [json.loads(x) for x in (out / "data" / "sft.jsonl").read_text().splitlines()]
    domains = np.unique([r["domain"] for r in sft_rows], return_inverse=True)[1]
    assert report["k"] == 6 and purity(np.array(report["labels"]), domains) > 0.9
    assert sorted(report["source_rows"]) == list(range(len(sft_rows)))
    assert report["path_length"] <= report["random_path_length_median"]
    ordered = [json.loads(x) for x in (out / "stages" / "order_ep" / "sft_ordered.jsonl").read_text().splitlines()]
    assert ordered == [{"prompt": sft_rows[i]["prompt"], "target": sft_rows[i]["target"]} for i in report["source_rows"]]
    assert summary["order_ep"]["k"] == 6 and summary["sft_rows"] + summary["sft_eval_rows"] == len(sft_rows)
    # the SFT stage reads the ordered rows and draws them in their order
    assert summary["sft_sampler"] == "sequential" and summary["stages"]["sft"]["artifacts"]["policy"].endswith("sft_model")


def test_the_sequential_sampler_keeps_the_file_order_across_epochs():
    from rl.data import PromptSampler
    s = PromptSampler(5, seed=3, shuffle=False)
    assert s.next(7) == [0, 1, 2, 3, 4, 0, 1] and s.state() == {"epoch": 1, "pos": 2}
    assert sorted(PromptSampler(5, seed=3).next(5)) == list(range(5))
