"""EP-Order ([RECONSTRUCTION], rl/methods/ep_order/README.md): clustering, the centroid chain, mixed regions, the
sequential sampler (the `ep_order` stage runs end to end in tests/rl/methods/test_data_stages.py)."""

import random

import numpy as np

from rl.methods.ep_order.core import (
    choose_k,
    cosine_distances,
    default_k,
    greedy_chain,
    mixed_order,
    normalize,
    path_length,
    spherical_kmeans,
    spread_replay,
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
    # assignment is by cosine: scaling rows moves none of them
    scaled = x.copy()
    scaled[0] *= 10
    scaled[1::2] *= 0.1
    assert (spherical_kmeans(scaled, 6, seed=0, restarts=3)[0] == labels).all()
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


def test_replay_moves_a_share_of_each_segment_to_later_positions_and_keeps_every_row_once():
    labels = np.repeat(np.arange(4), 100)
    path = [2, 0, 3, 1]
    order, segments = mixed_order(within_cluster_order(labels, seed=0), path, seed=0, zone=0.0)  # pure blocks
    assert spread_replay(order, segments, 0.0, seed=0) == (order, segments)
    replayed, spans = spread_replay(order, segments, 0.3, seed=0)
    assert sorted(replayed) == sorted(order) and len(replayed) == 400
    # 30 rows leave each of the first three segments; the first keeps 70 and receives none, the last keeps all 100
    assert [s["start"] for s in spans] == [0] + [s["end"] for s in spans[:-1]] and spans[-1]["end"] == 400
    assert spans[0]["end"] == 70 and spans[0]["replayed"] == 0
    assert sum(s["replayed"] for s in spans) == 90 and spans[-1]["end"] - spans[-1]["start"] == 100 + spans[-1]["replayed"]
    for j, span in enumerate(spans):
        clusters = [int(labels[i]) for i in replayed[span["start"]:span["end"]]]
        assert clusters.count(path[j]) == (100 if j == 3 else 70)  # its own rows that stayed
        assert set(clusters) <= set(path[:j + 1])  # what it received comes from earlier clusters only
        assert span["drawn_from"] == clusters
    last = [int(labels[i]) for i in replayed[spans[-1]["start"]:]]
    assert last.count(path[0]) > 0  # the first cluster is revisited at the end of the epoch
    # a row moves only forward: after its own segment's rows that stayed
    own_end = {c: max(p for p, i in enumerate(replayed) if labels[i] == c and p < spans[j]["end"])
               for j, c in enumerate(path)}
    for j, c in enumerate(path[:-1]):
        later = [p for p, i in enumerate(replayed) if labels[i] == c and p >= spans[j]["end"]]
        assert len(later) == 30 and min(later) > own_end[c]


def test_segment_lengths_by_hand_and_the_path_ends():
    """Six clusters of 200, zones of 40. A zone draws (prev, own, next) = (8, 24, 8) inside the path and
    (0, 30, 10) at its ends (mirrored at the last); a segment is its two zones and a core of its size less its own
    zone draws and what its neighbours' zones take from it: 80 + 200 - 60 - 16 = 204 at the ends, 80 + 200 - 48 -
    36 = 196 next to them, 200 inside."""
    labels = np.repeat(np.arange(6), 200)
    path = [3, 1, 4, 0, 5, 2]
    order, segments = mixed_order(within_cluster_order(labels, seed=0), path, seed=0)
    assert [s["end"] - s["start"] for s in segments] == [204, 196, 200, 200, 196, 204]
    last = segments[-1]["drawn_from"]
    assert last.count(5) == 2 * round(0.25 * 40) and last.count(2) == 204 - 20  # no next cluster after the last
    # a first segment asked to draw from a previous cluster has none: it draws its own, never the path's last
    first = mixed_order(within_cluster_order(labels, seed=0), path, seed=0, end_mix=(0.2, 0.6, 0.2))[1][0]
    assert set(first["drawn_from"]) == {3, 1}
    # one cluster: no zones, its members in order
    one = within_cluster_order(np.zeros(5, dtype=int), seed=0)
    assert mixed_order(one, [0], seed=0) == (one[0], [{"cluster": 0, "start": 0, "end": 5, "zone": 0,
                                                       "drawn_from": [0] * 5}])


def test_zone_proportions_by_hand():
    path = [0, 1, 2, 3]
    segments = [{"zone": 2, "drawn_from": [0, 0, 0]},
                {"zone": 2, "drawn_from": [0, 1, 1, 1, 2, 1]},  # zones: prev, own | next, own
                {"zone": 2, "drawn_from": [2, 2, 2, 2, 3, 3]},  # zones: own, own | next, next
                {"zone": 2, "drawn_from": [3, 3]}]
    assert zone_proportions(segments, path) == [1 / 8, 4 / 8, 3 / 8]
    assert zone_proportions(segments[:2], path[:2]) == [0.0, 0.0, 0.0]  # no interior segment


def test_cosine_distances_and_normalize_by_hand():
    d = cosine_distances(np.array([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0]]))
    assert np.array_equal(d, np.array([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0], [2.0, 1.0, 0.0]]))
    rounded = cosine_distances(np.array([[1.0, 1.0, 1.0], [3.0, 4.0, 0.0]]))
    assert rounded[0, 0] == 0.0 and abs(rounded[0, 1] - (1 - 7 / (5 * 3 ** 0.5))) < 1e-12  # no -2e-16 self-distance
    assert np.array_equal(normalize(np.array([[0.0, 0.0], [3.0, 4.0]])), np.array([[0.0, 0.0], [0.6, 0.8]]))
    assert default_k(5513) == 11 and default_k(5512) == 10  # round(sqrt(N / 50)) either side of 10.5


