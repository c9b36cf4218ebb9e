"""Agent program: a calculator agent written outside looprl, speaking plain HTTP to the rollout engines'
OpenAI-compatible endpoint (any OpenAI client works the same way: it reads OPENAI_BASE_URL).
Recipe: `rollout.agent: recipes/extending/agent.py` with `reward.functions: [{name: env_return}]`.

Each turn it asks the policy (`/chat/completions`); a reply holding `\\boxed{n}` is its answer (reward 1 when n is
the row's answer), any other reply is read as an arithmetic expression, which it computes itself and returns as
a `tool` message (`=result`, or `?` when the reply is not arithmetic). At the end it POSTs the reward to
LOOPRL_REWARD_URL. It imports nothing of looprl: the endpoint records the tokens it serves, and looprl trains on
them. Environment: OPENAI_BASE_URL, LOOPRL_PROMPT, LOOPRL_ROW (JSON), LOOPRL_REWARD_URL; AGENT_TURNS (default 3).
"""

import ast
import json
import operator
import os
import re
import urllib.request

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg}


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def calculate(expression: str) -> str:
    """The value of `+ - * /` arithmetic on numbers, or `?`: the policy's text is parsed, never executed."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")
    try:
        result = value(ast.parse(expression.strip().rstrip("="), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "?"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def main() -> None:
    base, row = os.environ["OPENAI_BASE_URL"], json.loads(os.environ["LOOPRL_ROW"])
    messages = [{"role": "user", "content": os.environ["LOOPRL_PROMPT"]}]
    reward = 0.0
    for _ in range(int(os.environ.get("AGENT_TURNS", "3"))):
        reply = post(f"{base}/chat/completions", {"model": "policy", "messages": messages, "max_tokens": 24})
        content = reply["choices"][0]["message"]["content"] or ""
        messages.append({"role": "assistant", "content": content})
        boxed = re.search(r"\\boxed\{([^}]*)\}", content)
        if boxed:
            reward = float(boxed.group(1).strip() == str(row.get("answer", "")).strip())
            break
        messages.append({"role": "tool", "content": f"={calculate(content)}\n"})
    post(os.environ["LOOPRL_REWARD_URL"], {"reward": reward})


if __name__ == "__main__":
    main()
