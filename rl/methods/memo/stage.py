"""The `memo` stage: MEMO self-play context optimisation on a TextArena game (rl/methods/memo/README.md).

The stage changes no weights. Generation 0 is the base prompt, the recipe's `initial_prompts` and style
variations of the base prompt written by the analyzer. Per generation (`rl.methods.memo.core` holds the rules it
decides with):
1. the population of prompt candidates plays the `vs_baseline` tournament: every candidate against the
   baseline agent (the same model with the plain template) `rounds` times in both seat orders; games run
   in lockstep, up to `max_concurrent_games` at once, each tick's moves generated in one batch spread over
   the rollout workers; with probability `replay_prob` a game starts from a prefix drawn from the replay
   buffer (same env seed), and such a game counts for neither W/L/D nor the ratings;
2. batch TrueSkill over the non-replayed games; fitness = win rate (`fitness: winrate`, the released
   scripts) or μ (`trueskill`);
3. every non-terminal step of every game enters the prioritized prefix replay buffer;
4. (not after the last generation) the analyzer turns up to `reflection_games` games per candidate, with the
   buffer's strategic states, into `insights_per_generation` insights, merged into the memory bank
   (`memory_merge`: no_merge | basic | crud);
5. the best candidate plays the evaluation opponents (`eval_opponents`: `baseline` and/or names of
   `reward.judges`, frozen engine actors) for `eval_rounds` × 2 seats;
6. (not after the last generation) the next population: elites, random, memory-guided (up to
   `memory_sample` insights → a 1–3 sentence prompt), trajectory-reflection and crossover candidates,
   written by the analyzer.

The analyzer is a model: `analyzer: null` asks the player model itself (through the rollout workers), or it
names a `reward.judges` entry (its own frozen engine actors, possibly another model). An analyzer answer
with nothing usable (no tags, no lines, bad numbers) changes nothing and is counted.

What the stage writes (`output_dir/stages/NAME/`): `metrics.jsonl` (one row per generation: win/loss/draw,
μ and σ, the fitness of every candidate, invalid-move rate, replay and memory statistics, the memory bank
and its diff, evaluation results), `games/gen{g}.jsonl` (every game), `state.pkl` (the state after each
complete generation: a re-run resumes after the last one), and the artifacts `memo_prompt` (the best
candidate's prompt followed by the memory, a text file an RL recipe can use as its system prompt) and
`memo_context` (JSON: prompt, memory, fitness, history).

Deviations from the released code, kept as recipe knobs: the strategic states go into the analyzer's
insight prompt (the released code turns them into separate state abstracts); for small-context models,
`observation_chars` cuts the game's observation to its last characters (0 keeps all of it) and
`requests: compact` asks the analyzer in short forms of the released requests (game lines without the end
message, decisive positions without the state snapshot); `replay_mode: extra` plays every scheduled game fresh
and adds each replayed game after it, so that an arm without replay rates as many games as one with it (the
released code, `within`, turns a scheduled game into the replayed one). Each decisive position is shown with
the move that won most from it (the released code writes a free-text abstract per state).
"""

from __future__ import annotations

import json
import pickle
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rl.methods.memo.core import (
    BASE_PROMPT,
    PrefixReplayBuffer,
    apply_crud,
    decisive_move,
    merge_insights,
    parse_crud,
    population_plan,
    rate_games,
    records,
    tournament_schedule,
    trueskill_env,
)
from rl.registry import register
from rl.stages import (
    Stage,
    StageContext,
    StageError,
    StageRuntime,
    config_fingerprint_part,
    files_identity,
    say,
)

BASELINE = "baseline"
# Styles of the generation-0 variations (the released code draws from a longer list of the same kind).
STYLES = ("aggressive", "defensive", "analytical", "strategic", "cautious", "opportunistic", "methodical",
          "pattern-focused", "probabilistic", "adaptive")
MOVE_SUFFIX = "Submit your move enclosed by \\boxed{}."


@dataclass
class Candidate:
    id: str
    prompt: str
    generation: int
    origin: str  # base | style | elite | random | memory_guided | trajectory | crossover
    parents: list[str] = field(default_factory=list)


def agent_prompt(prompt: str, memory: list[str], observation: str) -> str:
    """A candidate's turn: its prompt, the memory bank, the observation, the move format."""
    mem = "".join(f"{i}. {x}\n" for i, x in enumerate(memory, 1))
    mem = f"Insights from past games:\n{mem}\n" if memory else ""
    return f"{prompt}\n\n{mem}Observation: {observation}\n\n{MOVE_SUFFIX}"


