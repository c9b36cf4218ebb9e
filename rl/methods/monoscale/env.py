"""The agent-router environment (`rollout.env: monoscale`): the policy is a router that names an agent for
each subtask of a task, reading the agent cards and a router memory (MonoScale, `rl.methods.monoscale.core`).

* `pool`: a JSON file, a list of agents `{name, description, kind, ...}`; `kind` `model` (a language model with a
  `system_prompt`, played by the environment's `frozen` seat, `rollout.env_opponent_path`, or by the policy's
  own seat with `seat: policy`) or `python` (a scripted solver or tool: `code` run in the sandbox with the
  subtask's text in the variable `TASK`; what it prints is its answer).
* `memory`: a router-memory JSON (`RouterMemory.to_json`, e.g. the `router_memory` artifact of the `monoscale`
  stage), or null for an empty memory.
* A row holds the task: `subtasks`, a list of `{text, kind, answer}` (or, without it, one subtask from the row:
  the prompt, its `kind` column and the answer).
Each turn the policy answers with an agent name (the first card name it writes); the environment runs that
agent on the subtask and the judge scores the outcome: 1 when the agent's answer is the subtask's (`judge`: `exact`,
`contains`, or `math`: the stated value equivalent under math-verify), else 0 (an answer that names no agent scores 0). The observation is the next
subtask's routing prompt; the episode ends after the last subtask. Step type `route`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl.env import Env, EnvStep
from rl.methods.monoscale.core import (
    ANSWER_MATCHES,
    AgentCard,
    MemoryEntry,
    RouterMemory,
    Task,
    answer_matches,
    first_agent_named,
    router_prompt,
)
from rl.registry import register, register_alias
from rl.tools import run_python


def load_pool(path: str | Path) -> list[dict[str, Any]]:
    """The agents of a pool file; a bad agent fails with the file, index and key."""
    agents = json.loads(Path(path).read_text())
    if not isinstance(agents, list) or not agents:
        raise ValueError(f"agent pool {path}: expected a non-empty JSON list of agents")
    for i, a in enumerate(agents):
        missing = [k for k in ("name", "description", "kind") if k not in a]
        if missing:
            raise ValueError(f"agent pool {path}: agent {i} has no {missing}")
        if a["kind"] not in ("model", "python"):
            raise ValueError(f"agent pool {path}: agent {i} ({a['name']}): kind must be model or python, got {a['kind']!r}")
        if a["kind"] == "python" and "code" not in a:
            raise ValueError(f"agent pool {path}: agent {i} ({a['name']}): a python agent needs 'code'")
    return agents


def run_tool_agent(agent: dict[str, Any], text: str, timeout_s: float = 5.0) -> str:
    """A `python` agent's answer to a task: its `code` run in the sandbox with the task's text in `TASK`; what it
    prints, stripped ("" when it fails or runs past `timeout_s`)."""
    result = run_python(f"TASK = {text!r}\n{agent['code']}", timeout_s=agent.get("timeout_s", timeout_s),
                        max_output_chars=200)
    return result.output.strip() if result.ok else ""


def load_memory(path: str | Path | None) -> RouterMemory:
    if path is None:
        return RouterMemory()
    data = json.loads(Path(path).read_text())
    return RouterMemory(tuple(MemoryEntry(**e) for e in data["entries"]), int(data["version"]))


@register("env", "monoscale")
class AgentRouterEnv(Env):
    runs_model_code = True  # its Python tool runs model-written code: in the sandbox (rl.tools)

    def __init__(self, pool: str, memory: str | None = None, judge: str = "exact", timeout_s: float = 5.0,
                 max_new_tokens: int = 64):
        if judge not in ANSWER_MATCHES:
            raise ValueError(f"rollout.env_params.judge: one of {', '.join(ANSWER_MATCHES)}, got {judge!r}")
        self.agents = {a["name"]: a for a in load_pool(pool)}
        self.cards = [AgentCard(a["name"], a["description"]) for a in self.agents.values()]
        self.memory = load_memory(memory)
        self.judge, self.timeout_s, self.max_new_tokens = judge, timeout_s, max_new_tokens

    def _prompt(self) -> str:
        sub = self.subtasks[self.turn]
        return router_prompt(Task(f"sub{self.turn}", sub.get("kind", ""), sub["text"]), self.memory, self.cards)

    def reset(self, prompt: str, row: dict[str, Any], seats: Any) -> str:
        self.seats, self.turn = seats, 0
        self.subtasks = row.get("subtasks") or [{"text": prompt, "kind": row.get("kind", ""), "answer": row.get("answer")}]
        return self._prompt()

    def _run(self, agent: dict[str, Any], text: str) -> str:
        if agent["kind"] == "python":
            return run_tool_agent(agent, text, self.timeout_s)
        return self.seats.ask(f"{agent.get('system_prompt', '')}\n{text}".strip(), seat=agent.get("seat", "frozen"),
                              max_new_tokens=self.max_new_tokens).strip()

    def step(self, action: str) -> EnvStep:
        sub = self.subtasks[self.turn]
        name = first_agent_named(action, list(self.agents))
        said = self._run(self.agents[name], sub["text"]) if name else ""
        truth = str(sub.get("answer", "")).strip()
        ok = answer_matches(said, truth, self.judge)
        self.turn += 1
        done = self.turn >= len(self.subtasks)
        return EnvStep(observation=None if done else "\n" + self._prompt(), reward=float(ok), done=done,
                       step_type="route", info={"agent": name, "answer": said})

register_alias("env", "agent_router", "monoscale")
