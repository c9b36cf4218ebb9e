"""MEMO's algorithm core against the numbers of rl/methods/memo/README.md (budget, TrueSkill, replay priorities,
strategic states, CRUD, replay isolation)."""

import math
import random

import pytest
import trueskill

from rl.methods.memo.core import (
    CrudOps,
    PrefixReplayBuffer,
    ReplayEntry,
    apply_crud,
    merge_insights,
    parse_crud,
    population_plan,
    rate_games,
    records,
    strategic_score,
    tournament_games,
    tournament_schedule,
    trueskill_env,
)


def test_budget_of_the_released_settings_is_2000_tournament_games():
    candidates = [f"c{i}" for i in range(8)]
    per_generation = tournament_schedule(candidates, rounds=25)
    assert len(per_generation) == 400
    assert tournament_games(8, 25, 5) == 2000
    # both seat orders, equally often, for every candidate
    for c in candidates:
        assert sum(g == (c, "baseline") for g in per_generation) == 25
        assert sum(g == ("baseline", c) for g in per_generation) == 25


def test_one_win_between_fresh_players_matches_the_spec_and_the_library():
    env = trueskill_env()
    assert env.mu == 25 and env.sigma == pytest.approx(25 / 3) and env.tau == pytest.approx(25 / 300)
    assert env.draw_probability == 0.10 and env.beta == 4.0
    out = rate_games({}, [{"agents": ["a", "b"], "rewards": [1, -1]}], env)
    assert out["a"].mu == pytest.approx(29.4244, abs=1e-4)
    assert out["b"].mu == pytest.approx(20.5756, abs=1e-4)
    assert out["a"].sigma == pytest.approx(7.1522, abs=1e-4) and out["b"].sigma == pytest.approx(7.1522, abs=1e-4)
    lib_a, lib_b = trueskill.rate_1vs1(trueskill.Rating(), trueskill.Rating(), env=trueskill.TrueSkill(beta=4))
    assert (out["a"].mu, out["a"].sigma, out["b"].mu) == pytest.approx((lib_a.mu, lib_a.sigma, lib_b.mu))
    # the draw margin ε for p_draw 0.1, β 4, two players: Φ⁻¹((p+1)/2) · √2 · β
    from statistics import NormalDist
    assert NormalDist().inv_cdf(1.1 / 2) * math.sqrt(2) * 4.0 == pytest.approx(0.71085, abs=1e-5)


def test_a_draw_ties_ranks_and_seat_order_does_not_matter():
    env = trueskill_env()
    drawn = rate_games({}, [{"agents": ["a", "b"], "rewards": [0, 0]}], env)
    assert drawn["a"].mu == pytest.approx(25.0) and drawn["b"].mu == pytest.approx(25.0)
    swapped = rate_games({}, [{"agents": ["b", "a"], "rewards": [-1, 1]}], env)
    won = rate_games({}, [{"agents": ["a", "b"], "rewards": [1, -1]}], env)
    assert swapped["a"].mu == pytest.approx(won["a"].mu)


def _entry(actions, state="s", player=0, winners=(0,)):
    return ReplayEntry(played=list(actions), state=state, player=player, winners=list(winners), seed=7)


def test_replay_priorities_are_inverse_prefix_frequencies():
    buf = PrefixReplayBuffer(capacity=1000, alpha=0.6)
    a, b, c = [(0, "[1]")], [(0, "[2]")], [(0, "[3]")]
    for prefix in (a, b, c, c):
        buf.push(_entry(prefix))
    assert [e.priority for e in buf.entries] == [1.0, 1.0, 0.5, 0.5]
    assert [e.priority ** 0.6 for e in buf.entries] == pytest.approx([1, 1, 0.65975, 0.65975], abs=1e-5)
    p = buf.probabilities()
    assert p[:2] == pytest.approx([0.30125, 0.30125], abs=1e-5)
    assert p[2:] == pytest.approx([0.19875, 0.19875], abs=1e-5) and sum(p[2:]) == pytest.approx(0.3975, abs=1e-4)
    buf.push(_entry(a))  # A seen twice now: all of its entries drop to 1/2
    assert [e.priority for e in buf.entries] == [0.5, 1.0, 0.5, 0.5, 0.5]
    rng = random.Random(0)
    draws = [buf.sample(rng).hash for _ in range(4000)]
    b_hash = buf.entries[1].hash
    expected_b = 1.0 / (1.0 + 4 * 0.5 ** 0.6)
    assert draws.count(b_hash) / 4000 == pytest.approx(expected_b, abs=0.03)


