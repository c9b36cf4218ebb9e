"""The built-in environments (registry kind `env`; the contract, `Env` and `EnvStep`, is `rl.env`): a calculator
and a Python tool, run sandboxed (`rl.tools`)."""

from __future__ import annotations

import re
from typing import Any

from rl.env import Env, EnvStep
from rl.registry import register
from rl.tools import run_python


@register("env", "calculator")
class Calculator(Env):
    """Arithmetic with a calculator tool. Each turn the policy either asks the calculator, writing an
    expression (digits, + - * / and parentheses), answered with `=result` by sandboxed Python
    (`rl.tools.run_python`), or answers with `\\boxed{n}`, which ends the episode with reward 1 when n
    is the row's answer (0 otherwise). Anything else is answered with `?`."""

    EXPRESSION = re.compile(r"^[0-9+\-*/() ]{1,40}$")

    runs_model_code = True  # its Python tool runs model-written code: in the sandbox (rl.tools)

    def __init__(self, timeout_s: float = 2.0, memory_mb: int = 256):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.calls = 0

    def reset(self, prompt: str, row: dict[str, Any], seats: Any) -> str:
        self.answer = str(row.get("answer", "")).strip()
        return prompt

    def step(self, action: str) -> EnvStep:
        boxed = re.search(r"\\boxed\{([^}]*)\}", action)
        if boxed:
            correct = boxed.group(1).strip() == self.answer
            return EnvStep(reward=1.0 if correct else 0.0, done=True, info={"answered": True})
        expr = action.strip().rstrip("=")
        if not self.EXPRESSION.match(expr):
            return EnvStep(observation="?\n")
        self.calls += 1
        result = run_python(f"print({expr})", timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            max_output_chars=40)
        text = result.output.strip() if result.ok else "error"
        return EnvStep(observation=f"={text}\n", failed=not result.ok, info={"tool_error": result.error})