def baseline_prompt(observation: str) -> str:
    """The baseline agent's turn: the released plain template around the base prompt."""
    return (f"You are playing a two-player zero-sum game. Make valid moves to win. You should first reason about "
            f"your next move, and then submit the move enclosed by \\boxed{{}}.\nObservation: {observation}\n")


def clean_prompt(text: str, max_chars: int = 600) -> str:
    """An analyzer's answer used as a prompt: stripped of quotes and cut to `max_chars`."""
    return text.strip().strip('"').strip()[:max_chars].strip()


def parse_insight_lines(text: str, k: int) -> list[str]:
    """Up to `k` insights, one per line (`1.`, `-`, `*` markers dropped; lines of fewer than 3 words skipped)."""
    import re
    out = []
    for line in text.splitlines():
        line = re.sub(r"^\s*(\d+[.)]|[-*•])\s*", "", line).strip()
        if len(line.split()) >= 3:
            out.append(line)
    return out[:k]


def summarize_game(game: dict[str, Any], agent: str, max_moves: int = 40, compact: bool = False) -> str:
    """One line per game for the analyzer: the agent's seat, the outcome and the moves (`*`: refused); the
    game's end message too unless `compact` (small-context analyzers)."""
    seat = game["agents"].index(agent)
    outcome = ("failed" if game["failed"] else "win" if seat in game["winners"] else
               "draw" if not game["winners"] else "loss")
    moves = ", ".join(f"P{s['player']}{'*' if s['invalid'] else ''}:{s['action']}" for s in game["steps"][:max_moves])
    end = f"; end: {game['reason'][:160]}" if game.get("reason") and not compact else ""
    return f"seat {seat}, {outcome}; moves {moves}{end}"


def decisive_text(states: list[tuple[str, dict[str, Any]]], compact: bool = False) -> str:
    """The replay buffer's strategic states for the analyzer, one line each with the move that won most from
    it (`core.decisive_move`); `compact` leaves out the state itself (a JSON snapshot of the game)."""
    lines = []
    for key, st in states:
        move, wins, plays = decisive_move(st)
        said = f"P{st['player']} played {move}: won {wins} of {plays}"
        lines.append(f"- {said}" if compact else
                     f"- state {key[:300]}: {st['wins']} wins, {st['losses']} losses in {st['count']} visits; {said}")
    return "\n".join(lines)


# The analyzer's requests. `compact` is a short form of each for small-context models (`requests: compact`);
# the default is the released code's wording.
def style_request(game: str, base_prompt: str, style: str, compact: bool = False) -> str:
    """The analyzer's generation-0 task: a style variation of the base prompt."""
    if compact:
        return f"Rewrite as a {style} {game} strategy in 1-3 sentences: {base_prompt}\nStrategy:"
    return (f"Transform this {game} prompt into a {style} style:\n\nOriginal: {base_prompt}\n\nCreate a {style} "
            f"version that:\n1. Keeps the core strategy\n2. Emphasizes {style} gameplay\n3. Stays concise (1-3 "
            f"sentences)\n\n{style.capitalize()} version:")


def random_request(game: str, compact: bool = False) -> str:
    if compact:
        return f"Invent a new {game} strategy in 1-3 sentences.\nStrategy:"
    return (f"Generate a creative and unique strategy prompt for {game}.\n\nRequirements:\n1. Be innovative and "
            f"different from standard approaches\n2. Focus on winning strategy\n3. Keep it concise (1-3 sentences)"
            f"\n\nCreative prompt:")


def memory_guided_request(game: str, insights: list[str], compact: bool = False) -> str:
    listed = "".join(f"{i}. {x}\n" for i, x in enumerate(insights, 1))
    if compact:
        return f"Insights for {game}:\n{listed}Write a strategy from these insights in 1-3 sentences.\nStrategy:"
    return (f"Generate a creative and strategic prompt for {game} using insights from shared memory.\n\nKEY "
            f"INSIGHTS FROM SHARED MEMORY:\n{listed}\nRequirements:\n1. Incorporate the key insights and successful "
            f"patterns from memory\n2. Be innovative but grounded in proven approaches\n3. Focus on winning "
            f"strategy\n4. Keep it concise (1-3 sentences)\n5. Ensure proper move formatting to avoid format errors"
            f"\n\nCreative memory-guided prompt:")


def trajectory_request(game: str, prompt: str, games_text: str, compact: bool = False) -> str:
    if compact:
        return f"{game} prompt: {prompt}\nGames:\n{games_text}\nImprove the prompt in 1-3 sentences.\nStrategy:"
    return (f"This {game} prompt played these games:\nPrompt: {prompt}\nGames:\n{games_text}\n\nRewrite the "
            f"prompt to fix its mistakes. Keep it concise (1-3 sentences).\n\nImproved prompt:")