def test_replay_capacity_is_fifo_and_counts_survive_eviction():
    buf = PrefixReplayBuffer(capacity=2)
    for prefix in ([(0, "x")], [(0, "y")], [(0, "x")]):
        buf.push(_entry(prefix))
    assert len(buf) == 2 and [e.played for e in buf.entries] == [[(0, "y")], [(0, "x")]]
    assert buf.entries[1].priority == 0.5  # the evicted first push still counts


def test_strategic_state_scores_and_filters():
    assert strategic_score(3, 1, 4) == pytest.approx(0.8047, abs=1e-4)
    assert strategic_score(5, 0, 5) == pytest.approx(1.7918, abs=1e-4)
    buf = PrefixReplayBuffer()
    # state S1: 3 wins, 1 loss for the player to move; S2: 5 wins; S3: no win; S4: one visit
    for i, winners in enumerate([(0,), (0,), (0,), (1,)]):
        buf.push(_entry([(0, f"s1-{i}")], state="S1", winners=winners))
    for i in range(5):
        buf.push(_entry([(0, f"s2-{i}")], state="S2"))
    for i in range(3):
        buf.push(_entry([(0, f"s3-{i}")], state="S3", winners=(1,)))
    buf.push(_entry([(0, "s4")], state="S4"))
    top = buf.strategic_states(topk=10)
    assert [k for k, _ in top] == ["S2", "S1"]
    assert top[0][1]["score"] == pytest.approx(1.7918, abs=1e-4) and top[1][1]["score"] == pytest.approx(0.8047,
                                                                                                       abs=1e-4)
    assert buf.strategic_states(topk=1) == top[:1]


def test_push_game_stores_every_non_terminal_step_with_its_prefix():
    buf = PrefixReplayBuffer()
    steps = [{"player": 0, "action": "[4]", "state": "a"}, {"player": 1, "action": "[0]", "state": "b"},
             {"player": 0, "action": "[8]", "state": "c"}]
    assert buf.push_game(steps, winners=[0], seed=3) == 2
    assert [e.played for e in buf.entries] == [[(0, "[4]")], [(0, "[4]"), (1, "[0]")]]
    assert [e.state for e in buf.entries] == ["a", "b"] and all(e.seed == 3 for e in buf.entries)


def test_crud_applies_remove_then_edit_then_add():
    ops = parse_crud('<remove number="1">stale</remove> <edit number="2">e2</edit> <add>n1 is new</add>')
    assert ops.removes == [1] and ops.edits == [(2, "e2")] and ops.adds == ["n1 is new"]
    bank, counts = apply_crud(["i1", "i2", "i3"], ops)
    assert bank == ["e2", "i3", "n1 is new"]
    assert counts == {"removed": 1, "edited": 1, "added": 1, "duplicates": 0, "ignored": 0}


def test_crud_drops_duplicate_adds_and_keeps_the_newest_15():
    bank = ["control the center square early"]
    dup = "always control the center square"  # 4 of its 5 words are shared: 4 > 0.6 * 5
    fresh = "bluff with the jack sometimes"
    out, counts = apply_crud(bank, CrudOps(adds=[dup, fresh]))
    assert out == bank + [fresh] and counts["duplicates"] == 1
    many = [f"insight number {i} about {chr(97 + i)}" for i in range(14)]
    out, _ = apply_crud(many, CrudOps(adds=["alpha beta", "gamma delta"]))
    assert len(out) == 15 and out[-2:] == ["alpha beta", "gamma delta"] and out[0] == many[1]


def test_malformed_analyzer_output_changes_nothing_and_is_counted():
    bank = ["i1", "i2"]
    assert not parse_crud("Here are my thoughts: keep going.")  # no tags
    out, counts = apply_crud(bank, parse_crud('<edit number="9">x</edit><remove number="0">y</remove>'))
    assert out == bank and counts["ignored"] == 2
    out, counts = apply_crud(bank, parse_crud('<remove number="1">a</remove><remove number="2">b</remove>'))
    assert out == bank  # an answer that would empty the bank keeps it


