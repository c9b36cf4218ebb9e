"""Environments and the multi-turn rollout loop on token ids; the sandboxed Python tool."""

import threading
import time

import pytest
import torch

from models.families import response_logprobs
from rl.env import Env, EnvStep
from rl.losses import ppo_clip_loss
from rl.tools import run_python
from rollout.base import SamplingParams
from rollout.envs import Calculator
from rollout.multiturn import Seats, run_episodes

PROMPTS = ["12+3*4=", "5+6*7="]
ROWS = [{"answer": "24"}, {"answer": "47"}]


def test_the_python_tool_bounds_time_memory_output_and_network():
    assert run_python("print(3*4)").output == "12\n"
    hung = run_python("while True: pass", timeout_s=0.5)  # killed at its deadline
    assert not hung.ok and hung.error == "timed out after 0.5 s"
    crashed = run_python("import os; os.kill(os.getpid(), 9)")
    assert not crashed.ok and crashed.error == "killed by signal SIGKILL"
    big = run_python("x = bytearray(2**31)", memory_mb=256)
    assert not big.ok and "out of memory" in big.error
    net = run_python("import socket; socket.create_connection(('127.0.0.1', 9))")
    assert not net.ok and "Error" in net.output  # the sandbox's probes: tests/rl/test_sandbox.py
    long = run_python("print('a' * 5000)", max_output_chars=100)
    assert long.ok and len(long.output) < 200 and "characters cut" in long.output


def test_the_calculator_env_runs_the_tool_and_scores_the_answer():
    env = Calculator()
    assert env.reset("12+3*4=", {"answer": "24"}, None) == "12+3*4="
    assert env.step("3*4") == EnvStep(observation="=12\n", info={"tool_error": None})
    assert env.step("hello").observation == "?\n"
    assert env.step(r"so \boxed{24}").reward == 1.0 and env.step(r"\boxed{25}").reward == 0.0


class Script(Env):
    """Replies `obs<t>` after each action, ends after `turns` turns with reward = turns."""

    def __init__(self, turns=3):
        self.turns, self.t = turns, 0

    def step(self, action):
        self.t += 1
        if self.t >= self.turns:
            return EnvStep(reward=float(self.t), done=True)
        return EnvStep(observation=f"[obs{self.t}]", reward=0.5)


def _episodes(engine, factory, **kw):
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=kw.pop("max_new_tokens", 6), seed=5)
    return run_episodes(engine, factory, PROMPTS, ROWS, sp, max_turns=kw.pop("max_turns", 3),
                        max_episode_tokens=kw.pop("max_episode_tokens", 64), seats=Seats(engine), **kw)


@pytest.mark.parametrize("schedule", ["lockstep", "per_episode"])
def test_episodes_keep_the_engine_ids_and_mask_observations(engine, schedule):
    b = _episodes(engine, Script, schedule=schedule)
    assert len(b) == 4 and b.group_id.tolist() == [0, 0, 1, 1]
    tok = engine.tokenizer
    for i in range(len(b)):
        n = int(b.response_attn[i].sum())
        obs = b.observation_mask[i, :n].bool()
        assert tok.decode(b.response_ids[i, :n][obs]) == "[obs1][obs2]"  # observations appended as ids
        assert torch.equal(b.response_mask[i, :n].bool(), ~obs)
        assert set(b.token_step[i, :n][~obs].tolist()) == {0, 1, 2} and (b.token_step[i, :n][obs] == -1).all()
        assert b.step_rewards[i] == [0.5, 0.5, 3.0] and b.metadata[i]["env_return"] == 4.0
        assert not b.truncated[i]
    # the learner, reading the very ids the engine sampled, gets the engine's logprobs on every action token
    logp, _ = response_logprobs(engine.model, b)
    mask = b.response_mask.bool()
    assert torch.allclose(logp[mask], b.rollout_logp[mask], atol=1e-5)


def test_observation_tokens_get_exactly_zero_gradient(engine):
    b = _episodes(engine, Script)
    logp, _ = response_logprobs(engine.model, b)
    logp.retain_grad()
    adv = torch.randn(len(b), 1).expand_as(logp)
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, b.response_mask)
    loss.backward()
    obs = b.observation_mask.bool()
    assert (logp.grad[obs] == 0).all() and logp.grad[b.response_mask.bool()].abs().sum() > 0


