"""KV-cache compression by query-guided key importance: BeaconKV and the baselines it is measured against
(rl/methods/beaconkv/README.md). Pure torch: the `hf` engine's cache policies (`rl.methods.beaconkv.decoding`) and the
synthetic attention harness (`attention_harness`) share these functions.

BeaconKV (confirmed mechanism, from the abstract and two method notes; no released code):
* the observation set is the recent queries plus beacon queries;
* beacons are chosen by farthest point sampling with cosine distance over historical pre-RoPE queries
  (`farthest_point_sampling`), kept per head in a bounded buffer that is FPS-downsampled from an upper to a lower
  limit when full (`QueryBuffer`, the continual "fill → compress" cycle; the full history is never stored);
* beacons get RoPE at the current decoding position (`rope`), recent queries keep their own positions;
* a key's importance is the max over observation queries and over the query heads of its GQA group of the
  attention probability on it (`key_importance`);
* the top-B keys by importance are kept, plus the first `sink` and the last `recent` tokens (`select_keep`).
[RECONSTRUCTION]: buffer limits 256 / 64 per head; eviction every `interval` tokens (the paper's notes: periodic).

Baselines (their published scoring rules at this level of detail): SnapKV (summed attention of the last `window`
queries, max-pooled along the sequence with kernel 7), H2O (attention accumulated over every query so far),
R-KV (mean attention of the recent queries minus a redundancy term, the key's mean cosine similarity to the
other keys, mixed λ·I − (1−λ)·R on min-max-normalised terms, λ = 0.1) and Initial + Recent (StreamingLLM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def farthest_point_sampling(x: torch.Tensor, k: int, start: int = 0) -> torch.Tensor:
    """Indices of `k` rows of `x [N, D]` chosen greedily to maximise the minimum cosine distance to those already
    chosen, from row `start`. Distinct indices always (identical points included: a chosen row is never chosen
    again); all N when k ≥ N."""
    n = x.shape[0]
    if k >= n:
        return torch.arange(n, device=x.device)
    unit = F.normalize(x.float(), dim=-1)
    chosen = torch.empty(k, dtype=torch.long, device=x.device)
    chosen[0] = start
    min_dist = 1.0 - unit @ unit[start]
    min_dist[start] = float("-inf")
    for i in range(1, k):
        j = int(min_dist.argmax())
        chosen[i] = j
        min_dist = torch.minimum(min_dist, 1.0 - unit @ unit[j])
        min_dist[chosen[:i + 1]] = float("-inf")
    return chosen


class QueryBuffer:
    """Per-head bounded buffers of pre-RoPE queries: rows are appended until a head holds more than `upper`, then
    FPS-downsampled to `lower` (continual FPS). `beacons(k)`: FPS picks of `k` per head from what is held."""

    def __init__(self, upper: int = 256, lower: int = 64):
        if not 0 < lower < upper:
            raise ValueError(f"QueryBuffer: need 0 < lower < upper, got lower {lower}, upper {upper}")
        self.upper, self.lower = upper, lower
        self.data: torch.Tensor | None = None  # [H, n, D]
        self.compressions = 0

    def add(self, queries: torch.Tensor) -> None:
        """Append `queries [H, T, D]` (one head per row of the first dimension)."""
        q = queries.detach().float()
        self.data = q if self.data is None else torch.cat([self.data, q], 1)
        if self.data.shape[1] > self.upper:
            # the newest query starts each FPS: the buffer keeps what is new and what is far from it
            self.data = torch.stack([h[farthest_point_sampling(h, self.lower, start=h.shape[0] - 1)]
                                     for h in self.data])
            self.compressions += 1

    def __len__(self) -> int:
        return 0 if self.data is None else self.data.shape[1]

    def beacons(self, k: int) -> torch.Tensor:
        """`[H, min(k, n), D]`: FPS representatives of each head's buffer."""
        assert self.data is not None
        return torch.stack([h[farthest_point_sampling(h, k, start=h.shape[0] - 1)] for h in self.data])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the Llama convention (`x·cos + rotate_half(x)·sin`), cos and sin broadcast to `x`."""
    return x * cos + rotate_half(x) * sin


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE cos and sin `[*positions.shape, head_dim]` (no scaling): the harness's and the tests' reference."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = positions.float()[..., None] * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def attention_probs(queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of `queries [Hq, M, D]` on `keys [Hkv, S, D]` (query head h reads KV head h // (Hq/Hkv)),
    scaled by 1/√D; `valid [S]` masks keys out. Returns `[Hq, M, S]`."""
    hq, hkv = queries.shape[0], keys.shape[0]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    k = keys.float().repeat_interleave(hq // hkv, 0)
    scores = queries.float() @ k.transpose(-1, -2) / math.sqrt(queries.shape[-1])
    if valid is not None:
        scores = scores.masked_fill(~valid.bool(), float("-inf"))
    return scores.softmax(-1)


def key_importance(queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """BeaconKV's score `[Hkv, S]`: the max over observation queries and over the query heads of each KV head's
    GQA group of the attention probability on each key."""
    probs = attention_probs(queries, keys, valid)  # [Hq, M, S]
    hkv = keys.shape[0]
    per_query_head = probs.amax(1)  # over the observation queries
    return per_query_head.view(hkv, -1, probs.shape[-1]).amax(1)  # over the heads of each group


def select_keep(scores: torch.Tensor, budget: int, sink: int, recent: int, valid: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Per KV head, the indices (ascending) of the first `sink` and last `recent` valid keys plus the `budget`
    others with the highest `scores [H, S]`: `[H, min(S, budget + sink + recent)]`. Invalid keys (padding) are
    kept only when fewer valid keys than the kept count exist, and then they come first."""
    H, S = scores.shape
    keep = min(S, budget + sink + recent)
    v = torch.ones(S, dtype=torch.bool, device=scores.device) if valid is None else valid.bool()
    rank = torch.cumsum(v.long(), 0) - 1  # index among the valid keys
    n_valid = int(v.sum())
    forced = v & ((rank < sink) | (rank >= n_valid - recent))
    s = scores.float().clone()
    s[:, forced] = float("inf")
    s[:, ~v] = float("-inf")
    # ties (e.g. -inf padding) resolve to the earlier index, so kept padding is the leftmost
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    return order[:, :keep].sort(-1).values


def snapkv_scores(window_queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None = None,
                  kernel: int = 7) -> torch.Tensor:
    """SnapKV: attention of the observation window's queries summed over the window and the GQA group, then
    max-pooled along the sequence (`kernel`) so neighbours of an attended key count. `[Hkv, S]`."""
    probs = attention_probs(window_queries, keys, valid).sum(1)  # [Hq, S]
    hkv = keys.shape[0]
    grouped = probs.view(hkv, -1, probs.shape[-1]).sum(1)
    return F.max_pool1d(grouped[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]


def rkv_scores(window_queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None = None,
               lam: float = 0.1) -> torch.Tensor:
    """R-KV: λ·importance − (1−λ)·redundancy, importance the mean attention of the recent queries (over them and
    the GQA group), redundancy the key's mean cosine similarity to the other valid keys; both min-max normalised
    per head. `[Hkv, S]`."""
    probs = attention_probs(window_queries, keys, valid).mean(1)
    hkv = keys.shape[0]
    imp = probs.view(hkv, -1, probs.shape[-1]).mean(1)
    unit = F.normalize(keys.float(), dim=-1)
    sim = unit @ unit.transpose(-1, -2)
    v = torch.ones(keys.shape[1], dtype=torch.bool, device=keys.device) if valid is None else valid.bool()
    sim = sim.masked_fill(~v[None, None, :], 0.0)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    red = sim.sum(-1) / max(int(v.sum()) - 1, 1)

    def norm(t: torch.Tensor) -> torch.Tensor:
        lo, hi = t.amin(-1, keepdim=True), t.amax(-1, keepdim=True)
        return (t - lo) / (hi - lo).clamp(min=1e-12)
    return lam * norm(imp) - (1 - lam) * norm(red)


@dataclass
class HarnessConfig:
    """The spec's synthetic attention harness (the minimal tiny implementation): `steps` decoding steps with
    random keys; `plan_keys` keys planted early that `revisit_frac` of the queries (three clusters) come back to;
    the other queries are local (aimed at the last few keys)."""
    steps: int = 4000
    dim: int = 128
    plan_keys: int = 12
    plan_start: int = 16
    clusters: int = 3
    revisit_frac: float = 0.05
    local_window: int = 8
    strength: float = 30.0  # query norm / √dim: how peaked the attention is (a logit is strength × cosine)
    noise: float = 0.3
    local_share: float = 1.0  # weight of the shared local direction in a local query (its content part has norm 1)


def harness_stream(cfg: HarnessConfig, seed: int) -> dict[str, torch.Tensor]:
    """Keys `[T, D]`, values `[T, D]`, queries `[T, D]` and `revisit [T]` (bool) of one synthetic decode."""
    g = torch.Generator().manual_seed(seed)
    T, D = cfg.steps, cfg.dim
    # local queries share a direction no key carries (in a real model, the part of a query that RoPE turns into
    # attention to recent tokens): local queries then cluster in query space as revisit queries do, and
    # adding it moves no attention
    local_dir = F.normalize(torch.randn(D, generator=g), dim=0)
    keys = torch.randn(T, D, generator=g)
    keys = F.normalize(keys - (keys @ local_dir)[:, None] * local_dir, dim=-1)
    values = torch.randn(T, D, generator=g)
    centers = torch.randn(cfg.clusters, D, generator=g)
    centers = F.normalize(centers - (centers @ local_dir)[:, None] * local_dir, dim=-1)
    plan_pos = torch.arange(cfg.plan_start, cfg.plan_start + cfg.plan_keys)
    plan_cluster = torch.arange(cfg.plan_keys) % cfg.clusters
    # a plan key lies near its cluster's centre: a revisit query of that cluster attends to all of its plan keys
    keys[plan_pos] = F.normalize(centers[plan_cluster] + 0.3 * torch.randn(cfg.plan_keys, D, generator=g) / math.sqrt(D),
                                 dim=-1)
    queries = torch.empty(T, D)
    revisit = torch.rand(T, generator=g) < cfg.revisit_frac
    revisit[:cfg.plan_start + cfg.plan_keys + cfg.local_window] = False
    for t in range(T):
        if revisit[t]:
            c = int(torch.randint(cfg.clusters, (1,), generator=g))
            base = centers[c]
        else:
            lo = max(0, t - cfg.local_window)
            w = torch.rand(t + 1 - lo, generator=g)
            base = cfg.local_share * local_dir + F.normalize((w[:, None] * keys[lo:t + 1]).sum(0), dim=0)
        q = F.normalize(base, dim=-1) + cfg.noise * torch.randn(D, generator=g) / math.sqrt(D)
        queries[t] = cfg.strength * math.sqrt(D) * F.normalize(q, dim=-1)
    return {"keys": keys, "values": values, "queries": queries, "revisit": revisit}


def simulate_policy(stream: dict[str, torch.Tensor], policy: str, budget: int, *, sink: int = 4, recent: int = 16,
                    n_recent_queries: int = 16, n_beacon: int = 16, upper: int = 256, lower: int = 64,
                    window: int = 32, interval: int = 1, measure_from: int | None = None) -> dict[str, float]:
    """Decode the stream with one cache policy (full | beacon | snapkv | h2o | rkv | streaming) at `budget`: at
    step t key t enters the cache, query t reads it, then, when the cache holds more than budget + sink + recent
    keys, the policy evicts down to that bound minus `interval` − 1 (so evictions come every `interval` steps).
    BeaconKV observes its `n_recent_queries` last queries and `n_beacon` beacons; SnapKV and R-KV the last `window`
    queries. Per query from `measure_from` on (default: the step the cache first fills): the share of its
    full-cache softmax mass on the retained keys (recall) and the relative error of its attention output; means
    over local and over revisit queries, and the largest cache size left by the policy."""
    keys, values, queries, revisit = stream["keys"], stream["values"], stream["queries"], stream["revisit"]
    T, D = keys.shape
    cap = budget + sink + recent
    start = cap if measure_from is None else measure_from
    kept = torch.empty(0, dtype=torch.long)
    buffer = QueryBuffer(upper, lower)
    h2o_acc = torch.zeros(T)
    rec, err, is_rev = [], [], []
    max_size = 0
    for t in range(T):
        kept = torch.cat([kept, torch.tensor([t])])
        q = queries[t]
        full = (keys[:t + 1] @ q / math.sqrt(D)).softmax(-1)
        if t >= start:
            mass = full[kept].sum()
            sub = (keys[kept] @ q / math.sqrt(D)).softmax(-1)
            out_full, out_kept = full @ values[:t + 1], sub @ values[kept]
            rec.append(float(mass))
            err.append(float((out_full - out_kept).norm() / out_full.norm().clamp(min=1e-12)))
            is_rev.append(bool(revisit[t]))
        if policy == "h2o":
            h2o_acc[kept] += (keys[kept] @ q / math.sqrt(D)).softmax(-1)
        buffer.add(q[None, None])
        if policy != "full" and len(kept) > cap:
            target = cap - (interval - 1)
            k_now = keys[kept][None]  # one KV head
            window_q = queries[max(0, t + 1 - window):t + 1][None]
            if policy == "beacon":
                obs = torch.cat([queries[max(0, t + 1 - n_recent_queries):t + 1][None], buffer.beacons(n_beacon)], 1)
                scores = key_importance(obs, k_now)
            elif policy == "snapkv":
                scores = snapkv_scores(window_q, k_now)
            elif policy == "rkv":
                scores = rkv_scores(window_q, k_now)
            elif policy == "h2o":
                scores = h2o_acc[kept][None]
            elif policy == "streaming":  # the sink and the newest keys
                scores = kept[None].float()
            else:
                raise ValueError(f"unknown policy {policy!r}")
            kept = kept[select_keep(scores, max(target - sink - recent, 0), sink, recent)[0]]
        max_size = max(max_size, len(kept))
    rev = torch.tensor(is_rev)
    r, e = torch.tensor(rec), torch.tensor(err)
    return {"recall_revisit": float(r[rev].mean()) if rev.any() else float("nan"),
            "recall_local": float(r[~rev].mean()), "output_error_revisit": float(e[rev].mean()) if rev.any() else float("nan"),
            "output_error_local": float(e[~rev].mean()), "max_cache": max_size, "revisit_queries": int(rev.sum())}
