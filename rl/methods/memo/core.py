"""MEMO's algorithm core: the pieces of self-play context optimisation that involve no model and no game.

MEMO (rl/methods/memo/README.md, from the released code) optimises a model's *context* — a prompt plus a
memory of insights — by self-play tournaments; it changes no weights. The stage that runs it
(`rl.methods.memo.stage`) plays the games on the rollout engines; this module holds what it decides with:

* `tournament_schedule` / `tournament_games`: the `vs_baseline` schedule (every candidate plays the
  baseline `rounds` times in both seat orders: N·rounds·2 games a generation).
* `rate_games`: the batch TrueSkill update after a tournament (the `trueskill` library, `beta=4.0`, library
  defaults otherwise), match by match in game order, ranks from rewards; replayed games are left out.
* `PrefixReplayBuffer`: prioritized prefix replay — SHA-256 of the action prefix, inverse-frequency
  priority `1/count`, `P ∝ priority^α`, FIFO capacity — and the strategic states
  `|win_rate − loss_rate| · ln(1 + count)` (count ≥ 2, wins ≥ 1) with the move that won most from each.
* `parse_crud` / `apply_crud`: the memory bank's CRUD merge (`<add>`, `<edit number="k">`,
  `<remove number="k">`, applied remove → edit → add; an ADD whose word overlap with a kept insight
  exceeds 0.6 × the shorter is dropped; the newest `max_insights` are kept).
* `population_plan`: how many elites, random, memory-guided, trajectory and crossover candidates the next
  generation gets from the recipe's shares (floors, topped up to N with memory-guided ones).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# The released base prompt (the move is submitted inside \boxed{}).
BASE_PROMPT = ("You are playing a two-player zero-sum game. Make valid moves to win. "
               "submit the move enclosed by \\boxed{}")
TRUESKILL_BETA = 4.0  # the released code's TrueSkill(beta=4.0); everything else is the library's default


# ------------------------------------------------------------------ tournaments and ratings
def tournament_schedule(candidates: list[str], rounds: int, baseline: str = "baseline") -> list[tuple[str, str]]:
    """`vs_baseline`: each candidate plays the baseline `rounds` times in both seat orders. Returns the
    games as `(seat 0, seat 1)` agent ids, candidate-major."""
    games = []
    for cand in candidates:
        for _ in range(rounds):
            games.append((cand, baseline))
            games.append((baseline, cand))
    return games


def tournament_games(num_candidates: int, rounds: int, generations: int) -> int:
    """Tournament games of a whole run (replayed games included; evaluation games are not)."""
    return num_candidates * rounds * 2 * generations


def ranks_from_rewards(rewards: list[float]) -> list[int]:
    """TrueSkill ranks (0 = best; equal rewards tie) from per-seat rewards (1 win, −1 loss, 0 draw)."""
    order = sorted(set(rewards), reverse=True)
    return [order.index(r) for r in rewards]


def trueskill_env(beta: float = TRUESKILL_BETA) -> Any:
    import trueskill
    return trueskill.TrueSkill(beta=beta)


def rate_games(ratings: dict[str, Any], games: list[dict[str, Any]], env: Any | None = None) -> dict[str, Any]:
    """The batch update after a tournament: each non-replayed game (`agents`, `rewards`, `replayed`) in
    order updates its players' ratings (`trueskill.Rating`, created at the library's prior when new).
    Returns the updated mapping (a new dict; `ratings` is not changed)."""
    env = env or trueskill_env()
    out = dict(ratings)
    for g in games:
        if g.get("replayed") or g.get("failed"):
            continue
        agents, rewards = list(g["agents"]), list(g["rewards"])
        if len(agents) != len(rewards):
            raise ValueError(f"game {g.get('game_id')}: {len(agents)} agents but {len(rewards)} rewards")
        groups = [(out.get(a) or env.create_rating(),) for a in agents]
        new = env.rate(groups, ranks=ranks_from_rewards(rewards))
        for a, (r,) in zip(agents, new):
            out[a] = r
    return out


@dataclass
class Record:
    """Win/loss/draw counts of an agent over non-replayed games (`failed` games are counted apart)."""
    wins: int = 0
    losses: int = 0
    draws: int = 0
    failed: int = 0
    invalid_moves: int = 0
    moves: int = 0

    @property
    def games(self) -> int:
        return self.wins + self.losses + self.draws

    def rate(self, what: str) -> float:
        return getattr(self, what) / self.games if self.games else 0.0


def records(games: list[dict[str, Any]]) -> dict[str, Record]:
    """Per agent: W/L/D over the non-replayed games, failed games, and invalid moves over all its moves."""
    out: dict[str, Record] = {}
    for g in games:
        for seat, agent in enumerate(g["agents"]):
            rec = out.setdefault(agent, Record())
            rec.invalid_moves += int(g.get("invalid_moves", [0] * len(g["agents"]))[seat])
            rec.moves += int(g.get("moves", [0] * len(g["agents"]))[seat])
            if g.get("replayed"):
                continue
            if g.get("failed"):
                rec.failed += 1
                continue
            mine, others = g["rewards"][seat], [r for i, r in enumerate(g["rewards"]) if i != seat]
            if all(mine > o for o in others):
                rec.wins += 1
            elif any(mine < o for o in others):
                rec.losses += 1
            else:
                rec.draws += 1
    return out


# ------------------------------------------------------------------ prioritized prefix replay
def prefix_hash(played: list[tuple[int, str]]) -> str:
    """SHA-256 of an action prefix `[(player, action), ...]`."""
    return hashlib.sha256(repr([(int(p), str(a)) for p, a in played]).encode()).hexdigest()


@dataclass
class ReplayEntry:
    played: list[tuple[int, str]]  # the action prefix up to and including this step's action
    state: str  # the game state before this step's action (JSON)
    player: int  # who acted
    winners: list[int]  # seats that won the game (empty: draw)
    seed: int  # the game's env seed (a replay restarts the game with it)
    hash: str = ""
    priority: float = 1.0


class PrefixReplayBuffer:
    """FIFO buffer of game steps with inverse-frequency priorities over action prefixes.

    `count[h]` counts every push of prefix `h` ever (evictions do not lower it); on a push every entry
    with that hash gets priority `1/count[h]`. Sampling draws entry `e` with `P(e) ∝ priority_e^α`."""

    def __init__(self, capacity: int = 1000, alpha: float = 0.6):
        self.entries: deque[ReplayEntry] = deque(maxlen=capacity)
        self.alpha = alpha
        self.counts: dict[str, int] = {}
        self.sampled: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def push(self, entry: ReplayEntry) -> None:
        entry.hash = prefix_hash(entry.played)
        self.counts[entry.hash] = self.counts.get(entry.hash, 0) + 1
        entry.priority = 1.0 / self.counts[entry.hash]
        self.entries.append(entry)
        for e in self.entries:
            if e.hash == entry.hash:
                e.priority = entry.priority

    def push_game(self, steps: list[dict[str, Any]], winners: list[int], seed: int) -> int:
        """All non-terminal steps of a game (`player`, `action`, `state` per step; the last step ended it).
        Returns how many were pushed."""
        for i, step in enumerate(steps[:-1]):
            played = [(s["player"], s["action"]) for s in steps[:i + 1]]
            self.push(ReplayEntry(played=played, state=step["state"], player=step["player"], winners=list(winners),
                                  seed=seed))
        return max(0, len(steps) - 1)

    def probabilities(self) -> list[float]:
        weights = [e.priority ** self.alpha for e in self.entries]
        total = sum(weights)
        return [w / total for w in weights]

    def sample(self, rng: random.Random) -> ReplayEntry | None:
        if not self.entries:
            return None
        entry = rng.choices(list(self.entries), weights=self.probabilities(), k=1)[0]
        self.sampled[entry.hash] = self.sampled.get(entry.hash, 0) + 1
        return entry

    def strategic_states(self, topk: int = 10) -> list[tuple[str, dict[str, Any]]]:
        """Decisive states: grouped by exact state, kept with count ≥ 2 and wins ≥ 1 (for the player to move),
        scored `|win_rate − loss_rate| · ln(1 + count)`, best `topk` first. Each state's `moves` maps the
        actions played from it to `[wins, plays]` of the player who played them (what `decisive_move` reads)."""
        stats: dict[str, dict[str, Any]] = {}
        for e in self.entries:
            s = stats.setdefault(e.state, {"wins": 0, "losses": 0, "draws": 0, "count": 0, "player": e.player,
                                           "moves": {}})
            s["count"] += 1
            move = s["moves"].setdefault(e.played[-1][1], [0, 0])
            move[1] += 1
            if e.player in e.winners:
                s["wins"] += 1
                move[0] += 1
            elif not e.winners:
                s["draws"] += 1
            else:
                s["losses"] += 1
        scored = [(strategic_score(s["wins"], s["losses"], s["count"]), k, s) for k, s in stats.items()
                  if s["count"] >= 2 and s["wins"] >= 1]
        scored.sort(key=lambda x: x[0], reverse=True)
        return [(k, {**s, "score": sc}) for sc, k, s in scored[:topk]]

    def stats(self) -> dict[str, float]:
        return {"size": float(len(self.entries)), "distinct_prefixes": float(len({e.hash for e in self.entries})),
                "replays_sampled": float(sum(self.sampled.values()))}


def strategic_score(wins: int, losses: int, count: int) -> float:
    return abs(wins / count - losses / count) * math.log1p(count)


def decisive_move(stats: dict[str, Any]) -> tuple[str, int, int]:
    """The move that won most often from a strategic state: `(action, wins, plays)`, most wins first, then the
    higher win share, then the move seen first. [DEVIATION] The released code has an analyzer write a free-text
    abstract of each state; rendering the winning move gives a small-context analyzer the same information."""
    action, (wins, plays) = max(stats["moves"].items(), key=lambda kv: (kv[1][0], kv[1][0] / kv[1][1]))
    return action, wins, plays


# ------------------------------------------------------------------ insight memory (CRUD)
_ADD = re.compile(r"<add>(.*?)</add>", re.DOTALL)
_EDIT = re.compile(r"<edit\s+number=\"?(\d+)\"?\s*>(.*?)</edit>", re.DOTALL)
_REMOVE = re.compile(r"<remove\s+number=\"?(\d+)\"?\s*>(.*?)</remove>", re.DOTALL)


@dataclass
class CrudOps:
    adds: list[str] = field(default_factory=list)
    edits: list[tuple[int, str]] = field(default_factory=list)  # (1-based number, text)
    removes: list[int] = field(default_factory=list)  # 1-based numbers

    def __bool__(self) -> bool:
        return bool(self.adds or self.edits or self.removes)


def parse_crud(text: str) -> CrudOps:
    """The analyzer's `<add>…</add>`, `<edit number="k">…</edit>`, `<remove number="k">…</remove>` tags."""
    ops = CrudOps()
    ops.adds = [m.group(1).strip() for m in _ADD.finditer(text) if m.group(1).strip()]
    ops.edits = [(int(m.group(1)), m.group(2).strip()) for m in _EDIT.finditer(text) if m.group(2).strip()]
    ops.removes = [int(m.group(1)) for m in _REMOVE.finditer(text)]
    return ops


