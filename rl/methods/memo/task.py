"""A synthetic harness for MEMO at tiny scale (task `memo`): SFT data that teaches a tiny model to play
TicTacToe and Kuhn poker by the strategy hint in its context, and to act as MEMO's analyzer.

This is a labelled synthetic harness: it measures MEMO's mechanism (prompt populations, insight memory,
selection by tournaments) with a model whose play depends on its context in a known way, not a model that
understands games. What the model is taught (every example is rendered with the `memo` stage's own prompt
builders, so the stage asks exactly what was taught):

* **Player** (the stage's `agent_prompt` / `baseline_prompt` around the game's observation, cut to its last
  `observation_chars` characters, which hold the free cells, or the card and the legal actions): when its
  context (prompt, then memory) holds one of the game's strategy hints (`GAMES[game].hints`), it plays what
  the first such hint says; without a hint (the baseline template, the base prompt, junk) it plays a
  uniformly random legal move. The hints differ in strength against a random player (by simulation):
  TicTacToe, center-first and diagonal orders win about 72% of games, corner and row orders about 60%,
  edges-first 33% (random play 43%); Kuhn poker (5 rounds), betting strong cards and calling about 64%, the
  tighter rules 40–56%, always check and fold 11%.
* **Analyzer** (the stage's requests in their compact form, `requests: compact`): a style variation or a
  random prompt → a uniformly random hint of the game; a memory-guided prompt → the first hint among the
  listed insights; a crossover or trajectory rewrite → the first hint of the prompts it is given; the
  insight request (agents ranked by fitness, a game line per agent, the replay buffer's decisive positions
  with the move that won most from each) → three lines: the hint of the best-ranked agent that has one, a
  format insight, and the hint that plays the decisive positions' winning moves earliest (`decisive_hint`;
  without positions, the hint of the next-ranked agent). The analyzer never sees which hint is good: the
  tournaments' ranking and the moves that won in the replayed positions are its only signals, as in MEMO.
  The game lines are in its requests (reflection on) but its taught answer does not depend on them.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl.methods.memo.core import BASE_PROMPT
from rl.registry import register, register_alias

_JUNK = "abcdefghijklmnopqrstuvwxyz ,.!?;:-0123456789"


def _ttt_legal(observation: str) -> list[str]:
    tail = observation[observation.rfind("Available Moves"):]
    return re.findall(r"\[(\d)\]", tail)


def _ttt_move(rule: list[int], observation: str) -> str:
    free = {int(x) for x in _ttt_legal(observation)}
    return str(next(c for c in rule if c in free))


def _kuhn_legal(observation: str) -> list[str]:
    return re.findall(r"'\[(\w+)\]'", observation[observation.rfind("available actions"):])


def _kuhn_move(rule: dict[str, dict[str, str]], observation: str) -> str:
    card = re.findall(r"Your card is: '(\w)'", observation)[-1]
    return rule["facing" if "call" in _kuhn_legal(observation) else "open"][card]


def _ttt_rank(rule: list[int], move: str) -> int:
    """How early a TicTacToe rule plays `move` ('[4]' or '4'): its place in the rule's order."""
    cell = move.strip("[]")
    return rule.index(int(cell)) if cell.isdigit() and int(cell) in rule else len(rule)


def _kuhn_rank(rule: dict[str, dict[str, str]], move: str) -> int:
    """How readily a Kuhn rule plays `move`: minus the number of (situation, card) cells it plays it in."""
    action = move.strip("[]")
    return -sum(a == action for table in rule.values() for a in table.values())


def _kuhn(open_: str, facing: str) -> dict[str, dict[str, str]]:
    """A Kuhn rule from the actions with J, Q, K: opening (check/bet) and facing a bet (fold/call)."""
    word = {"c": "check", "b": "bet", "f": "fold", "a": "call"}
    return {"open": dict(zip("JQK", (word[x] for x in open_))), "facing": dict(zip("JQK", (word[x] for x in facing)))}


@dataclass(frozen=True)
class GameSpec:
    hints: dict[str, Any]  # strategy sentence -> the rule the taught player follows
    legal: Callable[[str], list[str]]  # the legal moves an observation lists
    move: Callable[[Any, str], str]  # (rule, observation) -> the move
    rank: Callable[[Any, str], int]  # (rule, move) -> how readily the rule plays it (lower: more)
    moves: tuple[str, ...]  # the moves as games record them (for the harness's game lines)
    format_insight: str
    observation_chars: int  # the observation tail the stage shows the player (the recipe's setting)