class HangingTool(Env):
    def step(self, action):
        result = run_python("while True: pass", timeout_s=0.3)
        return EnvStep(observation="=error\n", failed=not result.ok)


class StuckStep(Env):
    def step(self, action):
        time.sleep(3600)  # an environment that never answers (a dead service, a lock)


class Crashing(Env):
    def step(self, action):
        raise RuntimeError("the environment broke")


def test_a_hanging_tool_or_a_crashing_env_is_a_failed_step_not_a_hung_rollout(engine):
    hung = _episodes(engine, HangingTool, max_turns=2)  # each call is killed at its 0.3 s deadline
    assert all(t == ["failed", "failed"] for t in hung.step_types)
    crashed = _episodes(engine, Crashing)
    assert all(t == ["failed"] for t in crashed.step_types)
    assert all("the environment broke" in m["env_error"] for m in crashed.metadata)
    assert not crashed.truncated.any() and (crashed.observation_mask == 0).all()


def test_a_host_without_the_sandbox_stops_the_rollout_instead_of_failing_every_tool_step(engine, monkeypatch, tmp_path):
    """A rollout worker on a node without bubblewrap: the Python tool refuses to run, and the episode loop raises
    that (naming rollout.sandbox) rather than training on episodes whose every step failed."""
    from rl import tools

    class RunsTheAction(Env):
        def step(self, action):
            return EnvStep(observation=tools.run_python(f"print({action!r})").output, done=True)
    monkeypatch.setenv("PATH", str(tmp_path))  # a host without bwrap
    monkeypatch.setenv(tools.SANDBOX_ENV, "bwrap")
    tools.bwrap_problem.cache_clear()
    try:
        with pytest.raises(tools.SandboxUnavailable, match=r"rollout\.sandbox: process"):
            _episodes(engine, RunsTheAction, max_turns=2)
    finally:
        monkeypatch.undo()
        tools.bwrap_problem.cache_clear()


@pytest.mark.timeout(120)  # without a deadline the rollout would hang for an hour
def test_a_stuck_environment_step_ends_its_episode_as_failed_at_its_deadline(engine):
    b = _episodes(engine, StuckStep, max_turns=2, step_timeout_s=0.5)
    assert all(t == ["failed"] for t in b.step_types)
    assert all("did not return within 0.5 s (rollout.env_step_timeout_s)" in m["env_error"] for m in b.metadata)


def test_budgets_cap_turns_and_episode_tokens(engine):
    b = _episodes(engine, lambda: Script(turns=10), max_turns=2)
    assert all(len(r) == 2 for r in b.step_rewards) and b.truncated.all()
    short = _episodes(engine, lambda: Script(turns=10), max_episode_tokens=9, max_turns=10)
    assert int(short.response_attn.sum(-1).max()) <= 9 and short.truncated.all()


class AskTheOtherSeat(Env):
    """Two seats: the other seat's move (played by the policy) is the observation."""

    def reset(self, prompt, row, seats):
        self.seats = seats
        return prompt

    def step(self, action):
        return EnvStep(observation=self.seats.ask(action, "policy", max_new_tokens=3) + "|", done=len(action) > 100)


@pytest.mark.parametrize("schedule", ["lockstep", "per_episode"])
def test_another_seat_is_played_by_the_policy_and_not_trained_on(engine, schedule):
    b = _episodes(engine, AskTheOtherSeat, max_turns=2, schedule=schedule)
    for i in range(len(b)):
        n = int(b.response_attn[i].sum())
        obs = b.observation_mask[i, :n].bool()
        assert obs.any() and engine.tokenizer.decode(b.response_ids[i, :n][obs]).endswith("|")
    with pytest.raises(ValueError, match="frozen needs rollout.env_opponent_path"):
        Seats(engine).ask("1+1=", "frozen")