def word_overlap_duplicate(a: str, b: str, threshold: float = 0.6) -> bool:
    """Duplicate when the words the two insights share (distinct) exceed `threshold` × the shorter insight's word
    count (every word, repeats included, as the released code counts it)."""
    a_words, b_words = a.lower().split(), b.lower().split()
    return len(set(a_words) & set(b_words)) > threshold * min(len(a_words), len(b_words))


def apply_crud(insights: list[str], ops: CrudOps, max_insights: int = 15, dup_overlap: float = 0.6
               ) -> tuple[list[str], dict[str, int]]:
    """Remove, then edit (numbers refer to the list before the removals), then add (duplicates dropped);
    keep the newest `max_insights`. Numbers out of range change nothing and are counted as `ignored`; so is
    an edit of an insight removed by the same answer (the released code then edits its successor instead).
    An update that would empty a non-empty bank keeps the old one (as the released code does)."""
    counts = {"removed": 0, "edited": 0, "added": 0, "duplicates": 0, "ignored": 0}
    removed = sorted({k - 1 for k in ops.removes if 1 <= k <= len(insights)})
    counts["ignored"] += sum(1 for k in ops.removes if not 1 <= k <= len(insights))
    out = [x for i, x in enumerate(insights) if i not in set(removed)]
    counts["removed"] = len(removed)
    for k, text in ops.edits:
        idx = k - 1
        if not 0 <= idx < len(insights) or idx in removed:
            counts["ignored"] += 1
            continue
        out[idx - sum(1 for r in removed if r < idx)] = text
        counts["edited"] += 1
    for text in ops.adds:
        if any(word_overlap_duplicate(x, text, dup_overlap) for x in out):
            counts["duplicates"] += 1
            continue
        out.append(text)
        counts["added"] += 1
    out = out[-max_insights:] if max_insights > 0 else out
    if not out and insights:
        return list(insights), counts
    return out, counts


