"""The MEMO tiny harness's SFT data: what the player and the analyzer are taught, rendered with the stage's
own prompt builders, for TicTacToe and Kuhn poker."""

import json
import random

import pytest

from rl.methods.memo.stage import baseline_prompt
from rl.methods.memo.task import GAMES, decisive_hint, first_hint, hint_move, write_memo_task

TTT, KUHN = "TicTacToe-v0", "KuhnPoker-v0-short"
CENTER, EDGES = "Take the center first, then the corners.", "Play the edges first, then the rest."


def test_the_first_hint_in_the_context_decides_the_move():
    assert first_hint(f"junk {EDGES} then {CENTER}", TTT) == EDGES
    assert first_hint("no strategy here", TTT) is None
    assert first_hint(CENTER, KUHN) is None  # hints belong to their game
    rng = random.Random(0)
    board = "Available Moves: '[0]', '[1]', '[2]', '[4]'"
    assert hint_move(CENTER, board, TTT, rng) == "4"
    assert hint_move(CENTER, "Available Moves: '[1]', '[2]', '[3]'", TTT, rng) == "2"
    assert hint_move(EDGES, board, TTT, rng) == "1"
    assert {hint_move(None, "Available Moves: '[3]', '[5]'", TTT, rng) for _ in range(50)} == {"3", "5"}
    opening = "Your card is: 'Q'\n[GAME] Your available actions are: '[check]', '[bet]'"
    facing = "Your card is: 'Q'\n[Player 1] [bet]\n[GAME] Your available actions are: '[fold]', '[call]'"
    value = "Bet with a King or Queen, call with them, fold a Jack."
    tight = "Check everything, call only with a King."
    assert hint_move(value, opening, KUHN, rng) == "bet" and hint_move(value, facing, KUHN, rng) == "call"
    assert hint_move(tight, opening, KUHN, rng) == "check" and hint_move(tight, facing, KUHN, rng) == "fold"
    assert {hint_move(None, facing, KUHN, rng) for _ in range(50)} == {"fold", "call"}


@pytest.mark.parametrize("game", [TTT, KUHN])
def test_the_sft_rows_are_the_stages_prompts_with_the_taught_targets(tmp_path, game):
    paths = write_memo_task(tmp_path, games=[game], num_player=300, num_analyzer=300, seed=3)
    rows = [json.loads(x) for x in open(paths["sft"])]
    assert len(rows) == 600 and {r["game"] for r in rows} == {game}
    spec = GAMES[game]
    players = [r for r in rows if r["kind"] == "player"]
    for r in players:
        head, obs = r["prompt"].split("Observation: ", 1)
        move = r["target"][len("\\boxed{"):-1]
        assert move in spec.legal(obs)  # the tail the player sees lists the move it is taught
        hint = first_hint(head, game)
        assert r["determined"] == (hint is not None)
    # a player prompt is exactly what the stage renders: the plain template or a candidate's turn
    assert any(r["prompt"] == baseline_prompt(r["prompt"].split("Observation: ", 1)[1].rstrip("\n"))
               for r in players)
    shown = [r["prompt"].split("Observation: ", 1)[1].split("\n\nSubmit your move", 1)[0] for r in players]
    assert max(len(x.rstrip("\n")) for x in shown) == spec.observation_chars  # the stage's observation_chars
    for r in (r for r in rows if r["kind"] == "analyzer:memory"):
        listed = r["prompt"].split(":\n", 1)[1].split("Write a strategy", 1)[0]
        if first_hint(listed, game):
            assert r["target"] == first_hint(listed, game) and r["determined"]
    insight = [r for r in rows if r["kind"] == "analyzer:insight"]
    assert insight
    for r in insight:
        ranked = r["prompt"].split("best first:\n", 1)[1].split("Write 3 insights", 1)[0]
        lines = r["target"].splitlines()
        assert len(lines) == 3 and lines[1] == f"2. {spec.format_insight}"
        if first_hint(ranked, game):
            assert lines[0] == f"1. {first_hint(ranked, game)}"
        if "Decisive positions:\n" in r["prompt"]:
            listed = r["prompt"].split("Decisive positions:\n", 1)[1].split("Write 3 insights", 1)[0]
            moves = [line.split(" played ", 1)[1].split(":", 1)[0] for line in listed.strip().splitlines()]
            assert lines[2] == f"3. {decisive_hint(game, moves)}"
    assert sum("Decisive positions:" in r["prompt"] for r in insight) > len(insight) / 2
    assert sum("Games (moves marked" in r["prompt"] for r in insight) > len(insight) / 3


def test_the_decisive_positions_hint_is_the_rule_that_plays_their_winning_moves_earliest():
    assert decisive_hint(TTT, ["[4]"]) == CENTER
    # [0] opens the diagonal, the corners and the top-left orders; [8] comes third in the first two, and the
    # diagonal is listed first; [2] comes second in the corners order
    assert decisive_hint(TTT, ["[0]", "[8]"]) == "Claim the main diagonal, starting top left."
    assert decisive_hint(TTT, ["[0]", "[2]"]) == "Take the corners first, then the center."
    assert decisive_hint(TTT, ["[1]"]) == EDGES
    # Kuhn: the rule that plays the action with the most (situation, card) cells
    assert decisive_hint(KUHN, ["[fold]"]) == "Always check and fold to any bet."
    assert decisive_hint(KUHN, ["[bet]"]) == "Always bet and always call."


def test_an_unknown_game_has_no_harness(tmp_path):
    with pytest.raises(ValueError, match="no harness for game 'Chess-v0'"):
        write_memo_task(tmp_path, games=["Chess-v0"], num_player=1, num_analyzer=1)