def crossover_request(game: str, first: str, second: str, compact: bool = False) -> str:
    if compact:
        return f"Combine two {game} strategies in 1-3 sentences.\n1. {first}\n2. {second}\nStrategy:"
    return (f"Combine these two {game} strategy prompts into one:\n\nPrompt 1: {first}\n\nPrompt 2: {second}\n\n"
            f"Create a combined version that:\n1. Takes the best of both\n2. Is coherent\n3. Stays concise (1-3 "
            f"sentences)\n\nCombined prompt:")


def insight_request(game: str, ranked: list[tuple[str, int, int]], games_text: str, states_text: str, k: int,
                    bank: list[str] | None = None, compact: bool = False) -> str:
    """The analyzer's memory task: the agents ranked by this generation's fitness (prompt, wins, games; best
    first), their games and the decisive positions when given; with `bank` (crud) the numbered insights
    to update by tags, else `k` insights one per line."""
    agents = "".join(f"{i}. {p} (won {w} of {n})\n" for i, (p, w, n) in enumerate(ranked, 1))
    text = (f"{game} agents, best first:\n{agents}" if compact else
            f"You analyse games of {game} to improve a player's strategy.\n\nAgents, best first:\n{agents}")
    if games_text:
        text += f"\nGames (moves marked * were invalid):\n{games_text}\n"
    if states_text:
        text += f"\nDecisive positions:\n{states_text}\n"
    if bank is not None:
        numbered = "".join(f"{i}. {x}\n" for i, x in enumerate(bank, 1)) or "(empty)\n"
        return (f"{text}\nCurrent insights:\n{numbered}\nUpdate the insights with {k} operations: <add>new "
                f"insight</add>, <edit number=\"N\">new text</edit>, <remove number=\"N\">reason</remove>.")
    if compact:
        return f"{text}Write {k} insights, one per line.\nInsights:"
    return (f"{text}\nWrite exactly {k} insights, one per line: a strategic insight, an error or format insight, "
            f"and an improvement insight.")


def invalid_move_rates(recs: dict[str, Any]) -> dict[str, float]:
    """The share of the candidates' moves, and of the baseline's, that the game refused."""
    moves = sum(r.moves for a, r in recs.items() if a != BASELINE)
    base = recs.get(BASELINE)
    return {"invalid_move_rate": (sum(r.invalid_moves for a, r in recs.items() if a != BASELINE) / moves
                                  if moves else 0.0),
            "baseline_invalid_move_rate": base.invalid_moves / base.moves if base is not None and base.moves else 0.0}


