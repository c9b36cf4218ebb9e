"""The Agentic Proposing environment (`rollout.env: agentic_proposing`): a proposer composes a new problem
from the skills its prompt names in a Draft -> Check -> Refine -> Finalize loop with tools.

Each turn is one block (rollout.stop should end a turn at its closing tag):

* `<python>code</python>`: sandboxed Python (`rl.tools.run_python`: its own process, CPU time and memory
  limits, no network). An expression is printed; a program prints what it prints. The output comes back as
  `<out>...</out>` (an observation: masked from the loss). Step type `tool`: +1 when it ran without error
  and its output was used (it appears in a later block), 0 when it errored, hung or was not used.
* `<check>expression = answer</check>`: the `check_answer` tool, SymPy's verdict on whether `answer` equals
  `expression`: `<out>ok</out>` or `<out>no</out>`. `check: arithmetic` evaluates integer arithmetic in process
  (the arithmetic skills); `check: sympy` runs `sympy.simplify(expression - answer) == 0` in the Python sandbox
  (any SymPy expression, about a second a call). Step type `tool`: +1 when it ran, 0 when the sandbox failed.
* `<think>...</think>`: a reflection (step type `reflection`): 1 when it agrees with the tool outputs (the
  last integer it states is the latest `<python>` output), else 0 [RECONSTRUCTION: the paper scores a
  reflection's coherence by a judge or by agreement with the tool outputs; this is the latter].
* `<final>Problem: ... Answer: ...</final>`: ends the episode (step type `final`, reward 0); the reward
  function (`rl.methods.agentic_proposing.reward.agentic_proposer`) reads it from the response.
* anything else is a malformed call: -1 (step type `tool`), answered `<out>malformed</out>`.

Validity and difficulty are trajectory rewards (the verifier ensemble and the prober are models, called in
batches by the reward function); an invalid problem's step rewards are zeroed by the `mgpo` estimator
(`valid`). Turn and token budgets per episode: `rollout.max_turns`, `rollout.max_episode_tokens`.
"""

from __future__ import annotations

import re
from typing import Any

from rl.env import Env, EnvStep
from rl.methods.agentic_proposing.core import evaluate, parse_block, parse_final
from rl.registry import register, register_alias
from rl.tools import run_python

STOP = ["</python>", "</check>", "</think>", "</final>"]  # the turn-ending tags (rollout.stop)


@register("env", "agentic_proposing")
class AgenticProposerEnv(Env):
    """One proposer episode; `timeout_s` / `memory_mb` bound each Python call, `max_output_chars` its output,
    `max_value` the values the check tool accepts."""

    runs_model_code = True  # its Python tool runs model-written code: in the sandbox (rl.tools)

    def __init__(self, timeout_s: float = 2.0, memory_mb: int = 256, max_output_chars: int = 80,
                 max_value: int = 10**6, check: str = "arithmetic"):
        if check not in ("arithmetic", "sympy"):
            raise ValueError(f"rollout.env_params.check: arithmetic or sympy, got {check!r}")
        self.timeout_s, self.memory_mb, self.max_output_chars, self.max_value = (timeout_s, memory_mb,
                                                                                  max_output_chars, max_value)
        self.check = check

    def reset(self, prompt: str, row: dict[str, Any], seats: Any) -> str:
        self.blocks: list[str] = []  # each turn's text
        self.outputs: dict[int, str] = {}  # turn -> output of a <python> call that ran
        self.rewards: list[float] = []
        self.last_value: str | None = None
        return prompt

    def _turn(self, action: str, reward: float, step_type: str, observation: str | None = None,
              done: bool = False, failed: bool = False, **info: Any) -> EnvStep:
        self.blocks.append(action)
        self.rewards.append(reward)
        return EnvStep(observation=observation, reward=reward, done=done, failed=failed, step_type=step_type,
                       info=info)

    def step(self, action: str) -> EnvStep:
        block = parse_block(action)
        if block is None:
            return self._turn(action, -1.0, "tool", "<out>malformed</out>\n", malformed=True)
        tag, body = block
        if tag == "python":
            code = body if ("\n" in body or "print(" in body) else f"print({body})"
            result = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                max_output_chars=self.max_output_chars)
            if not result.ok:
                return self._turn(action, 0.0, "tool", "<out>error</out>\n", failed=True, tool_error=result.error)
            out = result.output.strip()
            self.outputs[len(self.blocks)] = out
            self.last_value = out
            return self._turn(action, 1.0, "tool", f"<out>{out}</out>\n")
        if tag == "check":
            if "=" not in body:
                return self._turn(action, -1.0, "tool", "<out>malformed</out>\n", malformed=True)
            problem, answer = (s.strip() for s in body.rsplit("=", 1))
            if self.check == "arithmetic":
                value = evaluate(problem, self.max_value)
                ok = value is not None and answer.lstrip("-").isdigit() and int(answer) == value
                return self._turn(action, 1.0, "tool", f"<out>{'ok' if ok else 'no'}</out>\n")
            code = ("import sympy\n"
                    f"d = sympy.simplify(sympy.sympify({problem!r}) - sympy.sympify({answer!r}))\n"
                    "print('ok' if d == 0 else 'no')")
            result = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_output_chars=8)
            if not result.ok or result.output.strip() not in ("ok", "no"):
                return self._turn(action, 0.0, "tool", "<out>error</out>\n", failed=True, tool_error=result.error)
            return self._turn(action, 1.0, "tool", f"<out>{result.output.strip()}</out>\n")
        if tag == "think":
            said = re.findall(r"-?\d+", body)
            coherent = self.last_value is not None and bool(said) and said[-1] == self.last_value
            return self._turn(action, float(coherent), "reflection")
        return self._turn(action, 0.0, "final", done=True)

    def finish(self) -> list[float]:
        """A `<python>` output that no later block uses earns nothing (rl/methods/agentic_proposing/README.md: +1 when executed without error
        and its output was used): used means a later block states it as a result (a check's answer, the
        Finalize answer, a reflection's last integer)."""
        rewards = list(self.rewards)
        for turn, out in self.outputs.items():
            if out not in {r for b in self.blocks[turn + 1:] for r in stated_results(b)}:
                rewards[turn] = 0.0
        return rewards


def stated_results(action: str) -> list[str]:
    """The results a block states: a check's answer, the Finalize answer, a reflection's last integer."""
    block = parse_block(action)
    if block is None:
        return []
    tag, body = block
    if tag == "check" and "=" in body:
        return [body.rsplit("=", 1)[1].strip()]
    if tag == "final":
        final = parse_final(action)
        return [final[1]] if final else []
    if tag == "think":
        said = re.findall(r"-?\d+", body)
        return said[-1:]
    return []

register_alias("env", "agentic_proposer", "agentic_proposing")