GAMES = {
    "TicTacToe-v0": GameSpec(
        hints={"Take the center first, then the corners.": [4, 0, 2, 6, 8, 1, 3, 5, 7],
               "Claim the main diagonal, starting top left.": [0, 4, 8, 2, 6, 1, 3, 5, 7],
               "Take the corners first, then the center.": [0, 2, 8, 6, 4, 1, 3, 5, 7],
               "Fill the board from the bottom right.": [8, 7, 6, 5, 4, 3, 2, 1, 0],
               "Fill the board from the top left.": [0, 1, 2, 3, 4, 5, 6, 7, 8],
               "Play the edges first, then the rest.": [1, 3, 5, 7, 4, 0, 2, 6, 8]},
        legal=_ttt_legal, move=_ttt_move, rank=_ttt_rank, moves=tuple(f"[{i}]" for i in range(9)),
        format_insight="Answer with boxed n, n a free cell.",
        observation_chars=80),
    "KuhnPoker-v0-short": GameSpec(
        hints={"Bet with a King or Queen, call with them, fold a Jack.": _kuhn("cbb", "faa"),
               "Always bet and always call.": _kuhn("bbb", "aaa"),
               "Bet with a King, call with a Queen or King.": _kuhn("ccb", "faa"),
               "Bet a King or a Jack, call only with a King.": _kuhn("bcb", "ffa"),
               "Check everything, call only with a King.": _kuhn("ccc", "ffa"),
               "Always check and fold to any bet.": _kuhn("ccc", "fff")},
        legal=_kuhn_legal, move=_kuhn_move, rank=_kuhn_rank, moves=("[check]", "[bet]", "[fold]", "[call]"),
        format_insight="Answer with boxed action, a listed action.",
        observation_chars=260),
}


def first_hint(text: str, game: str) -> str | None:
    """The hint of `game` that appears first in `text` (None when none does)."""
    found = [(text.find(h), h) for h in GAMES[game].hints if h in text]
    return min(found)[1] if found else None


def decisive_hint(game: str, moves: list[str]) -> str:
    """The hint whose rule plays the decisive positions' winning moves most readily: compared on the first
    (best-scored) position's move, ties broken by the next ones, then by the hints' order."""
    hints = GAMES[game].hints
    return min(hints, key=lambda h: ([GAMES[game].rank(hints[h], m) for m in moves], list(hints).index(h)))


def hint_move(hint: str | None, observation: str, game: str, rng: random.Random) -> str:
    """The taught player's move: what the hint's rule says, or a random legal move without a hint."""
    spec = GAMES[game]
    return rng.choice(spec.legal(observation)) if hint is None else spec.move(spec.hints[hint], observation)


def junk(rng: random.Random, lo: int = 8, hi: int = 40) -> str:
    return "".join(rng.choice(_JUNK) for _ in range(rng.randint(lo, hi))).strip() or "x"


def random_prompt_text(rng: random.Random, game: str) -> str:
    """A candidate prompt as the stage may hold one: a hint, the base prompt with or without a hint, junk."""
    hint = rng.choice(list(GAMES[game].hints))
    return rng.choice([hint, hint, f"{BASE_PROMPT} {hint}", BASE_PROMPT, junk(rng), f"{junk(rng, 4, 12)} {hint}"])


def game_observations(game: str, num: int, rng: random.Random, seed_base: int) -> list[str]:
    """Observations of positions reached by random play (TextArena's own text)."""
    from rl.methods.memo.textarena import TextArenaGame
    out: list[str] = []
    k = 0
    while len(out) < num:
        g = TextArenaGame(game, seed_base + k, ["a", "b"])
        k += 1
        while not g.done and len(out) < num:
            _, obs = g.current()
            out.append(obs)
            g.play("\\boxed{" + rng.choice(GAMES[game].legal(obs)) + "}")
    return out


def player_rows(game: str, num: int, rng: random.Random, seed_base: int) -> list[dict[str, Any]]:
    from rl.methods.memo.stage import agent_prompt, baseline_prompt
    spec = GAMES[game]
    rows = []
    for obs in game_observations(game, num, rng, seed_base):
        tail = obs[-spec.observation_chars:]
        if rng.random() < 0.2:
            context = prompt = baseline_prompt(tail)
        else:
            memory = [rng.choice([*spec.hints, spec.format_insight, junk(rng)])
                      for _ in range(rng.choice([0, 0, 1, 2, 3]))]
            text = random_prompt_text(rng, game)
            prompt = agent_prompt(text, memory, tail)
            context = text + "\n" + "\n".join(memory)
        hint = first_hint(context, game)
        rows.append({"prompt": prompt, "target": "\\boxed{" + hint_move(hint, obs, game, rng) + "}",
                     "kind": "player", "game": game, "determined": hint is not None})
    return rows