def test_choose_k_skips_k_outside_two_to_n_minus_one():
    x, _ = _blobs(k=2, per=30)
    assert choose_k(x, 0, candidates=[2, 3], restarts=2) == 2
    six = _blobs(k=3, per=2)[0]
    assert choose_k(six, 0, candidates=[1, 3, 6], restarts=2) == 3  # 1 and N cannot be scored
    assert choose_k(x, 0) == default_k(len(x))


def test_two_opt_uncrosses_a_path_to_the_shortest():
    """Points on a line visited 0, 3, 1, 2, 4 (crossing back): 2-opt with the start fixed finds the sorted order,
    the shortest open path (brute force agrees)."""
    import itertools
    pts = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    line = np.abs(pts[:, None] - pts[None, :])
    best = two_opt([0, 3, 1, 2, 4], line)
    shortest = min(path_length([0, *p], line) for p in itertools.permutations(range(1, 5)))
    assert best == [0, 1, 2, 3, 4] and path_length(best, line) == shortest == 4.0
    assert two_opt([0, 1, 2, 3, 4], line) == [0, 1, 2, 3, 4]  # nothing to improve: unchanged
    assert two_opt([0, 3, 1, 2, 4], line / 100) == [0, 1, 2, 3, 4]  # improvements of any size count


def test_replay_is_seeded_and_reads_segments_without_draws():
    labels = np.repeat(np.arange(3), 20)
    order, segments = mixed_order(within_cluster_order(labels, seed=0), [0, 1, 2], seed=0, zone=0.0)
    spans = [{k: v for k, v in s.items() if k != "drawn_from"} for s in segments]  # as the stage's report keeps them
    once = spread_replay(order, spans, 0.5, seed=3)
    assert once == spread_replay(order, spans, 0.5, seed=3) and once != spread_replay(order, spans, 0.5, seed=4)
    assert "drawn_from" not in once[1][0] and sorted(once[0]) == sorted(order)


def test_within_cluster_order_by_warm_up_loss():
    labels = np.array([0, 1, 0, 1, 0])
    losses = np.array([0.5, 0.1, 0.2, 0.9, 0.3])
    assert within_cluster_order(labels, 0, losses) == {0: [2, 4, 0], 1: [1, 3]}
    shuffled = within_cluster_order(labels, 0)
    assert sorted(shuffled[0]) == [0, 2, 4] and shuffled == within_cluster_order(labels, 0)


def test_the_sequential_sampler_keeps_the_file_order_across_epochs():
    from rl.data import PromptSampler
    s = PromptSampler(5, seed=3, shuffle=False)
    assert s.next(7) == [0, 1, 2, 3, 4, 0, 1] and s.state() == {"epoch": 1, "pos": 2}
    assert sorted(PromptSampler(5, seed=3).next(5)) == list(range(5))


def test_warm_up_embeddings_cluster_the_synthetic_domains():
    """The spec's purity check: a tiny model warmed up on 10% of the string_domains rows, its mean-pooled last hidden
    states (prompt and response tokens), spherical k-means with k = 6: purity > 0.9."""
    import torch

    from models.families import CausalFamily, sequence_embeddings
    from models.tiny import build_tiny_model, build_tiny_tokenizer
    from rl.batch import batch_of_examples
    from rl.sft_data import prompt_response_example
    from rl.tasks.domains import domain_rows
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    rows = domain_rows(360, random.Random(0))
    examples = [prompt_response_example(tok, r["prompt"], r["target"]) for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(9):  # one epoch over a random 10% in batches of 4
        batch = batch_of_examples(random.Random(step).sample(examples[:36], 4), tok.pad_token_id)
        logp = CausalFamily().forward(model, batch)["logp"]
        loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    emb, _ = sequence_embeddings(model.eval(), batch_of_examples(examples, tok.pad_token_id), tokens="all")
    labels, _ = spherical_kmeans(emb.numpy(), 6, seed=0, restarts=3)
    truth = np.unique([r["domain"] for r in rows], return_inverse=True)[1]
    assert purity(labels, truth) > 0.9