def test_the_router_env_asks_a_model_agent_through_its_seat_and_runs_in_the_episode_loop(engine, tmp_path):
    import json

    from rl.methods.monoscale.env import AgentRouterEnv
    pool = tmp_path / "pool.json"
    pool.write_text(json.dumps([
        {"name": "agent0", "description": "a model", "kind": "model", "system_prompt": "Add:", "seat": "policy"},
        {"name": "agent1", "description": "a solver", "kind": "python", "code": "print(eval(TASK))"}]))
    env = AgentRouterEnv(str(pool), max_new_tokens=4)
    env.reset("", {"subtasks": [{"text": "1+2", "answer": "3"}, {"text": "2+2", "answer": "4"}]}, Seats(engine))
    expected = Seats(engine).ask("Add:\n1+2", "policy", max_new_tokens=4).strip()  # greedy: the same answer
    by_model = env.step("agent0")
    assert by_model.info == {"agent": "agent0", "answer": expected} and by_model.reward == float(expected == "3")
    assert env.step("agent1").reward == 1.0
    rows = [{"subtasks": [{"text": "1+2", "kind": "sum", "answer": "3"}, {"text": "5+2", "kind": "sum", "answer": "7"}]}]
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=1)
    b = run_episodes(engine, lambda: AgentRouterEnv(str(pool), max_new_tokens=4), ["route"], rows, sp, max_turns=4,
                     max_episode_tokens=400, seats=Seats(engine))
    assert all(t == ["route", "route"] for t in b.step_types) and [m["turns"] for m in b.metadata] == [2, 2]
    assert (b.observation_mask.sum(dim=1) > 0).all()  # the second subtask's routing prompt came back as observation


def _gated_env(fast_episodes: int):
    """Episodes of the first prompt take three quick turns; the first step of every other episode waits until
    all `fast_episodes` of them have ended (up to 20 s): it returns only if episodes advance independently."""
    ended, lock, gate = [0], threading.Lock(), threading.Event()

    class Gated(Env):
        def reset(self, prompt, row, seats):
            self.fast, self.t = prompt == PROMPTS[0], 0
            return prompt

        def step(self, action):
            self.t += 1
            if self.fast and self.t == 3:
                with lock:
                    ended[0] += 1
                    if ended[0] == fast_episodes:
                        gate.set()
                return EnvStep(reward=1.0, done=True)
            if not self.fast and self.t == 1 and not gate.wait(20):
                raise TimeoutError("the fast episodes never ended")
            return EnvStep(observation="[ok]", reward=0.5, done=not self.fast and self.t == 2)
    return Gated


@pytest.mark.timeout(120)
def test_per_episode_loops_let_an_episode_finish_while_another_waits_on_its_step(engine):
    """The slow episodes' first step returns only once the fast episodes have taken all three of their turns:
    per episode, every episode completes; in lockstep, turn 2 waits for turn 1's slowest step, so that step
    hits its deadline instead."""
    b = _episodes(engine, _gated_env(2), schedule="per_episode", step_timeout_s=30)
    assert b.step_rewards == [[0.5, 0.5, 1.0]] * 2 + [[0.5, 0.5]] * 2
    assert all(t == ["action"] * len(t) for t in b.step_types) and "env_error" not in b.metadata[2]
    held = _episodes(engine, _gated_env(2), schedule="lockstep", step_timeout_s=1)
    assert held.step_types[2:] == [["failed"]] * 2
    assert all("did not return within 1 s" in m["env_error"] for m in held.metadata[2:])


@pytest.mark.parametrize("schedule", ["lockstep", "per_episode"])
def test_environment_steps_run_concurrently_up_to_env_workers(engine, schedule):
    """Every first step waits at a barrier of all four episodes: it passes only when four steps run at once."""
    barrier = threading.Barrier(4)

    class Meeting(Env):
        def step(self, action):
            barrier.wait(timeout=3)
            return EnvStep(reward=1.0, done=True)
    together = _episodes(engine, Meeting, schedule=schedule, env_workers=4)
    assert together.step_rewards == [[1.0]] * 4
    barrier.reset()
    one_at_a_time = _episodes(engine, Meeting, schedule=schedule, env_workers=1)
    assert one_at_a_time.step_types == [["failed"]] * 4
    assert all("BrokenBarrierError" in m["env_error"] for m in one_at_a_time.metadata)


def test_a_lockstep_rollout_repeats_for_its_seed(engine):
    first, again = _episodes(engine, Script), _episodes(engine, Script)
    assert torch.equal(first.response_ids, again.response_ids) and first.step_rewards == again.step_rewards
