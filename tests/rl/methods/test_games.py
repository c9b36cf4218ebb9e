"""The five MEMO games of TextArena through looprl's game wrapper and `env` contract: moves parsed from
`\\boxed{}`, invalid moves judged by the game's own rules, replayed prefixes, failed games bounded."""

import re

import pytest

from models.tiny import save_tiny
from rl.methods.memo.textarena import GAMES, INVALID, TextArenaEnv, TextArenaGame, parse_move
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine
from rollout.multiturn import Seats, run_episodes


def first_listed_move(obs: str, env_id: str) -> str:
    """A scripted player for the tests: the first move the observation lists (Deny in the negotiation)."""
    if "Negotiation" in env_id:
        return "I keep my goods. \\boxed{Deny}"
    if "Briscola" in env_id:
        return "\\boxed{play 1}"
    listed = re.findall(r"\[[^\]]+\]", obs[obs.rfind("vailable"):])
    return "\\boxed{" + listed[0] + "}"


def play_out(game: TextArenaGame, answer=first_listed_move) -> None:
    while not game.done:
        _, obs = game.current()
        game.play(answer(obs, game.record.env_id))


def test_moves_are_read_from_boxed_then_brackets():
    assert parse_move("I take the center. \\boxed{4}") == ("[4]", True)
    assert parse_move("\\boxed{[play 2]} and \\boxed{3}") == ("[play 2]", True)
    assert parse_move("\\boxed{} then [bet]") == ("[bet]", False)
    assert parse_move("I fold [check] no [call]") == ("[call]", False)
    assert parse_move("no move here") == (INVALID, False)


@pytest.mark.parametrize("env_id", GAMES)
def test_every_game_plays_to_its_end_through_the_wrapper(env_id):
    game = TextArenaGame(env_id, seed=1, agents=["cand", "base"], max_moves=200)
    play_out(game)
    rec = game.record
    assert not rec.failed and rec.reason
    assert sorted(rec.rewards) in ([-1.0, 1.0], [0.0, 0.0])
    assert rec.winners == ([rec.rewards.index(1.0)] if 1.0 in rec.rewards else [])
    assert len(rec.steps) >= 3 and {s["player"] for s in rec.steps} == {0, 1}
    assert all(s["format_ok"] and not s["invalid"] for s in rec.steps)
    assert rec.moves == [sum(s["player"] == p for s in rec.steps) for p in (0, 1)]


def test_invalid_moves_follow_the_games_own_rules():
    game = TextArenaGame("TicTacToe-v0", seed=0, agents=["a", "b"])
    game.play("\\boxed{4}")
    assert not game.play("I am not sure")  # the game's error allowance: one retry
    assert game.current()[0] == 1
    assert game.play("\\boxed{4}")  # occupied again: the second invalid move loses
    rec = game.record
    assert rec.rewards == [1.0, -1.0] and rec.winners == [0] and rec.invalid_moves == [0, 2]
    assert [s["format_ok"] for s in rec.steps] == [True, False, True]


def test_a_replayed_prefix_reaches_the_same_state_with_the_same_seed():
    original = TextArenaGame("KuhnPoker-v0-short", seed=11, agents=["a", "b"])
    play_out(original)
    prefix = [(s["player"], s["action"]) for s in original.record.steps[:4]]
    replayed = TextArenaGame("KuhnPoker-v0-short", seed=11, agents=["a", "b"])
    replayed.replay(prefix)
    assert replayed.record.replayed and replayed.record.replay_length == 4
    assert replayed.current()[0] == original.record.steps[4]["player"]
    play_out(replayed)
    assert [s["state"] for s in replayed.record.steps[:5]] == [s["state"] for s in original.record.steps[:5]]
    assert replayed.record.moves == [sum(1 for s in replayed.record.steps[4:] if s["player"] == p) for p in (0, 1)]
    wrong = TextArenaGame("TicTacToe-v0", seed=0, agents=["a", "b"])
    wrong.replay([(1, "[4]")])  # player 0 moves first in this game
    assert wrong.done and wrong.record.failed and "replayed prefix" in wrong.record.error


def test_a_game_past_its_move_budget_or_raising_is_a_failed_game():
    game = TextArenaGame("SimpleNegotiation-v0-short", seed=0, agents=["a", "b"], max_moves=3)
    play_out(game)
    assert game.record.failed and "move budget" in game.record.error and game.record.rewards == [0.0, 0.0]
    broken = TextArenaGame("TicTacToe-v0", seed=0, agents=["a", "b"])
    broken.env.step = None  # the game's step raises TypeError
    assert broken.play("\\boxed{4}") and broken.record.failed and "TypeError" in broken.record.error
    with pytest.raises(ValueError, match="not registered"):
        TextArenaGame("NoSuchGame-v0", 0, ["a", "b"])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(str(save_tiny(tmp_path_factory.mktemp("m"), hidden_size=64, num_layers=2, num_heads=2,
                                  intermediate_size=128, max_position_embeddings=4096)))


def test_a_game_is_a_multi_turn_episode_with_the_other_seat_played_by_a_model(engine):
    """The textarena env through the real multi-turn rollout: the policy's turns are actions, the
    game's text (with the opponent's moves) is observation; the episode's reward is the game's."""
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    rows = [{"seed": 4, "seat": 0}, {"seed": 5, "seat": 1}]
    batch = run_episodes(engine, lambda: TextArenaEnv("TicTacToe-v0", opponent="policy", opponent_max_new_tokens=6),
                         ["Play well.", "Play well."], rows, sp, max_turns=6, max_episode_tokens=4000,
                         seats=Seats(engine))
    assert len(batch) == 4
    tok = engine.tokenizer
    for i in range(4):
        n = int(batch.response_attn[i].sum())
        obs = batch.observation_mask[i, :n].bool()
        meta = batch.metadata[i]
        # an untrained model's moves are invalid: after the game's one retry, an invalid move loses
        assert not bool(batch.truncated[i]) and meta["env_return"] in (-1.0, 1.0) and 1 <= meta["turns"] <= 2
        if meta["turns"] == 2:  # the policy had a second turn: the game's answer to its first came as observation
            assert "invalid move" in tok.decode(batch.response_ids[i, :n][obs])
    first_moves = [batch.metadata[i]["env_return"] for i in range(2)]
    assert first_moves == [-1.0, -1.0]  # seat 0 moves first and loses on its second invalid move


def test_the_game_env_is_a_builtin_by_name():
    from rl.registry import lookup
    assert lookup("env", "textarena") is TextArenaEnv
