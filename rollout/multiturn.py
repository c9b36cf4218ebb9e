"""The multi-turn rollout loop: episodes of an environment (`rl.env`) on token ids.

Each turn, the engine continues an unfinished episode from its token ids so far (`generate_ids`: prompt
ids in, new ids and their logprobs out); the sampled ids are appended as they are, the action's text goes
to the environment, and its observation is tokenised once and appended as ids. So the ids the learner
trains on are exactly those the engine produced, with no re-tokenisation across turns.
Budgets: `max_turns` turns and `max_episode_tokens` response tokens (actions and observations) per
episode; each turn at most `sampling.max_new_tokens` new tokens.

Scheduling (`rollout.agent_loop`): environment steps always run concurrently on a thread pool
(`rollout.env_workers`); `lockstep` generates turn t of every unfinished episode in one call and waits for
all of turn t's steps, `per_episode` lets each episode advance on its own (a slow tool call holds only its
own episode, the wall time of a rollout approaches its slowest single episode).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from rl.batch import Batch
from rl.tools import SandboxUnavailable
from rollout.base import SamplingParams, attach_prompt_fields, encode_prompts


@dataclass
class Completion:
    """One continuation from an engine's `generate_ids`."""
    ids: list[int]
    logprobs: list[float]
    ended: bool  # by EOS or a stop string (not by the length cap)


@dataclass
class Episode:
    env: Any
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # response so far: actions and observations
    logp: list[float] = field(default_factory=list)
    observation: list[int] = field(default_factory=list)  # 1 on observation tokens
    step: list[int] = field(default_factory=list)  # turn index of action tokens, -1 on observations
    rewards: list[float] = field(default_factory=list)  # one per turn
    types: list[str] = field(default_factory=list)  # the env's step_type, else "action" or "failed", one per turn
    failed: int = 0  # failed turns
    done: bool = False
    ended: bool = False  # the environment ended it (not a budget)
    error: str | None = None


class Seats:
    """Other seats of an environment, played by the current policy or a frozen model (not trained on)."""

    def __init__(self, engine: Any, frozen: Any = None, sampling: SamplingParams | None = None):
        self.engine, self.frozen = engine, frozen
        self.sampling = sampling or SamplingParams(temperature=0.0)
        # the engines serve one call at a time: the rollout loop's generate calls and the seats' asks take turns
        self.lock = threading.Lock()

    def ask(self, text: str, seat: str = "policy", max_new_tokens: int | None = None) -> str:
        engine = {"policy": self.engine, "frozen": self.frozen}.get(seat)
        if engine is None:
            raise ValueError(f"seat {seat!r}: no engine plays it (frozen needs rollout.env_opponent_path)")
        tok = engine.tokenizer
        sp = dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens or self.sampling.max_new_tokens)
        ids = tok(text, add_special_tokens=False)["input_ids"] or [tok.bos_token_id or tok.eos_token_id]
        with self.lock:
            (out,) = engine.generate_ids([ids], sp, seeds=[sp.seed or 0])
        return tok.decode(out.ids, skip_special_tokens=True)


class EnvStepTimeout(RuntimeError):
    """An environment's step did not return within its deadline (`rollout.env_step_timeout_s`)."""


