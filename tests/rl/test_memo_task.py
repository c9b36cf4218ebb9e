"""The MEMO tiny harness's SFT data: what the player and the analyzer are taught, rendered with the stage's
own prompt builders."""

import json
import random

from rl.memo_stage import agent_prompt, baseline_prompt
from rl.tasks.memo_games import FORMAT_INSIGHT, HINTS, first_hint, free_cells, hint_move, write_memo_task

CENTER, EDGES = "Take the center first, then the corners.", "Play the edges first, then the rest."


def test_the_first_hint_in_the_context_decides_the_move():
    assert first_hint(f"junk {EDGES} then {CENTER}") == EDGES
    assert first_hint("no strategy here") is None
    rng = random.Random(0)
    assert hint_move(CENTER, [0, 1, 2, 4], rng) == 4
    assert hint_move(CENTER, [1, 2, 3], rng) == 2
    assert hint_move(EDGES, [0, 1, 4], rng) == 1
    assert {hint_move(None, [3, 5], rng) for _ in range(50)} == {3, 5}


def test_the_sft_rows_are_the_stages_prompts_with_the_taught_targets(tmp_path):
    paths = write_memo_task(tmp_path, num_player=300, num_analyzer=300, seed=3)
    rows = [json.loads(x) for x in open(paths["sft"])]
    assert len(rows) == 600
    players = [r for r in rows if r["kind"] == "player"]
    for r in players:
        obs = r["prompt"].split("Observation: ", 1)[1]
        cells = free_cells(obs)
        move = int(r["target"][len("\\boxed{"):-1])
        assert move in cells
        hint = first_hint(r["prompt"].split("Observation: ", 1)[0])
        if hint is not None:
            assert move == next(c for c in HINTS[hint] if c in cells)
    tail = players[0]["prompt"].split("Observation: ", 1)[1]
    # a player prompt is exactly what the stage renders: the plain template or a candidate's turn
    assert any(r["prompt"] == baseline_prompt(r["prompt"].split("Observation: ", 1)[1].rstrip("\n"))
               for r in players)
    assert tail and len(tail) < 200
    memory_rows = [r for r in rows if r["kind"] == "analyzer:memory"]
    assert memory_rows
    for r in memory_rows:
        listed = r["prompt"].split(":\n", 1)[1].split("Write a strategy", 1)[0]
        if first_hint(listed):
            assert r["target"] == first_hint(listed)
    insight = [r for r in rows if r["kind"] == "analyzer:insight"]
    for r in insight:
        ranked = r["prompt"].split("best first:\n", 1)[1].split("Write 3 insights", 1)[0]
        lines = r["target"].splitlines()
        assert len(lines) == 3 and lines[1] == f"2. {FORMAT_INSIGHT}"
        if first_hint(ranked):
            assert lines[0] == f"1. {first_hint(ranked)}"
    assert agent_prompt(CENTER, [], "x").startswith(CENTER)