def merge_insights(bank: list[str], new: list[str], style: str, max_insights: int = 15,
                   dup_overlap: float = 0.6) -> list[str]:
    """Merge styles of the released scripts: `no_merge` (only this generation's insights) and `basic` (append
    the new ones to the bank, duplicates dropped, newest `max_insights` kept)."""
    if style == "no_merge":
        return list(new)[-max_insights:]
    if style == "basic":
        return apply_crud(bank, CrudOps(adds=list(new)), max_insights, dup_overlap)[0]
    raise ValueError(f"memo memory_merge {style!r}: expected no_merge | basic | crud")


# ------------------------------------------------------------------ population
POPULATION_SHARES = ("keep", "random", "memory_guided", "trajectory", "crossover")


def population_plan(size: int, shares: dict[str, float]) -> dict[str, int]:
    """Candidates of the next generation by origin: `⌊N·share⌋` each, then topped up to N with memory-guided
    ones (or random when the recipe gives memory-guided no share)."""
    unknown = set(shares) - set(POPULATION_SHARES)
    if unknown:
        raise ValueError(f"memo population shares: unknown {sorted(unknown)}; known {list(POPULATION_SHARES)}")
    plan = {k: int(math.floor(size * shares.get(k, 0.0) + 1e-9)) for k in POPULATION_SHARES}
    if sum(plan.values()) > size:
        raise ValueError(f"memo population shares {shares} ask for {sum(plan.values())} candidates, more than {size}")
    plan["memory_guided" if shares.get("memory_guided", 0) > 0 else "random"] += size - sum(plan.values())
    return plan