def test_merge_styles():
    assert merge_insights(["old one"], ["new one here", "another"], "no_merge") == ["new one here", "another"]
    assert merge_insights(["old insight"], ["totally different"], "basic") == ["old insight", "totally different"]
    with pytest.raises(ValueError, match="memory_merge 'fancy'"):
        merge_insights([], [], "fancy")


def test_replayed_games_change_neither_records_nor_ratings():
    fresh = {"agents": ["c0", "baseline"], "rewards": [1, -1]}
    replayed = {"agents": ["c0", "baseline"], "rewards": [-1, 1], "replayed": True, "invalid_moves": [1, 0],
                "moves": [3, 3]}
    env = trueskill_env()
    assert rate_games({}, [fresh, replayed], env)["c0"].mu == rate_games({}, [fresh], env)["c0"].mu
    rec = records([fresh, replayed])
    assert (rec["c0"].wins, rec["c0"].losses, rec["c0"].draws) == (1, 0, 0)
    assert rec["c0"].invalid_moves == 1 and rec["c0"].moves == 3  # its moves still count for the invalid rate
    failed = {"agents": ["c0", "baseline"], "rewards": [0, 0], "failed": True}
    assert records([failed])["c0"].failed == 1 and records([failed])["c0"].games == 0
    assert rate_games({}, [failed], env) == {}


def test_population_plan_of_the_released_scripts():
    # SimpleTak: keep 0.25, memory-guided 0.55, random 0.1, crossover 0.1 of 8
    assert population_plan(8, {"keep": 0.25, "memory_guided": 0.55, "random": 0.1, "crossover": 0.1}) == {
        "keep": 2, "random": 0, "memory_guided": 6, "trajectory": 0, "crossover": 0}
    assert population_plan(8, {"keep": 0.25, "memory_guided": 0.75}) == {
        "keep": 2, "random": 0, "memory_guided": 6, "trajectory": 0, "crossover": 0}
    with pytest.raises(ValueError, match="unknown"):
        population_plan(8, {"keep": 0.25, "mutate": 0.5})


def test_the_duplicate_check_counts_the_shorter_insights_words_not_its_distinct_words():
    from rl.methods.memo.core import word_overlap_duplicate
    # shared distinct words {win, fast}: 2. The first has 6 words (2 distinct), the second 4: 2 > 0.6 * 4 is false
    assert not word_overlap_duplicate("win win win win win fast", "win fast now please")
    # 3 shared of the shorter's 4 words: 3 > 2.4
    assert word_overlap_duplicate("take the center early", "always take the center square")


class _EmptyAnalyzer:
    """An analyzer that answers every request with `answers` in turn (empty strings: nothing usable)."""

    def __init__(self, answers):
        self.answers = answers

    def generate(self, prompts, seed=0):
        return [self.answers[i % len(self.answers)] for i in range(len(prompts))]


def test_an_empty_analyzer_answer_stands_in_with_the_base_prompt_and_is_counted_as_malformed():
    from rl.methods.memo.stage import MemoStage
    stage = MemoStage(population=4, seed=0)
    population, malformed = stage._initial_population(_EmptyAnalyzer(["", "play the corners first", "  "]),
                                                      random.Random(0))
    assert [c.prompt for c in population[1:]] == [stage.base_prompt, "play the corners first", stage.base_prompt]
    assert malformed == 2
    state = {"memory": [], "analyzer_malformed": malformed}
    fitness = {c.id: float(i) for i, c in enumerate(population)}
    stage._next_population(_EmptyAnalyzer([""]), population, fitness, [], state, random.Random(1), 0)
    elites = int(stage.population * stage.shares["keep"])
    assert state["analyzer_malformed"] == 2 + stage.population - elites


