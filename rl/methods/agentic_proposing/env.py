"""The Agentic Proposing environment (`rollout.env: agentic_proposing`): a proposer composes a new problem
from the skills its prompt names in a Draft -> Check -> Refine -> Finalize loop with tools.

Each turn is one block (rollout.stop should end a turn at its closing tag):

* `<python>code</python>`: sandboxed Python (`rl.tools.run_python`: its own process, CPU time and memory
  limits, no network). An expression is printed; a program prints what it prints. The output comes back as
  `<out>...</out>` (an observation: masked from the loss). Step type `tool`: +1 when it ran without error
  and its output was used, 0 when it errored, hung or was not used. Used: a value it printed (the whole output,
  or any number in it) is equivalent (math-verify: `0.75`, `3/4`, `\\frac{3}{4}`) to a result a later block
  states (a check's answer, a reflection's value, the Finalize answer).
* `<check>expression = answer</check>`: the `check_answer` tool, whether `answer` equals `expression`:
  `<out>ok</out>` or `<out>no</out>`. `check: arithmetic` evaluates integer arithmetic in process (the arithmetic
  skills); `check: sympy` runs `sympy.simplify(expression - answer) == 0` in the Python sandbox (any SymPy
  expression, about a second a call). Step type `tool`: +1 when it ran, checked what no earlier check of the
  episode checked, and its answer was used (a later block states an equivalent result) [RECONSTRUCTION: the
  paper rewards a tool call that executes and is used; a repeated check adds nothing]; 0 otherwise.
* `<think>...</think>`: a reflection (step type `reflection`): 1 when it agrees with the tool outputs (the value it
  states, its last `\\boxed{}` or else its last number, is equivalent to a value the latest `<python>` output
  printed), else 0 [RECONSTRUCTION: the paper scores a reflection's coherence by a judge or by agreement with the
  tool outputs; this is the latter].
* `<final>Problem: ... Answer: ...</final>`: ends the episode (step type `final`, reward 0); the reward
  function (`rl.methods.agentic_proposing.reward.agentic_proposer`) reads it from the response.
* anything else is a malformed call: -1 (step type `tool`), answered `<out>malformed</out>`.

Validity and difficulty are trajectory rewards (the verifier ensemble and the prober are models, called in
batches by the reward function); an invalid problem's step rewards are zeroed by the `mgpo` estimator
(`valid`). Turn and token budgets per episode: `rollout.max_turns`, `rollout.max_episode_tokens`.
"""

from __future__ import annotations

from typing import Any

from rl.answers import equivalent, numbers_in, stated_answer
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
        self.checks: dict[int, str] = {}  # turn -> the answer a check that ran checked (the first of its kind)
        self.checked: set[tuple[str, str]] = set()  # (expression, answer) of every check that ran
        self.rewards: list[float] = []
        self.last_output: str | None = None
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
            return self._python(action, body)
        if tag == "check":
            return self._check(action, body)
        if tag == "think":
            said = stated_answer(body)
            coherent = self.last_output is not None and any(equivalent(said, v) for v in printed(self.last_output))
            return self._turn(action, float(coherent), "reflection")
        return self._turn(action, 0.0, "final", done=True)

    def _python(self, action: str, body: str) -> EnvStep:
        code = body if ("\n" in body or "print(" in body) else f"print({body})"
        result = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            max_output_chars=self.max_output_chars)
        if not result.ok:
            return self._turn(action, 0.0, "tool", "<out>error</out>\n", failed=True, tool_error=result.error)
        out = result.output.strip()
        self.outputs[len(self.blocks)] = out
        self.last_output = out
        return self._turn(action, 1.0, "tool", f"<out>{out}</out>\n")

    def _check(self, action: str, body: str) -> EnvStep:
        if "=" not in body:
            return self._turn(action, -1.0, "tool", "<out>malformed</out>\n", malformed=True)
        problem, answer = (s.strip() for s in body.rsplit("=", 1))
        if self.check == "arithmetic":
            value = evaluate(problem, self.max_value)
            verdict = "ok" if value is not None and equivalent(answer, str(value)) else "no"
        else:
            code = ("import sympy\n"
                    f"d = sympy.simplify(sympy.sympify({problem!r}) - sympy.sympify({answer!r}))\n"
                    "print('ok' if d == 0 else 'no')")
            result = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_output_chars=8)
            if not result.ok or result.output.strip() not in ("ok", "no"):
                return self._turn(action, 0.0, "tool", "<out>error</out>\n", failed=True, tool_error=result.error)
            verdict = result.output.strip()
        key = ("".join(problem.split()), "".join(answer.split()))
        repeated = key in self.checked
        self.checked.add(key)
        if not repeated:
            self.checks[len(self.blocks)] = answer
        return self._turn(action, 0.0 if repeated else 1.0, "tool", f"<out>{verdict}</out>\n", repeated=repeated)

    def finish(self) -> list[float]:
        """A `<python>` output or a check that no later block uses earns nothing (rl/methods/agentic_proposing/README.md:
        +1 when executed without error and used): used means a later block states a result equivalent to a value
        the output printed, or to the answer the check checked (a check's answer, the Finalize answer, a
        reflection's value)."""
        rewards = list(self.rewards)
        for turn, values in [*((t, printed(o)) for t, o in self.outputs.items()),
                             *((t, [a]) for t, a in self.checks.items())]:
            later = [r for b in self.blocks[turn + 1:] for r in stated_results(b)]
            if not any(equivalent(v, r) for v in values for r in later):
                rewards[turn] = 0.0
        return rewards


def printed(output: str) -> list[str]:
    """The values a tool output printed: the whole output and every number in it."""
    return [output.strip(), *numbers_in(output)]


def stated_results(action: str) -> list[str]:
    """The results a block states: a check's answer, the Finalize answer, a reflection's value."""
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
        said = stated_answer(body)
        return [said] if said is not None else []
    return []

register_alias("env", "agentic_proposer", "agentic_proposing")