class ModelClient:
    """`generate(texts, seed)` of one model: the rollout workers (the player) or a judge group (frozen engine
    actors). Rollout calls that fail because a worker restarted are sent again: the games' states live in
    the driver, so a move batch lost with a worker is generated again and no game is played twice."""

    def __init__(self, workers: list[Any] | None, judge: Any, tokenizer: Any, chat_template: bool,
                 temperature: float, max_new_tokens: int, retries: int = 3, runtime: Any = None):
        self.workers, self.judge, self.tok, self.chat = workers, judge, tokenizer, chat_template
        self.rt = runtime  # calls on the rollout workers and waits for them (`StageRuntime.call`, `wait`)
        self.temperature, self.max_new_tokens, self.retries = temperature, max_new_tokens, retries
        self.restarts = 0

    def generate(self, texts: list[str], seed: int, max_new_tokens: int | None = None,
                 temperature: float | None = None) -> list[str]:
        if not texts:
            return []
        sampling = {"temperature": self.temperature if temperature is None else temperature,
                    "max_new_tokens": max_new_tokens or self.max_new_tokens}
        if self.judge is not None:
            return self.judge.generate(texts, **sampling)
        from rl.data import format_prompt
        prompts = [format_prompt(t, self.tok, "", self.chat) for t in texts]
        k = min(len(self.workers), len(prompts))
        bounds = [round(i * len(prompts) / k) for i in range(k + 1)]

        def submit(w: int) -> Any:
            return self.rt.call(self.workers[w], "generate", prompts[bounds[w]:bounds[w + 1]],
                                {**sampling, "n": 1, "seed": seed * 131 + w}, list(range(bounds[w], bounds[w + 1])))

        refs = [submit(w) for w in range(k)]  # all workers generate at once
        out: list[list[str]] = [[] for _ in range(k)]
        for w in range(k):
            for attempt in range(self.retries + 1):
                try:
                    out[w] = self.rt.wait(refs[w]).responses
                    break
                except Exception as exc:  # a dead or restarted worker: it serves the stage's model again
                    if attempt == self.retries:
                        raise StageError(f"stage memo: rollout worker {w} failed {attempt + 1} times: {exc}") from exc
                    self.restarts += 1
                    say(f"memo: rollout worker {w} failed ({type(exc).__name__}); generating its moves again")
                    self._revive(w)
                    refs[w] = submit(w)
        return [r for part in out for r in part]

    def _revive(self, w: int, wait_s: float = 300.0) -> None:
        """A restarted worker was rebuilt from the stage's model (the weights MEMO uses): let it generate. Waits
        up to `wait_s` for Ray to bring it back; the retry that follows fails with the worker's error if not."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                self.rt.wait(self.rt.call(self.workers[w], "accept_initial_weights"),
                             timeout=max(1.0, deadline - time.monotonic()))
                return
            except Exception:
                time.sleep(1.0)


@register("stage", "memo")
class MemoStage(Stage):
    """MEMO on one TextArena game with the run's policy as player and baseline (see the module docstring).
    Every parameter is a recipe knob (`stages: [{name: memo, params: {...}}]`); defaults are the released
    per-game settings where they exist."""
    reads, publishes = ("base_model", "policy"), ("memo_prompt", "memo_context")  # checked against the recipe's order

    config_keys = ("seed", "model", "rollout", "data.chat_template", "reward.judges")
    runs_in_driver = True

    def __init__(self, game: str = "TicTacToe-v0", generations: int = 5, population: int = 8, rounds: int = 25,
                 fitness: str = "winrate", replay: bool = True, replay_prob: float = 0.4,
                 replay_capacity: int = 1000, replay_alpha: float = 0.6, memory: bool = True,
                 memory_merge: str = "no_merge", max_insights: int = 15, insights_per_generation: int = 3,
                 dup_overlap: float = 0.6, reflection_games: int = 20, strategic_topk: int = 10,
                 memory_sample: int = 8, shares: dict[str, float] | None = None, eval_rounds: int = 25,
                 eval_opponents: list[str] | None = None, max_concurrent_games: int = 100, max_moves: int = 60,
                 temperature: float = 1.0, max_new_tokens: int = 256, analyzer: str | None = None,
                 analyzer_temperature: float = 1.0, analyzer_max_new_tokens: int = 512,
                 base_prompt: str = BASE_PROMPT, initial_prompts: list[str] | None = None,
                 observation_chars: int = 0, requests: str = "released", replay_mode: str = "within",
                 seed: int = 0):
        from rl.methods.memo.textarena import GAMES
        if fitness not in ("winrate", "trueskill"):
            raise ValueError(f"memo fitness {fitness!r}: expected winrate | trueskill")
        if requests not in ("released", "compact"):
            raise ValueError(f"memo requests {requests!r}: expected released | compact")
        if replay_mode not in ("within", "extra"):
            raise ValueError(f"memo replay_mode {replay_mode!r}: expected within | extra")
        self.replay_mode = replay_mode
        self.compact = requests == "compact"
        if memory_merge not in ("no_merge", "basic", "crud"):
            raise ValueError(f"memo memory_merge {memory_merge!r}: expected no_merge | basic | crud")
        if game not in GAMES:
            say(f"memo: game {game!r} is not one of MEMO's five ({', '.join(GAMES)}); playing it anyway")
        if not 0.0 <= replay_prob <= 1.0:
            raise ValueError(f"memo replay_prob {replay_prob}: expected a probability")
        for name, value in (("generations", generations), ("population", population), ("rounds", rounds)):
            if value < 1:
                raise ValueError(f"memo {name} {value}: expected at least 1")
        self.shares = dict(shares or {"keep": 0.25, "memory_guided": 0.75})
        population_plan(population, self.shares)  # unknown or over-full shares fail now
        self.game, self.generations, self.population, self.rounds = game, generations, population, rounds
        self.fitness, self.replay, self.replay_prob = fitness, replay, replay_prob
        self.replay_capacity, self.replay_alpha = replay_capacity, replay_alpha
        self.memory, self.memory_merge, self.max_insights = memory, memory_merge, max_insights
        self.insights_per_generation, self.dup_overlap = insights_per_generation, dup_overlap
        self.reflection_games, self.strategic_topk, self.memory_sample = reflection_games, strategic_topk, memory_sample
        self.eval_rounds, self.eval_opponents = eval_rounds, list(eval_opponents or [BASELINE])
        self.max_concurrent_games, self.max_moves = max_concurrent_games, max_moves
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.analyzer, self.analyzer_temperature = analyzer, analyzer_temperature
        self.analyzer_max_new_tokens = analyzer_max_new_tokens
        self.base_prompt, self.observation_chars, self.seed = base_prompt, observation_chars, seed
        self.initial_prompts = list(initial_prompts or [])
        if len(self.initial_prompts) > population - 1:
            raise ValueError(f"memo initial_prompts: {len(self.initial_prompts)} prompts besides the base prompt do not "
                             f"fit a population of {population}")

    # ------------------------------------------------------------------ driver
    def run(self, ctx: StageContext) -> dict[str, str]:
        from models.tokenizer import load_tokenizer
        cfg, rt = ctx.cfg, ctx.runtime
        unknown = [n for n in [self.analyzer, *self.eval_opponents] if n not in (None, BASELINE, *cfg.reward.judges)]
        if unknown:
            raise StageError(f"stage {ctx.name!r}: {unknown} name no reward.judges entry (known: "
                             f"{list(cfg.reward.judges)}, or 'baseline' for an evaluation opponent)")
        policy = ctx.require("policy")
        tok = load_tokenizer(ctx.require("base_model"))
        workers = rt.start_rollout_workers(cfg, policy)
        judges = self._start_judges(rt, cfg, policy)
        try:
            player = ModelClient(workers, None, tok, cfg.data.chat_template, self.temperature, self.max_new_tokens,
                                 runtime=rt)
            analyzer = (ModelClient(None, judges[self.analyzer], tok, False, self.analyzer_temperature,
                                    self.analyzer_max_new_tokens) if self.analyzer else
                        ModelClient(workers, None, tok, cfg.data.chat_template, self.analyzer_temperature,
                                    self.analyzer_max_new_tokens, runtime=rt))
            opponents = {n: ModelClient(None, judges[n], tok, False, self.temperature, self.max_new_tokens)
                         for n in self.eval_opponents if n != BASELINE}
            return self._evolve(ctx, player, analyzer, opponents)
        finally:
            rt.stop_actors(workers)
            rt.stop_judges(judges)

    def _start_judges(self, rt: StageRuntime, cfg: Any, policy: str) -> dict[str, Any]:
        from rl.config import as_container
        names = {n for n in [self.analyzer, *self.eval_opponents] if n not in (None, BASELINE)}
        if not names:
            return {}
        specs = {n: as_container(cfg.reward.judges[n]) for n in names}
        for spec in specs.values():
            if spec["chat_template"] is None:
                spec["chat_template"] = cfg.data.chat_template
        return rt.start_judges(specs, policy)

    def _evolve(self, ctx: StageContext, player: ModelClient, analyzer: ModelClient,
                opponents: dict[str, ModelClient]) -> dict[str, str]:
        out = ctx.stage_dir
        (out / "games").mkdir(exist_ok=True)
        state_path, metrics_path = out / "state.pkl", out / "metrics.jsonl"
        state = self._load_state(ctx, state_path, metrics_path)
        rng = random.Random()
        rng.setstate(state["rng"])
        env = trueskill_env()
        if state["population"] is None:
            state["population"], state["analyzer_malformed"] = self._initial_population(analyzer, rng)
        for gen in range(state["generation"] + 1, self.generations):
            t0 = time.perf_counter()
            row = self._generation(ctx, player, analyzer, opponents, state, rng, env, gen)
            row["wall_s"] = time.perf_counter() - t0
            with metrics_path.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")
            state["generation"], state["rng"] = gen, rng.getstate()
            state_path.write_bytes(pickle.dumps(state))
            ev = ", ".join(f"{k} {v['win_rate']:.2f}" for k, v in row["eval"].items())
            say(f"memo: generation {gen + 1}/{self.generations}: best {row['best']['id']} fitness "
                f"{row['best']['fitness']:.3f}; eval win rate {ev}; {row['games']} games ({row['replayed_games']} "
                f"replayed) in {row['wall_s']:.0f} s")
        best = state["best"]
        text = best["prompt"] + ("\n\nInsights from past games:\n" + "".join(
            f"{i}. {x}\n" for i, x in enumerate(best["memory"], 1)) if best["memory"] else "")
        (out / "memo_prompt.txt").write_text(text)
        (out / "memo_context.json").write_text(json.dumps({"game": self.game, "best": best,
                                                           "history": state["history"]}, indent=2))
        ctx.summary["memo"] = {"best_fitness": best["fitness"], "best_generation": best["generation"],
                               "history": state["history"], "rollout_restarts": player.restarts}
        return {"memo_prompt": str(out / "memo_prompt.txt"), "memo_context": str(out / "memo_context.json")}

    def _load_state(self, ctx: StageContext, state_path: Path, metrics_path: Path) -> dict[str, Any]:
        """The state saved after the last finished generation when it was made with the same settings (the
        metrics of later generations dropped), else a fresh one."""
        # what the saved state was made with: the stage's settings, the recipe keys it reads, the player model
        settings = json.dumps([vars(self), config_fingerprint_part(ctx.cfg, self.config_keys),
                               files_identity(ctx.require("policy"))], sort_keys=True, default=str)
        state = pickle.loads(state_path.read_bytes()) if state_path.exists() else None
        if state is not None and state.get("settings") != settings:
            say("memo: the saved state was made with other stage settings; starting afresh")
            state = None
        if state is not None:
            say(f"memo: resuming after generation {state['generation']}")
            keep = [x for x in metrics_path.read_text().splitlines() if json.loads(x)["generation"] <= state["generation"]]
            metrics_path.write_text("".join(x + "\n" for x in keep))
            return state
        metrics_path.unlink(missing_ok=True)
        return {"settings": settings, "generation": -1, "rng": random.Random(self.seed).getstate(), "ratings": {},
                "memory": [], "history": [], "buffer": PrefixReplayBuffer(self.replay_capacity, self.replay_alpha),
                "population": None, "analyzer_malformed": 0, "best": None}

    def _generation(self, ctx: StageContext, player: ModelClient, analyzer: ModelClient,
                    opponents: dict[str, ModelClient], state: dict[str, Any], rng: random.Random, env: Any,
                    gen: int) -> dict[str, Any]:
        """One generation: the tournament, ratings, replay buffer, the best candidate's evaluation, the memory
        update and the next population; returns the generation's metrics row."""
        population: list[Candidate] = state["population"]
        games = self._tournament(player, population, state["buffer"], state["memory"], rng, gen)
        with (ctx.stage_dir / "games" / f"gen{gen}.jsonl").open("w") as f:
            for g in games:
                f.write(json.dumps(g) + "\n")
        fresh = [g for g in games if not g["replayed"]]
        state["ratings"] = rate_games(state["ratings"], fresh, env)
        recs = records(games)
        for g in games:
            if not g["failed"]:
                state["buffer"].push_game(g["steps"], g["winners"], g["seed"])
        fitness = {c.id: self._fitness(recs.get(c.id), state["ratings"].get(c.id)) for c in population}
        best = max(population, key=lambda c: fitness[c.id])
        row: dict[str, Any] = {"generation": gen, "games": len(games), "replayed_games": len(games) - len(fresh),
                               "failed_games": sum(g["failed"] for g in games),
                               "best": {**asdict(best), "fitness": fitness[best.id]},
                               "candidates": [self._candidate_row(c, recs, state["ratings"], fitness)
                                              for c in population],
                               "replay": state["buffer"].stats(), **invalid_move_rates(recs)}
        row["eval"] = self._evaluate(player, opponents, best, state["memory"], rng, gen)
        last = gen == self.generations - 1
        before = list(state["memory"])
        if self.memory and not last:
            state["memory"], malformed = self._update_memory(analyzer, population, games, recs, state, fitness, rng)
            state["analyzer_malformed"] += malformed
        row["memory"] = {"bank": state["memory"], "added": [x for x in state["memory"] if x not in before],
                         "removed": [x for x in before if x not in state["memory"]],
                         "analyzer_malformed_total": state["analyzer_malformed"]}
        if not last:
            state["population"] = self._next_population(analyzer, population, fitness, games, state, rng, gen)
        state["best"] = {**asdict(best), "fitness": fitness[best.id], "memory": before, "generation": gen}
        state["history"].append({"generation": gen, "best_fitness": fitness[best.id], "eval": row["eval"]})
        return row

    # ------------------------------------------------------------------ games
    def _observation(self, obs: str) -> str:
        return obs[-self.observation_chars:] if self.observation_chars > 0 else obs

    def _play(self, player: ModelClient, specs: list[dict[str, Any]], prompts: dict[str, Any],
              clients: dict[str, ModelClient], seed: int) -> list[dict[str, Any]]:
        """Play `specs` (agents, seed, replay prefix) in lockstep, at most `max_concurrent_games` at once.
        `prompts[agent](observation)` renders an agent's turn; `clients` names the model of agents that are
        not the player (evaluation opponents)."""
        from rl.methods.memo.textarena import TextArenaGame
        pending, active, done = list(enumerate(specs)), [], []
        tick = 0
        while pending or active:
            while pending and len(active) < self.max_concurrent_games:
                index, spec = pending.pop(0)
                game = TextArenaGame(self.game, spec["seed"], spec["agents"], self.max_moves)
                game.index = index
                if spec.get("replay"):
                    game.replay(spec["replay"])
                active.append(game)
            asks: dict[str, list[tuple[Any, str]]] = {}
            for game in active:
                if not game.done:
                    p, obs = game.current()
                    agent = game.record.agents[p]
                    asks.setdefault(agent if agent in clients else "", []).append(
                        (game, prompts[agent](self._observation(obs))))
            for who, items in asks.items():
                client = clients.get(who, player)
                for (game, _), text in zip(items, client.generate([t for _, t in items], seed * 100_003 + tick)):
                    game.play(text)
            tick += 1
            for game in [g for g in active if g.done]:
                active.remove(game)
                done.append(game)
        done.sort(key=lambda g: g.index)  # the schedule's order, whatever order the games ended in
        return [{**g.record.to_json(), "invalid_moves": g.record.invalid_moves, "moves": g.record.moves}
                for g in done]

    def _tournament(self, player: ModelClient, population: list[Candidate], buffer: PrefixReplayBuffer,
                    memory: list[str], rng: random.Random, gen: int) -> list[dict[str, Any]]:
        specs = self.tournament_specs([c.id for c in population], buffer, rng)
        mem = memory if self.memory else []
        prompts = {c.id: (lambda obs, p=c.prompt: agent_prompt(p, mem, obs)) for c in population}
        prompts[BASELINE] = baseline_prompt
        return self._play(player, specs, prompts, {}, seed=self.seed * 1000 + gen)

    def tournament_specs(self, candidates: list[str], buffer: PrefixReplayBuffer,
                         rng: random.Random) -> list[dict[str, Any]]:
        """The generation's games (`agents`, `seed`, `replay` prefix or None): the schedule, each game started
        from a replayed prefix with probability `replay_prob` (`replay_mode: within`, the released code) or
        played fresh with such a replayed game added after it (`extra`: every arm rates as many fresh games)."""
        specs = []
        for agents in tournament_schedule(candidates, self.rounds, BASELINE):
            entry = buffer.sample(rng) if self.replay and len(buffer) and rng.random() < self.replay_prob else None
            if entry is not None and self.replay_mode == "extra":
                specs.append({"agents": list(agents), "seed": rng.randint(0, 1000), "replay": None})
            specs.append({"agents": list(agents), "seed": entry.seed if entry else rng.randint(0, 1000),
                          "replay": entry.played if entry else None})
        return specs

    def _evaluate(self, player: ModelClient, opponents: dict[str, ModelClient], best: Candidate, memory: list[str],
                  rng: random.Random, gen: int) -> dict[str, dict[str, float]]:
        """The best candidate against each evaluation opponent, `eval_rounds` games in each seat order."""
        out = {}
        mem = memory if self.memory else []
        for name in self.eval_opponents:
            opp = f"eval:{name}"
            specs = [{"agents": agents, "seed": rng.randint(0, 1000)}
                     for agents in tournament_schedule(["best"], self.eval_rounds, opp)]
            prompts = {"best": lambda obs: agent_prompt(best.prompt, mem, obs), opp: baseline_prompt}
            clients = {opp: opponents[name]} if name in opponents else {}
            rec = records(self._play(player, specs, prompts, clients, seed=self.seed * 1000 + 500 + gen))["best"]
            out[name] = {"win_rate": rec.rate("wins"), "loss_rate": rec.rate("losses"),
                         "draw_rate": rec.rate("draws"), "failed": rec.failed, "games": rec.games}
        return out

    def _fitness(self, rec: Any, rating: Any) -> float:
        if self.fitness == "trueskill":
            return float(rating.mu) if rating is not None else trueskill_env().mu
        return rec.rate("wins") if rec is not None else 0.0

    @staticmethod
    def _candidate_row(c: Candidate, recs: dict, ratings: dict, fitness: dict) -> dict[str, Any]:
        r, t = recs.get(c.id), ratings.get(c.id)
        return {"id": c.id, "origin": c.origin, "prompt": c.prompt, "fitness": fitness[c.id],
                "win_rate": r.rate("wins") if r else 0.0, "loss_rate": r.rate("losses") if r else 0.0,
                "draw_rate": r.rate("draws") if r else 0.0, "mu": t.mu if t else None, "sigma": t.sigma if t else None,
                "invalid_move_rate": r.invalid_moves / r.moves if r and r.moves else 0.0}

    # ------------------------------------------------------------------ analyzer
    def _ask(self, analyzer: ModelClient, texts: list[str], rng: random.Random) -> list[str]:
        return analyzer.generate(texts, seed=rng.randint(0, 2**31 - 1))

    def _initial_population(self, analyzer: ModelClient, rng: random.Random) -> tuple[list[Candidate], int]:
        """The base prompt, the recipe's `initial_prompts`, then style variations written by the analyzer; and
        how many of the analyzer's answers were empty (malformed: the base prompt stands in)."""
        out = [Candidate("g0c0", self.base_prompt, 0, "base")]
        out += [Candidate(f"g0c{i}", p, 0, "given") for i, p in enumerate(self.initial_prompts, 1)]
        styles = [STYLES[i % len(STYLES)] for i in range(self.population - len(out))]
        asks = [style_request(self.game, self.base_prompt, s, self.compact) for s in styles]
        prompts = [clean_prompt(text) for text in self._ask(analyzer, asks, rng)]
        for s, prompt in zip(styles, prompts):
            out.append(Candidate(f"g0c{len(out)}", prompt or self.base_prompt, 0, f"style:{s}"))
        return out, sum(not p for p in prompts)

    def _update_memory(self, analyzer: ModelClient, population: list[Candidate], games: list[dict[str, Any]],
                       recs: dict[str, Any], state: dict[str, Any], fitness: dict[str, float],
                       rng: random.Random) -> tuple[list[str], int]:
        """The memory after this generation (`recs`: its games' records), and 1 when the analyzer's answer
        changed nothing (malformed)."""
        ranked = sorted(population, key=lambda c: fitness[c.id], reverse=True)
        agents = [(c.prompt, recs[c.id].wins if c.id in recs else 0, recs[c.id].games if c.id in recs else 0)
                  for c in ranked]
        blocks = []
        for c in ranked:
            mine = [g for g in games if c.id in g["agents"] and not g["failed"]][:self.reflection_games]
            if mine:
                blocks.append(f"Agent: {c.prompt}\n" + "\n".join(
                    f"- {summarize_game(g, c.id, compact=self.compact)}" for g in mine))
        decisive = state["buffer"].strategic_states(self.strategic_topk) if self.strategic_topk > 0 else []
        states = decisive_text(decisive, self.compact)
        k, bank = self.insights_per_generation, state["memory"]
        crud = self.memory_merge == "crud"
        ask = insight_request(self.game, agents, "\n\n".join(blocks), states, k, bank if crud else None,
                              self.compact)
        answer = self._ask(analyzer, [ask], rng)[0]
        if crud:
            new_bank, counts = apply_crud(bank, parse_crud(answer), self.max_insights, self.dup_overlap)
            changed = counts["added"] + counts["edited"] + counts["removed"]
            return new_bank, int(changed == 0)
        new = parse_insight_lines(answer, k)
        if not new:
            return bank, 1
        return merge_insights(bank, new, self.memory_merge, self.max_insights, self.dup_overlap), 0

    def _next_population(self, analyzer: ModelClient, population: list[Candidate], fitness: dict[str, float],
                         games: list[dict[str, Any]], state: dict[str, Any], rng: random.Random,
                         gen: int) -> list[Candidate]:
        plan = population_plan(self.population, self.shares)
        ranked = sorted(population, key=lambda c: fitness[c.id], reverse=True)
        # elites keep their id: their TrueSkill rating carries over, as the released agent pool's does
        nxt = [Candidate(c.id, c.prompt, c.generation, "elite", [c.id]) for c in ranked[:plan["keep"]]]
        asks, meta = [], []
        for _ in range(plan["random"]):
            asks.append(random_request(self.game, self.compact))
            meta.append(("random", []))
        bank = state["memory"]
        for _ in range(plan["memory_guided"]):
            if not bank:  # nothing to be guided by yet: a random prompt, as the released code falls back
                asks.append(random_request(self.game, self.compact))
                meta.append(("random", []))
                continue
            asks.append(memory_guided_request(self.game, rng.sample(bank, min(self.memory_sample, len(bank))),
                                              self.compact))
            meta.append(("memory_guided", []))
        for i in range(plan["trajectory"]):
            c = ranked[i % len(ranked)]
            mine = [g for g in games if c.id in g["agents"] and not g["failed"]][:max(1, self.reflection_games)]
            asks.append(trajectory_request(self.game, c.prompt, "\n".join(f"- {summarize_game(g, c.id)}" for g in mine),
                                           self.compact))
            meta.append(("trajectory", [c.id]))
        for i in range(plan["crossover"]):
            a, b = ranked[0], ranked[min(1 + i, len(ranked) - 1)]
            asks.append(crossover_request(self.game, a.prompt, b.prompt, self.compact))
            meta.append(("crossover", [a.id, b.id]))
        prompts = [clean_prompt(text) for text in self._ask(analyzer, asks, rng)]
        state["analyzer_malformed"] += sum(not p for p in prompts)  # an empty answer: the base prompt stands in
        for j, ((origin, parents), prompt) in enumerate(zip(meta, prompts)):
            nxt.append(Candidate(f"g{gen + 1}c{j}", prompt or self.base_prompt, gen + 1, origin, parents))
        return nxt