def test_a_strategic_state_records_the_move_that_won_most_from_it():
    from rl.methods.memo.core import decisive_move
    buf = PrefixReplayBuffer()
    # from state S, player 0 played [4] three times (won twice) and [0] twice (won twice)
    for action, winners in [("[4]", (0,)), ("[0]", (0,)), ("[4]", (1,)), ("[0]", (0,)), ("[4]", (0,))]:
        buf.push(_entry([(1, "[8]"), (0, action)], state="S", winners=winners))
    (key, stats), = buf.strategic_states()
    assert stats["moves"] == {"[4]": [2, 3], "[0]": [2, 2]}
    assert decisive_move(stats) == ("[0]", 2, 2)  # equal wins: the higher share
    buf.push(_entry([(1, "[8]"), (0, "[4]")], state="S", winners=(0,)))
    assert decisive_move(buf.strategic_states()[0][1]) == ("[4]", 3, 4)  # most wins first


def test_the_analyzer_reads_each_decisive_position_with_its_winning_move():
    from rl.methods.memo.stage import decisive_text
    stats = {"player": 1, "wins": 3, "losses": 1, "count": 4, "moves": {"[2]": [1, 2], "[5]": [2, 2]}}
    assert decisive_text([("{board}", stats)], compact=True) == "- P1 played [5]: won 2 of 2"
    assert decisive_text([("{board}", stats)]) == "- state {board}: 3 wins, 1 losses in 4 visits; P1 played [5]: won 2 of 2"


def test_extra_replay_keeps_every_scheduled_game_fresh_and_adds_the_replayed_ones():
    from rl.methods.memo.stage import MemoStage
    buf = PrefixReplayBuffer()
    buf.push(_entry([(0, "[4]")]))
    within = MemoStage(rounds=10, replay_prob=0.4).tournament_specs(["c0", "c1"], buf, random.Random(5))
    extra = MemoStage(rounds=10, replay_prob=0.4, replay_mode="extra").tournament_specs(["c0", "c1"], buf,
                                                                                        random.Random(5))
    off = MemoStage(rounds=10, replay=False, replay_mode="extra").tournament_specs(["c0", "c1"], buf,
                                                                                  random.Random(5))
    replayed_within = sum(s["replay"] is not None for s in within)
    assert len(within) == len(off) == 40 and 0 < replayed_within < 40
    fresh = [s for s in extra if s["replay"] is None]
    assert len(fresh) == 40 and len(extra) == 40 + sum(s["replay"] is not None for s in extra)
    assert [s["agents"] for s in fresh] == [s["agents"] for s in off]  # the same schedule is rated in both arms
    assert all(s["replay"] == [(0, "[4]")] for s in extra if s["replay"] is not None)
    with pytest.raises(ValueError, match="replay_mode 'sometimes'"):
        MemoStage(replay_mode="sometimes")


def test_records_accumulate_every_outcome_over_a_tournament_hand_counted():
    """Eight games of A and B, hand-counted: wins, losses and draws over the played games, failed games apart,
    replayed games counting their moves (for the invalid-move rate) but no outcome; and a three-seat game where a
    shared best reward is a draw, not a win."""
    games = [{"agents": ["A", "B"], "rewards": [1, -1], "invalid_moves": [1, 0], "moves": [3, 3]},
             {"agents": ["B", "A"], "rewards": [0, 0], "invalid_moves": [0, 2], "moves": [2, 2]},
             {"agents": ["A", "B"], "rewards": [1, -1], "replayed": True, "invalid_moves": [1, 1], "moves": [4, 4]},
             {"agents": ["A", "B"], "rewards": [-1, 1], "invalid_moves": [0, 1], "moves": [5, 5]},
             {"agents": ["A", "B"], "rewards": [0, 0], "failed": True, "moves": [1, 1]},
             {"agents": ["B", "A"], "rewards": [1, -1], "moves": [2, 2]},
             {"agents": ["A", "B"], "rewards": [0, 0], "moves": [1, 1]},
             {"agents": ["B", "A"], "rewards": [1, -1], "failed": True}]
    rec = records(games)
    a, b = rec["A"], rec["B"]
    assert (a.wins, a.losses, a.draws, a.failed, a.invalid_moves, a.moves) == (1, 2, 2, 2, 4, 18)
    assert (b.wins, b.losses, b.draws, b.failed, b.invalid_moves, b.moves) == (2, 1, 2, 2, 2, 18)
    assert a.games == 5 and a.rate("wins") == pytest.approx(0.2) and a.rate("losses") == pytest.approx(0.4)
    assert b.rate("draws") == pytest.approx(0.4) and records([])  == {}
    from rl.methods.memo.core import Record
    assert Record().rate("wins") == 0.0 and Record(failed=3).rate("losses") == 0.0  # no played game: rate 0
    three = records([{"agents": ["x", "y", "z"], "rewards": [1, 1, -1]}])
    assert (three["x"].draws, three["y"].draws, three["z"].losses) == (1, 1, 1) and three["x"].wins == 0