def _game_line(game: str, agent: str, rng: random.Random) -> str:
    """A game line as the stage writes it for a compact request (random moves and outcome)."""
    from rl.methods.memo.stage import summarize_game
    moves = GAMES[game].moves
    steps = [{"player": i % 2, "action": rng.choice(moves), "invalid": rng.random() < 0.05}
             for i in range(rng.randint(2, 9))]
    record = {"agents": [agent, "baseline"] if rng.random() < 0.5 else ["baseline", agent], "failed": False,
              "winners": rng.choice([[0], [1], []]), "steps": steps}
    return summarize_game(record, agent, compact=True)


def _decisive_states(game: str, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    """Strategic states as the replay buffer returns them (random moves and counts), best first."""
    out = []
    for i in range(rng.randint(1, 3)):
        plays = rng.randint(2, 9)
        wins = rng.randint(1, plays)
        moves = {rng.choice(GAMES[game].moves): [wins, plays]}
        out.append((f"s{i}", {"player": rng.randint(0, 1), "wins": wins, "losses": plays - wins, "count": plays,
                              "moves": moves}))
    return out


def insight_row(game: str, rng: random.Random) -> tuple[str, str, bool]:
    """An insight request (agents ranked, maybe game lines, maybe decisive positions) and its taught answer:
    the best-ranked agent's hint, the format insight, the decisive positions' hint (else the next agent's)."""
    from rl.methods.memo.core import decisive_move
    from rl.methods.memo.stage import decisive_text, insight_request
    spec = GAMES[game]
    agents = []
    for _ in range(rng.randint(2, 6)):
        n = rng.randint(2, 10)
        agents.append((random_prompt_text(rng, game), rng.randint(0, n), n))
    agents.sort(key=lambda a: a[1], reverse=True)
    games_text = ""
    if rng.random() < 0.6:
        games_text = "\n\n".join(f"Agent: {p}\n- {_game_line(game, 'c', rng)}" for p, _, _ in agents)
    states = _decisive_states(game, rng) if rng.random() < 0.75 else []
    found = [h for h in (first_hint(p, game) for p, _, _ in agents) if h is not None]
    best = found[0] if found else rng.choice(list(spec.hints))
    third = (decisive_hint(game, [decisive_move(st)[0] for _, st in states]) if states else
             found[1] if len(found) > 1 else best)
    prompt = insight_request(game, agents, games_text, decisive_text(states, compact=True), 3, compact=True)
    return prompt, f"1. {best}\n2. {spec.format_insight}\n3. {third}", bool(found) and (bool(states) or
                                                                                      len(found) > 1)


def analyzer_rows(game: str, num: int, rng: random.Random) -> list[dict[str, Any]]:
    from rl.methods.memo.stage import (
        STYLES,
        crossover_request,
        memory_guided_request,
        random_request,
        style_request,
        trajectory_request,
    )
    spec = GAMES[game]
    hints = list(spec.hints)
    rows = []
    for _ in range(num):
        kind = rng.choice(["style", "random", "memory", "memory", "insight", "insight", "insight", "crossover",
                           "trajectory"])
        determined = False  # whether the taught answer is fixed by the prompt (else drawn at random)
        if kind == "style":
            prompt, target = style_request(game, BASE_PROMPT, rng.choice(STYLES), True), rng.choice(hints)
        elif kind == "random":
            prompt, target = random_request(game, True), rng.choice(hints)
        elif kind == "memory":
            insights = [rng.choice([*hints, spec.format_insight, junk(rng)]) for _ in range(rng.randint(1, 4))]
            prompt = memory_guided_request(game, insights, True)
            found = first_hint("\n".join(insights), game)
            target, determined = found or rng.choice(hints), found is not None
        elif kind == "crossover":
            a, b = random_prompt_text(rng, game), random_prompt_text(rng, game)
            found = first_hint(a, game) or first_hint(b, game)
            prompt, target, determined = crossover_request(game, a, b, True), found or rng.choice(hints), bool(found)
        elif kind == "trajectory":
            a = random_prompt_text(rng, game)
            found = first_hint(a, game)
            prompt, target, determined = trajectory_request(game, a, "", True), found or rng.choice(hints), bool(found)
        else:
            prompt, target, determined = insight_row(game, rng)
        rows.append({"prompt": prompt, "target": target, "kind": f"analyzer:{kind}", "game": game,
                     "determined": determined})
    return rows


def write_memo_task(out_dir: str | Path, games: list[str] | None = None, num_player: int = 6000,
                    num_analyzer: int = 3000, seed: int = 0) -> dict[str, str]:
    """`sft.jsonl` (player and analyzer rows of every game, shuffled; `num_player` / `num_analyzer` per game)
    and a one-row `train`/`eval` pair (MEMO trains no policy: the data stage's splits only have to exist)."""
    rng = random.Random(seed)
    rows = []
    for i, game in enumerate(games or list(GAMES)):
        if game not in GAMES:
            raise ValueError(f"memo: no harness for game {game!r}; it has {list(GAMES)}")
        rows += player_rows(game, num_player, rng, seed * 100_000 + i * 10_000) + analyzer_rows(game, num_analyzer, rng)
    rng.shuffle(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"sft": out / "sft.jsonl", "train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    paths["sft"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    for split in ("train", "eval"):
        paths[split].write_text(json.dumps({"prompt": BASE_PROMPT, "answer": ""}) + "\n")
    return {k: str(v) for k, v in paths.items()}


def harness_tokens() -> list[str]:
    """The fixed phrases of the harness's texts (hints, templates, the games' recurring text), each one token
    of the tiny model's tokenizer (`model.tiny.task_tokens`): a turn reads as some 40-120 tokens instead of
    300-700 characters."""
    from rl.methods.memo.stage import MOVE_SUFFIX, STYLES, baseline_prompt
    phrases = [h for spec in GAMES.values() for h in spec.hints] + [s.format_insight for s in GAMES.values()]
    phrases += [BASE_PROMPT, *GAMES, *STYLES, baseline_prompt("").rstrip("\n"), "Insights from past games:\n",
                "Observation: ", f"\n\n{MOVE_SUFFIX}", "\\boxed{", "1. ", "2. ", "3. ", "4. ", "\n\n",
                # the compact analyzer requests (rl.methods.memo.stage)
                "Rewrite as a ", " strategy in 1-3 sentences: ", "\nStrategy:", "Invent a new ",
                " strategy in 1-3 sentences.", "Insights for ", "Write a strategy from these insights in 1-3 sentences.",
                " prompt: ", "\nGames:\n", "Improve the prompt in 1-3 sentences.", "Combine two ",
                " strategies in 1-3 sentences.", " agents, best first:\n", " (won ", " of ",
                "Write 3 insights, one per line.\nInsights:",
                "\nGames (moves marked * were invalid):\n", "\nDecisive positions:\n", "Agent: ", "- seat 0, ",
                "- seat 1, ", "win; moves ", "loss; moves ", "draw; moves ", " played ", ": won ", "P0:", "P1:",
                "- P0", "- P1",
                # the games' own text (TextArena)
                "Available Moves: ", "---+---+---", " | ", "[GAME] ", "Current Board:", "Your card is: ",
                "Your available actions are: ", "[Player 0] ", "[Player 1] ", "submitted move: ", "### Starting round ",
                " out of 5 rounds. ", "Showdown: ", "Current scores: ", "Player 0", "Player 1", " wins pot of ",
                " chips.", "has folded.", "attempted an invalid move.", "[check]", "[bet]", "[fold]", "[call]"]
    phrases += [f"'[{i}]'" for i in range(9)] + [f"[{i}]" for i in range(9)]
    return [p for p in dict.fromkeys(phrases) if len(p) > 1]


@register("task", "memo")
def memo_games_task(out_dir: str | Path, *, num_train: int, seed: int, sft_fraction: float = 0.67,
                    **_: Any) -> dict[str, str]:
    """`data.synthetic`: `num_train` SFT rows per game, `sft_fraction` of them player rows, the rest analyzer rows."""
    n_player = int(num_train * sft_fraction)
    return write_memo_task(out_dir, num_player=n_player, num_analyzer=num_train - n_player, seed=seed)


memo_games_task.added_tokens = harness_tokens()  # read by the model stage (model.tiny.task_tokens)

register_alias("task", "memo_games", "memo")
