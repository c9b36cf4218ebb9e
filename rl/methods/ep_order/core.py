"""EP-Order: order training data by embedding proximity, with mixed transition regions between clusters.

[RECONSTRUCTION] No paper or code of EP-Order could be found; this follows the reconstruction of
rl/methods/ep_order/README.md (warm-up on a random 10%, embed, spherical k-means, a nearest-neighbour chain over
the centroids, mixed regions at (0.2, 0.6, 0.2)). Every rule below is a knob of the `ep_order` stage.

Pure functions over an embedding matrix, so that each step is testable alone:
  * `spherical_kmeans`: scikit-learn's k-means (k-means++ init, `restarts` restarts) on L2-normalised rows,
    centroids renormalised, every row assigned to the centroid of highest cosine;
  * `choose_k`: the spec's default `round(sqrt(N / 50))` clipped to [8, 64], or the best silhouette (cosine)
    over candidate k;
  * `greedy_chain` (+ `two_opt`): the cluster path, each step to the closest unvisited centroid;
  * `mixed_order`: the epoch's sample order; cluster j holds a contiguous segment of its own size whose first and
    last `zone` share draw from (previous, current, next) cluster at `mix` ((0, 0.75, 0.25) at the ends of the
    path), without replacement, so every sample appears exactly once;
  * `spread_replay` (`replay`, off by default): a share of each segment's rows moved to random later positions,
    so that later clusters revisit earlier ones.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np


def normalize(x: np.ndarray) -> np.ndarray:
    return x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)


def spherical_kmeans(emb: np.ndarray, k: int, seed: int, restarts: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Cluster labels `[N]` and unit centroids `[k, d]` of the rows of `emb` under cosine similarity."""
    from sklearn.cluster import KMeans
    x = normalize(np.asarray(emb, dtype=np.float64))
    km = KMeans(n_clusters=k, init="k-means++", n_init=restarts, random_state=seed).fit(x)
    centroids = normalize(km.cluster_centers_)
    return (x @ centroids.T).argmax(axis=1), centroids


def default_k(n: int, low: int = 8, high: int = 64) -> int:
    return int(min(high, max(low, round(math.sqrt(n / 50)))))


def choose_k(emb: np.ndarray, seed: int, candidates: Sequence[int] = (), restarts: int = 10) -> int:
    """`default_k(N)` without candidates; else the candidate k of highest mean silhouette (cosine)."""
    if not candidates:
        return default_k(len(emb))
    from sklearn.metrics import silhouette_score
    x = normalize(np.asarray(emb, dtype=np.float64))
    scores = {k: silhouette_score(x, spherical_kmeans(x, k, seed, restarts)[0], metric="cosine")
              for k in candidates if 2 <= k < len(x)}
    return max(scores, key=scores.get)


def cosine_distances(centroids: np.ndarray) -> np.ndarray:
    c = normalize(centroids)
    return np.clip(1.0 - c @ c.T, 0.0, 2.0)


def path_length(path: Sequence[int], dist: np.ndarray) -> float:
    return float(sum(dist[a, b] for a, b in zip(path, path[1:])))


def greedy_chain(dist: np.ndarray, start: int) -> list[int]:
    """From `start`, repeatedly to the closest unvisited cluster (ties: the lowest index)."""
    path, left = [start], set(range(len(dist))) - {start}
    while left:
        here = path[-1]
        path.append(min(left, key=lambda j: (dist[here, j], j)))
        left.remove(path[-1])
    return path


def two_opt(path: list[int], dist: np.ndarray) -> list[int]:
    """The open path improved by 2-opt segment reversals (the start stays first) until no reversal shortens it."""
    best = list(path)
    improved = True
    while improved:
        improved = False
        for i in range(1, len(best) - 1):
            for j in range(i + 1, len(best)):
                cand = best[:i] + best[i:j + 1][::-1] + best[j + 1:]
                if path_length(cand, dist) < path_length(best, dist) - 1e-12:
                    best, improved = cand, True
    return best


def within_cluster_order(labels: np.ndarray, seed: int, losses: np.ndarray | None = None) -> dict[int, list[int]]:
    """Each cluster's sample indices: a seeded shuffle, or by ascending warm-up loss when `losses` is given."""
    rng = random.Random(seed)
    out = {}
    for c in sorted(set(labels.tolist())):
        idx = [i for i in range(len(labels)) if labels[i] == c]
        if losses is None:
            rng.shuffle(idx)
        else:
            idx.sort(key=lambda i: (losses[i], i))
        out[c] = idx
    return out


def zone_sources(size: int, props: Sequence[float], rng: random.Random) -> list[int]:
    """`size` draws from (previous, current, next) = (-1, 0, +1) in the proportions `props` (counts rounded so
    they sum to `size`), interleaved in a seeded random order."""
    counts = [int(round(p * size)) for p in props]
    counts[1] = size - counts[0] - counts[2]
    draws = [-1] * counts[0] + [0] * counts[1] + [1] * counts[2]
    rng.shuffle(draws)
    return draws