def test_ratings_follow_each_game_in_order_with_the_given_environment():
    env = trueskill.TrueSkill(beta=8.0)  # not the module's default beta: the caller's environment is the one used
    win = {"agents": ["c0", "baseline"], "rewards": [1, -1]}
    once = rate_games({}, [win], env)
    r0, r1 = env.rate([(env.create_rating(),), (env.create_rating(),)], ranks=[0, 1])
    assert once["c0"].mu == pytest.approx(r0[0].mu) and once["baseline"].sigma == pytest.approx(r1[0].sigma)
    replayed_first = rate_games({}, [{**win, "replayed": True}, win, win], env)
    twice = env.rate([(r0[0],), (r1[0],)], ranks=[0, 1])  # the second game starts from the first's ratings
    assert replayed_first["c0"].mu == pytest.approx(twice[0][0].mu)
    assert rate_games({}, [win])["c0"].mu == pytest.approx(trueskill_env().rate(
        [(trueskill_env().create_rating(),), (trueskill_env().create_rating(),)], ranks=[0, 1])[0][0].mu)
    with pytest.raises(ValueError, match="game 7: 2 agents but 3 rewards"):
        rate_games({}, [{"game_id": 7, "agents": ["a", "b"], "rewards": [1, 0, -1]}])


def test_strategic_states_count_draws_and_losses_and_keep_the_threshold_states_hand_computed():
    buf = PrefixReplayBuffer()
    # "z_state" (player 0): a win, two losses, two draws: count 5, score |1/5 - 2/5| ln 6 = 0.35835
    for i, winners in enumerate([(0,), (1,), (1,), (), ()]):
        buf.push(_entry([(0, f"z{i}")], state="z_state", winners=winners))
    # "a_state" (player 1): two wins, exactly the least count and wins kept: score ln 3 = 1.09861
    for i in range(2):
        buf.push(ReplayEntry(played=[(1, f"a{i}")], state="a_state", player=1, winners=[1], seed=0))
    # two states with equal stats keep their first-seen order; a count of 1 and a state with no win are left out
    for name in ("tie_0", "tie_1"):  # sorted by score alone: a sort that also compared names would swap them
        for i, winners in enumerate([(0,), (1,)]):
            buf.push(_entry([(0, f"{name}{i}")], state=name, winners=winners))
    buf.push(_entry([(0, "once")], state="once"))
    for i in range(2):
        buf.push(_entry([(0, f"l{i}")], state="no_win", winners=(1,)))
    top = buf.strategic_states()
    assert [k for k, _ in top] == ["a_state", "z_state", "tie_0", "tie_1"]
    z = dict(top)["z_state"]
    assert (z["wins"], z["losses"], z["draws"], z["count"], z["player"]) == (1, 2, 2, 5, 0)
    assert z["score"] == pytest.approx(0.2 * math.log(6)) and dict(top)["a_state"]["player"] == 1
    assert dict(top)["a_state"]["score"] == pytest.approx(math.log(3))
    many = PrefixReplayBuffer()
    for s in range(11):  # eleven qualifying states: the default keeps the ten best
        for i in range(2):
            many.push(_entry([(0, f"{s}-{i}")], state=f"s{s}"))
    assert len(many.strategic_states()) == 10