def step_within(env: Any, action: str, timeout_s: float) -> Any:
    """`env.step(action)`, ended at `timeout_s` (0: no deadline) with `EnvStepTimeout`. The step runs in a thread
    of its own; a step still running at the deadline is left behind (Python cannot stop a thread) and its episode
    ends as failed, so one stuck environment never holds the rollout."""
    if timeout_s <= 0:
        return env.step(action)
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["result"] = env.step(action)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=call, name="looprl-env-step", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise EnvStepTimeout(f"the environment's step did not return within {timeout_s:g} s "
                             f"(rollout.env_step_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box["result"]


def run_episodes(engine: Any, env_factory: Any, prompts: list[str], rows: list[dict], sampling: SamplingParams, *,
                 max_turns: int, max_episode_tokens: int, seats: Seats, group_ids: list[int] | None = None,
                 metadata: list[dict] | None = None, step_timeout_s: float = 60.0, schedule: str = "lockstep",
                 env_workers: int = 8) -> Batch:
    """`sampling.n` episodes per prompt (prompt-major rows) of the environment `env_factory()`; each step of an
    environment ends at `step_timeout_s` (a step past it fails its episode). Environment steps run on
    `env_workers` threads at once. `schedule`: `lockstep` (every unfinished episode takes turn t in one
    generate call, then all of turn t's steps run concurrently: reproducible for a seed on both engines) or
    `per_episode` (each episode advances on its own: as soon as its step returns it joins the next generate
    call, so an episode waiting on a slow tool holds no other; which episodes share a call depends on timing)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"rollout.agent_loop: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    tok = engine.tokenizer
    padded = encode_prompts(tok, prompts)
    episodes = _start(env_factory, prompts, rows, seats, tok, padded, sampling.n)
    loop = _AgentLoop(engine, episodes, sampling, seats, max_turns, max_episode_tokens, step_timeout_s)
    with ThreadPoolExecutor(max(1, env_workers), thread_name_prefix="looprl-env") as pool:
        (loop.lockstep if schedule == "lockstep" else loop.per_episode)(pool)
    for e in episodes:
        finish = getattr(e.env, "finish", None)
        restated = finish() if finish is not None else None
        if restated is not None:  # the env restates its turns' rewards now that the episode is over
            e.rewards[:len(restated)] = [float(r) for r in restated][:len(e.rewards)]
    return episodes_to_batch(episodes, tok, prompts, padded, sampling.n, group_ids, rows, metadata)


SCHEDULES = ("lockstep", "per_episode")


def _start(env_factory: Any, prompts: list[str], rows: list[dict], seats: Seats, tok: Any, padded: dict,
           n: int) -> list[Episode]:
    """`n` fresh episodes per prompt, each prompted with its environment's first observation as ids."""
    episodes: list[Episode] = []
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        for _ in range(n):
            env = env_factory()
            first = env.reset(prompt, row, seats)
            ids = padded["input_ids"][i][padded["attention_mask"][i].bool()].tolist() if first == prompt else \
                tok(first, add_special_tokens=False)["input_ids"]
            episodes.append(Episode(env, ids))
    return episodes


class _AgentLoop:
    """Generation on the calling thread, environment steps on a thread pool. Only the calling thread touches
    the tokenizer and the episodes' ids (fast tokenizers are not safe to share across threads); the pool
    threads run `env.step` alone. The engine is used under `seats.lock`, which an environment's `seats.ask`
    takes too, so a step that asks the policy waits for the generate call in flight."""

    def __init__(self, engine: Any, episodes: list[Episode], sampling: SamplingParams, seats: Seats,
                 max_turns: int, max_episode_tokens: int, step_timeout_s: float):
        self.engine, self.tok, self.episodes, self.sampling, self.seats = (engine, engine.tokenizer, episodes,
                                                                           sampling, seats)
        self.max_turns, self.max_episode_tokens, self.step_timeout_s = max_turns, max_episode_tokens, step_timeout_s
        self.turns = [0] * len(episodes)
        self.base_seed = sampling.seed if sampling.seed is not None else 0

    def lockstep(self, pool: ThreadPoolExecutor) -> None:
        for _ in range(self.max_turns):
            active = [i for i, e in enumerate(self.episodes) if not e.done]
            if not active:
                return
            steps = self._act(pool, active)
            for i, future in steps.items():
                self._observe(i, future)

    def per_episode(self, pool: ThreadPoolExecutor) -> None:
        ready = [i for i, e in enumerate(self.episodes) if not e.done]
        stepping: dict[Future, int] = {}
        while ready or stepping:
            if ready:
                stepping.update({f: i for i, f in self._act(pool, ready).items()})
                ready = []
            # take every step that has returned; wait for one only when no episode is ready to generate
            finished, _ = wait(stepping, timeout=None if not ready else 0, return_when=FIRST_COMPLETED)
            for future in finished:
                i = stepping.pop(future)
                self._observe(i, future)
                if not self.episodes[i].done and self.turns[i] < self.max_turns:
                    ready.append(i)

    def _act(self, pool: ThreadPoolExecutor, which: list[int]) -> dict[int, Future]:
        """One generate call continuing the episodes `which`; each action is appended and its step submitted."""
        active = [self.episodes[i] for i in which]
        budgets = [min(self.sampling.max_new_tokens, self.max_episode_tokens - len(e.ids)) for e in active]
        sp = dataclasses.replace(self.sampling, n=1, max_new_tokens=max(budgets))
        # an episode's seed depends on its index and turn alone, not on which episodes share the call
        seeds = [(self.base_seed * 1_000_003 + self.turns[i] * 7919 + i) % (1 << 63) for i in which]
        with self.seats.lock:
            outs = self.engine.generate_ids([e.prompt_ids + e.ids for e in active], sp, seeds=seeds)
        steps = {}
        for i, e, out, budget in zip(which, active, outs, budgets):
            ids, logp = out.ids[:budget], out.logprobs[:budget]
            append_action(e, ids, logp, self.turns[i])
            self.turns[i] += 1
            action = self.tok.decode(ids, skip_special_tokens=True)
            steps[i] = pool.submit(step_within, e.env, action, self.step_timeout_s)
        return steps

    def _observe(self, i: int, step: Future) -> None:
        try:
            result = step.result()
        except SandboxUnavailable:  # the host, not the model: every step would fail the same way
            raise
        except Exception as exc:  # a failed step ends the episode; the rollout goes on
            _fail(self.episodes[i], exc)
            return
        _append_observation(self.episodes[i], result, self.tok, self.max_episode_tokens)


def append_action(e: Episode, ids: list[int], logp: list[float], turn: int) -> None:
    e.ids += ids
    e.logp += logp
    e.observation += [0] * len(ids)
    e.step += [turn] * len(ids)


def _fail(e: Episode, exc: BaseException) -> None:
    e.error = f"{type(exc).__name__}: {exc}"
    e.rewards.append(0.0)
    e.types.append("failed")
    e.failed += 1
    e.done = True


def _append_observation(e: Episode, result: Any, tok: Any, max_episode_tokens: int) -> None:
    """Record the step's reward and type; append its observation (masked out of the loss) unless it ended."""
    e.rewards.append(float(result.reward))
    e.types.append(result.step_type or ("failed" if result.failed else "action"))
    e.failed += int(result.failed)
    if result.done:
        e.done = e.ended = True
        return
    room = max_episode_tokens - len(e.ids)
    obs = tok(result.observation, add_special_tokens=False)["input_ids"][:room] if result.observation else []
    e.ids += obs
    e.logp += [0.0] * len(obs)
    e.observation += [1] * len(obs)
    e.step += [-1] * len(obs)
    if len(e.ids) >= max_episode_tokens:
        e.done = True


def episodes_to_batch(episodes: list[Episode], tok: Any, prompts: list[str], padded: dict, n: int,
              group_ids: list[int] | None, rows: list[dict], metadata: list[dict] | None) -> Batch:
    B, L = len(episodes), max(1, max(len(e.ids) for e in episodes))

    def right(values: list[list], fill: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((B, L), fill, dtype=dtype)
        for i, v in enumerate(values):
            out[i, :len(v)] = torch.tensor(v, dtype=dtype)
        return out

    resp = right([e.ids for e in episodes], tok.pad_token_id, torch.long)
    attn = right([[1] * len(e.ids) for e in episodes], 0, torch.long)
    observation = right([e.observation for e in episodes], 0, torch.long)
    batch = Batch(prompt_ids=padded["input_ids"].repeat_interleave(n, 0),
                  prompt_mask=padded["attention_mask"].repeat_interleave(n, 0),
                  response_ids=resp, response_mask=(attn * (1 - observation)).float(), response_attn=attn,
                  group_id=torch.zeros(B, dtype=torch.long), rollout_logp=right([e.logp for e in episodes], 0.0,
                                                                                 torch.float32),
                  truncated=torch.tensor([not e.ended and e.error is None for e in episodes]),
                  token_step=right([e.step for e in episodes], -1, torch.long), observation_mask=observation,
                  responses=[tok.decode(e.ids, skip_special_tokens=True) for e in episodes],
                  step_rewards=[e.rewards for e in episodes], step_types=[e.types for e in episodes])
    answers = [r.get("answer") for r in rows]
    batch = attach_prompt_fields(batch, prompts, n, group_ids, answers, metadata)
    for m, e in zip(batch.metadata, episodes):
        m.update(env_return=sum(e.rewards), turns=len(e.rewards), failed_turns=e.failed)
        if e.error is not None:
            m["env_error"] = e.error
    return batch
