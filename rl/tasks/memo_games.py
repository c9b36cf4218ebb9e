"""A synthetic harness for MEMO at tiny scale (task `memo_tictactoe`): SFT data that teaches a tiny model to
play TicTacToe by the strategy hint in its context, and to act as MEMO's analyzer.

This is a labelled synthetic harness: it measures MEMO's mechanism (prompt populations, insight memory,
selection by tournaments) with a model whose play depends on its context in a known way, not a model that
understands games. What the model is taught (every example is rendered with the `memo` stage's own prompt
builders, so the stage asks exactly what was taught):

* **Player** (the stage's `agent_prompt` / `baseline_prompt` around the game's observation, cut to its last
  `observation_chars` characters, which hold the available moves): when its context (prompt, then memory)
  contains one of the strategy hints of `HINTS`, it plays the first free cell of the first hint's order;
  without a hint (the baseline template, the base prompt, junk) it plays a uniformly random free cell.
  The hints differ in strength against a random player: by simulation the center-first and diagonal orders
  win about 72% of games, the corner and row orders about 60%, the edges-first order 33% (random play: 43%).
* **Analyzer** (the stage's requests in their compact form, `requests: compact`): a style variation or a random prompt → a uniformly random hint;
  a memory-guided prompt → the first hint among the listed insights; a crossover or trajectory rewrite →
  the first hint of the prompts it is given; the insight request → three lines: the hint of the
  best-ranked agent that has one, a format insight, the hint of the next such agent. The analyzer never
  sees which hint is good: the tournaments' ranking is its only signal, as in MEMO.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from rl.memo import BASE_PROMPT
from rl.registry import register

GAME = "TicTacToe-v0"
HINTS = {
    "Take the center first, then the corners.": [4, 0, 2, 6, 8, 1, 3, 5, 7],
    "Claim the main diagonal, starting top left.": [0, 4, 8, 2, 6, 1, 3, 5, 7],
    "Take the corners first, then the center.": [0, 2, 8, 6, 4, 1, 3, 5, 7],
    "Fill the board from the bottom right.": [8, 7, 6, 5, 4, 3, 2, 1, 0],
    "Fill the board from the top left.": [0, 1, 2, 3, 4, 5, 6, 7, 8],
    "Play the edges first, then the rest.": [1, 3, 5, 7, 4, 0, 2, 6, 8],
}
FORMAT_INSIGHT = "Answer with boxed n, n a free cell."
_JUNK = "abcdefghijklmnopqrstuvwxyz ,.!?;:-0123456789"


def first_hint(text: str) -> str | None:
    """The hint of `HINTS` that appears first in `text` (None when none does)."""
    found = [(text.find(h), h) for h in HINTS if h in text]
    return min(found)[1] if found else None


def hint_move(hint: str | None, free: list[int], rng: random.Random) -> int:
    """The taught player's move: the hint's first free cell, or a random free cell without a hint."""
    if hint is None:
        return rng.choice(free)
    return next(c for c in HINTS[hint] if c in free)


def free_cells(observation: str) -> list[int]:
    """The free cells listed by the game's observation (its last 'Available Moves' line)."""
    tail = observation[observation.rfind("Available Moves"):]
    return [int(x) for x in re.findall(r"\[(\d)\]", tail)]


def junk(rng: random.Random, lo: int = 8, hi: int = 40) -> str:
    return "".join(rng.choice(_JUNK) for _ in range(rng.randint(lo, hi))).strip() or "x"


def random_prompt_text(rng: random.Random) -> str:
    """A candidate prompt as the stage may hold one: a hint, the base prompt with or without a hint, junk."""
    hint = rng.choice(list(HINTS))
    return rng.choice([hint, hint, f"{BASE_PROMPT} {hint}", BASE_PROMPT, junk(rng), f"{junk(rng, 4, 12)} {hint}"])


def game_observations(num: int, rng: random.Random, seed_base: int) -> list[str]:
    """Observations of TicTacToe positions reached by random play (TextArena's own text)."""
    from rollout.games import TextArenaGame
    out: list[str] = []
    k = 0
    while len(out) < num:
        game = TextArenaGame(GAME, seed_base + k, ["a", "b"])
        k += 1
        while not game.done and len(out) < num:
            _, obs = game.current()
            out.append(obs)
            game.play("\\boxed{" + str(rng.choice(free_cells(obs))) + "}")
    return out