def test_replay_sampling_draws_by_priority_and_counts_what_it_drew():
    buf = PrefixReplayBuffer()
    assert buf.entries.maxlen == 1000 and buf.alpha == 0.6  # the released defaults
    assert buf.sample(random.Random(0)) is None and buf.stats() == {"size": 0.0, "distinct_prefixes": 0.0,
                                                                    "replays_sampled": 0.0}
    for prefix in ([(0, "x")], [(0, "x")], [(0, "y")]):
        buf.push(_entry(prefix))
    weights = [0.5 ** 0.6, 0.5 ** 0.6, 1.0]
    expected = random.Random(5)
    want = [expected.choices([0, 1, 2], weights=weights, k=1)[0] for _ in range(6)]
    rng = random.Random(5)
    got = [list(buf.entries).index(buf.sample(rng)) for _ in range(6)]
    assert got == want
    y_hash = buf.entries[2].hash
    assert buf.sampled.get(y_hash, 0) == sum(1 for i in want if i == 2)
    assert buf.stats() == {"size": 3.0, "distinct_prefixes": 2.0, "replays_sampled": 6.0}


def test_a_game_of_one_step_pushes_nothing_and_entries_keep_player_and_winners():
    buf = PrefixReplayBuffer()
    assert buf.push_game([{"player": 0, "action": "[4]", "state": "a"}], winners=[0], seed=1) == 0 and not len(buf)
    steps = [{"player": 1, "action": "[4]", "state": "a"}, {"player": 0, "action": "[0]", "state": "b"},
             {"player": 1, "action": "[8]", "state": "c"}]
    buf.push_game(steps, winners=[1], seed=2)
    assert [e.player for e in buf.entries] == [1, 0] and all(e.winners == [1] for e in buf.entries)


def test_crud_numbers_at_the_edges_and_counts_that_add_up():
    bank = ["i1", "i2", "i3"]
    # the last number is a valid removal; two numbers out of range are two ignored
    out, counts = apply_crud(bank, CrudOps(removes=[3, 4, 0]))
    assert out == ["i1", "i2"] and counts["removed"] == 1 and counts["ignored"] == 2
    # number 1 is a valid edit; an edit past the end is ignored and the next edit still applies
    out, counts = apply_crud(bank, CrudOps(edits=[(1, "e1"), (4, "nope"), (3, "e3")]))
    assert out == ["e1", "i2", "e3"] and counts["edited"] == 2 and counts["ignored"] == 1
    # every add and every duplicate is counted; the caller's overlap threshold decides what is a duplicate
    out, counts = apply_crud(["red blue green"], CrudOps(adds=["red blue green x", "red blue green y", "a b"]))
    assert counts["duplicates"] == 2 and counts["added"] == 1
    out, counts = apply_crud(["red blue green"], CrudOps(adds=["red blue green x", "cyan magenta"]),
                             dup_overlap=1.0)
    assert counts["added"] == 2 and counts["duplicates"] == 0
    assert apply_crud(bank, CrudOps(adds=["new one"]), max_insights=1)[0] == ["new one"]
    assert apply_crud(bank, CrudOps(adds=["new one"]), max_insights=-1)[0] == bank + ["new one"]  # <= 0: no cap


def test_merge_passes_its_threshold_and_cap_and_crud_ops_are_truthy_when_any_op_is_there():
    # 3 shared words of the shorter 4: a duplicate at the default 0.6 (3 > 2.4), not at 0.8 (3 > 3.2 is false)
    bank, new = ["one two three four"], ["one two three five"]
    assert merge_insights(bank, new, "basic") == bank
    assert merge_insights(bank, new, "basic", dup_overlap=0.8) == bank + new
    assert len(merge_insights([], [f"insight {c}" for c in "abcdefghijklmnopq"], "basic")) == 15
    assert not CrudOps() and CrudOps(removes=[1]) and CrudOps(edits=[(1, "x")]) and CrudOps(adds=["x"])
    from rl.methods.memo.core import word_overlap_duplicate
    assert not word_overlap_duplicate("x y", "x z", 0.5)  # 1 shared word is not more than 0.5 x 2


def test_population_plan_tops_up_with_random_without_a_memory_share_and_names_an_oversized_plan():
    assert population_plan(5, {"keep": 0.5}) == {"keep": 2, "random": 3, "memory_guided": 0, "trajectory": 0,
                                                 "crossover": 0}
    assert population_plan(5, {"keep": 0.5, "memory_guided": 0.0})["random"] == 3
    with pytest.raises(ValueError, match=r"ask for 5 candidates, more than 4"):
        population_plan(4, {"keep": 0.75, "random": 0.5})