def mixed_order(members: dict[int, list[int]], path: Sequence[int], seed: int, zone: float = 0.2,
                mix: Sequence[float] = (0.2, 0.6, 0.2), end_mix: Sequence[float] = (0.0, 0.75, 0.25)
                ) -> tuple[list[int], list[dict]]:
    """The epoch's order and its segments. Cluster `path[j]` occupies a contiguous segment: a leading and a
    trailing transition zone of `zone` times its size each, drawing from the previous, current and next cluster
    of the path at `mix` (`end_mix` at the first cluster, mirrored at the last), and a core drawing from the
    cluster alone, as long as what is left of it after its own zone draws and what its neighbours' zones borrow.
    Draws are without replacement and every sample appears exactly once (a pool that runs dry, possible next to
    a much larger cluster, is replaced by the current cluster's, then by the nearest non-empty one along the
    path). Each segment record gives its span, zone size and, per position, the cluster drawn from."""
    rng = random.Random(seed)
    k = len(path)
    sizes = [len(members[c]) for c in path]
    zones = []
    for j, n in enumerate(sizes):
        z = int(round(zone * n)) if k > 1 else 0
        props = end_mix if j == 0 else tuple(reversed(end_mix)) if j == k - 1 else mix
        zones.append((zone_sources(z, props, rng), zone_sources(z, props, rng)))
    own = [sum(d == 0 for zs in zones[j] for d in zs) for j in range(k)]
    lent = [sum(d == 1 for zs in zones[j - 1] for d in zs) if j > 0 else 0 for j in range(k)]
    lent = [lent[j] + (sum(d == -1 for zs in zones[j + 1] for d in zs) if j + 1 < k else 0) for j in range(k)]
    pools = {c: list(reversed(members[c])) for c in path}  # popped from the end: the cluster's order
    order, segments = [], []
    for j, c in enumerate(path):
        lead, trail = zones[j]
        plan = lead + [0] * max(0, sizes[j] - own[j] - lent[j]) + trail
        start, drawn_from = len(order), []
        for step in plan:
            if not any(pools.values()):  # cores cut to zero next to much larger clusters: all is placed
                break
            want = j + step if 0 <= j + step < k else j
            src = next(path[t] for t in [want, j, *sorted(range(k), key=lambda t: (abs(t - j), t))] if pools[path[t]])
            order.append(pools[src].pop())
            drawn_from.append(src)
        segments.append({"cluster": c, "start": start, "end": len(order), "zone": len(lead), "drawn_from": drawn_from})
    # every sample is placed: the plans add up to at least the rows (each zone draw from a neighbour is taken off
    # that neighbour's core), and each step pops one while any is left
    return order, segments


def spread_replay(order: list[int], segments: list[dict], share: float, seed: int) -> tuple[list[int], list[dict]]:
    """Replay of earlier clusters within one epoch [RECONSTRUCTION: the brief names no replay; this is the arm a
    cluster curriculum needs against forgetting, as DSR's curriculum replays 10-30% of earlier phases]: a random
    `share` of each segment's rows (all but the last segment's) leaves its segment and lands at uniform random
    positions after it, so every later stretch of the epoch revisits the clusters before it in proportion to
    their size. Every row still appears exactly once (the epoch's length is the same); segments keep their order,
    with their new spans and `replayed`, the earlier rows that landed in them. `drawn_from`, when the segments
    carry it, follows each row."""
    if share <= 0:
        return list(order), [dict(s) for s in segments]
    rng, n = random.Random(seed), len(order)
    keys = [float(p) for p in range(n)]
    moved = set()
    for seg in segments[:-1]:
        span = list(range(seg["start"], seg["end"]))
        for p in rng.sample(span, int(round(share * len(span)))):
            keys[p] = rng.uniform(seg["end"], n)
            moved.add(p)
    ranked = sorted(range(n), key=lambda p: keys[p])
    source = {}
    for seg in segments:
        for p, c in zip(range(seg["start"], seg["end"]), seg.get("drawn_from", [])):
            source[p] = c
    out = []
    for seg in segments:
        start = sum(k < seg["start"] for k in keys)
        end = sum(k < seg["end"] for k in keys)
        new = {**seg, "start": start, "end": end, "replayed": sum(ranked[i] in moved for i in range(start, end))}
        if "drawn_from" in seg:
            new["drawn_from"] = [source[ranked[i]] for i in range(start, end)]
        out.append(new)
    return [order[p] for p in ranked], out


def zone_proportions(segments: list[dict], path: Sequence[int]) -> list[float]:
    """Shares of (previous, current, next) cluster among the transition-zone draws of the interior segments."""
    counts = [0, 0, 0]
    for j, seg in enumerate(segments[1:-1], start=1):
        z, drawn = seg["zone"], seg["drawn_from"]
        for src in drawn[:z] + drawn[len(drawn) - z:]:
            rel = {path[j - 1]: 0, path[j]: 1, path[j + 1]: 2}.get(src)
            if rel is not None:
                counts[rel] += 1
    total = max(1, sum(counts))
    return [c / total for c in counts]