def player_rows(num: int, observation_chars: int, rng: random.Random, seed_base: int) -> list[dict[str, Any]]:
    from rl.memo_stage import agent_prompt, baseline_prompt
    rows = []
    for obs in game_observations(num, rng, seed_base):
        tail = obs[-observation_chars:] if observation_chars > 0 else obs
        free = free_cells(obs)
        if rng.random() < 0.2:
            context = prompt = baseline_prompt(tail)
        else:
            memory = [rng.choice([*HINTS, FORMAT_INSIGHT, junk(rng)]) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
            text = random_prompt_text(rng)
            prompt = agent_prompt(text, memory, tail)
            context = text + "\n" + "\n".join(memory)
        hint = first_hint(context)
        move = hint_move(hint, free, rng)
        rows.append({"prompt": prompt, "target": "\\boxed{" + str(move) + "}", "kind": "player",
                     "determined": hint is not None})
    return rows


def analyzer_rows(num: int, rng: random.Random) -> list[dict[str, Any]]:
    from rl.memo_stage import (
        STYLES,
        crossover_request,
        insight_request,
        memory_guided_request,
        random_request,
        style_request,
        trajectory_request,
    )
    hints = list(HINTS)
    rows = []
    for _ in range(num):
        kind = rng.choice(["style", "random", "memory", "memory", "insight", "insight", "insight", "crossover",
                           "trajectory"])
        determined = False  # whether the taught answer is fixed by the prompt (else drawn at random)
        if kind == "style":
            prompt, target = style_request(GAME, BASE_PROMPT, rng.choice(STYLES), True), rng.choice(hints)
        elif kind == "random":
            prompt, target = random_request(GAME, True), rng.choice(hints)
        elif kind == "memory":
            insights = [rng.choice([*hints, FORMAT_INSIGHT, junk(rng)]) for _ in range(rng.randint(1, 4))]
            prompt = memory_guided_request(GAME, insights, True)
            determined = first_hint("\n".join(insights)) is not None
            target = first_hint("\n".join(insights)) or rng.choice(hints)
        elif kind == "crossover":
            a, b = random_prompt_text(rng), random_prompt_text(rng)
            prompt, target = crossover_request(GAME, a, b, True), first_hint(a) or first_hint(b) or rng.choice(hints)
            determined = bool(first_hint(a) or first_hint(b))
        elif kind == "trajectory":
            a = random_prompt_text(rng)
            prompt, target = trajectory_request(GAME, a, "", True), first_hint(a) or rng.choice(hints)
            determined = first_hint(a) is not None
        else:
            agents = []
            for _ in range(rng.randint(2, 4)):
                n = rng.randint(2, 10)
                agents.append((random_prompt_text(rng), rng.randint(0, n), n))
            agents.sort(key=lambda a: a[1], reverse=True)
            found = [h for h in (first_hint(p) for p, _, _ in agents) if h is not None]
            best = found[0] if found else rng.choice(hints)
            second = found[1] if len(found) > 1 else best
            prompt = insight_request(GAME, agents, "", "", 3, compact=True)
            target = f"1. {best}\n2. {FORMAT_INSIGHT}\n3. {second}"
            determined = bool(found)
        rows.append({"prompt": prompt, "target": target, "kind": f"analyzer:{kind}", "determined": determined})
    return rows


def write_memo_task(out_dir: str | Path, num_player: int = 6000, num_analyzer: int = 3000,
                    observation_chars: int = 80, seed: int = 0) -> dict[str, str]:
    """`sft.jsonl` (player and analyzer rows, shuffled) and a one-row `train`/`eval` pair (MEMO trains no
    policy: the data stage's splits only have to exist)."""
    rng = random.Random(seed)
    rows = player_rows(num_player, observation_chars, rng, seed * 100_000) + analyzer_rows(num_analyzer, rng)
    rng.shuffle(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"sft": out / "sft.jsonl", "train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    paths["sft"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    for split in ("train", "eval"):
        paths[split].write_text(json.dumps({"prompt": BASE_PROMPT, "answer": ""}) + "\n")
    return {k: str(v) for k, v in paths.items()}


@register("task", "memo_tictactoe")
def memo_tictactoe_task(out_dir: str | Path, *, num_train: int, seed: int, sft_fraction: float = 0.67,
                        **_: Any) -> dict[str, str]:
    """`data.synthetic`: `num_train` SFT rows, `sft_fraction` of them player rows, the rest analyzer rows."""
    n_player = int(num_train * sft_fraction)
    return write_memo_task(out_dir, num_player=n_player, num_analyzer=num_train - n_player, seed=seed)
