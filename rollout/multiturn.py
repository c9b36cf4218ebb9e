"""The multi-turn rollout loop: episodes of an environment (`rl.env`) on token ids.

Each turn, the engine continues every unfinished episode from its token ids so far (`generate_ids`:
prompt ids in, new ids and their logprobs out); the sampled ids are appended as they are, the action's
text goes to the environment, and its observation is tokenised once and appended as ids. So the ids the
learner trains on are exactly those the engine produced, with no re-tokenisation across turns.
Budgets: `max_turns` turns and `max_episode_tokens` response tokens (actions and observations) per
episode; each turn at most `sampling.max_new_tokens` new tokens.
"""

from __future__ import annotations

import dataclasses
import threading
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

    def ask(self, text: str, seat: str = "policy", max_new_tokens: int | None = None) -> str:
        engine = {"policy": self.engine, "frozen": self.frozen}.get(seat)
        if engine is None:
            raise ValueError(f"seat {seat!r}: no engine plays it (frozen needs rollout.env_opponent_path)")
        tok = engine.tokenizer
        sp = dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens or self.sampling.max_new_tokens)
        ids = tok(text, add_special_tokens=False)["input_ids"] or [tok.bos_token_id or tok.eos_token_id]
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
                 metadata: list[dict] | None = None, step_timeout_s: float = 60.0) -> Batch:
    """`sampling.n` episodes per prompt (prompt-major rows) of the environment `env_factory()`; each step of an
    environment ends at `step_timeout_s` (a step past it fails its episode)."""
    tok, n = engine.tokenizer, sampling.n
    padded = encode_prompts(tok, prompts)
    episodes: list[Episode] = []
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        for _ in range(n):
            env = env_factory()
            first = env.reset(prompt, row, seats)
            ids = padded["input_ids"][i][padded["attention_mask"][i].bool()].tolist() if first == prompt else \
                tok(first, add_special_tokens=False)["input_ids"]
            episodes.append(Episode(env, ids))
    base_seed = sampling.seed if sampling.seed is not None else 0
    for turn in range(max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            break
        budgets = [min(sampling.max_new_tokens, max_episode_tokens - len(e.ids)) for e in active]
        sp = dataclasses.replace(sampling, n=1, max_new_tokens=max(budgets))
        outs = engine.generate_ids([e.prompt_ids + e.ids for e in active], sp,
                                   seeds=[base_seed * 1_000_003 + turn * 7919 + k for k in range(len(active))])
        for e, out, budget in zip(active, outs, budgets):
            _take_turn(e, out.ids[:budget], out.logprobs[:budget], turn, tok, step_timeout_s, max_episode_tokens)
    for e in episodes:
        finish = getattr(e.env, "finish", None)
        restated = finish() if finish is not None else None
        if restated is not None:  # the env restates its turns' rewards now that the episode is over
            e.rewards[:len(restated)] = [float(r) for r in restated][:len(e.rewards)]
    return _to_batch(episodes, tok, prompts, padded, n, group_ids, rows, metadata)


def _take_turn(e: Episode, ids: list[int], logp: list[float], turn: int, tok: Any, step_timeout_s: float,
               max_episode_tokens: int) -> None:
    """Append the policy's action `ids` to episode `e`, step its environment and append the observation it
    answers with (masked out of the loss); a step that fails ends the episode."""
    e.ids += ids
    e.logp += logp
    e.observation += [0] * len(ids)
    e.step += [turn] * len(ids)
    try:
        result = step_within(e.env, tok.decode(ids, skip_special_tokens=True), step_timeout_s)
    except SandboxUnavailable:  # the host, not the model: every step would fail the same way
        raise
    except Exception as exc:  # a failed step ends the episode; the rollout goes on
        e.error = f"{type(exc).__name__}: {exc}"
        e.rewards.append(0.0)
        e.types.append("failed")
        e.failed += 1
        e.done = True
        return
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


def _to_batch(episodes: list[Episode], tok: Any, prompts: list[str], padded: dict, n: int,
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
