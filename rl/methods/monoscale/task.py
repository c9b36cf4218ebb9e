"""MonoScale's router at tiny scale (a labelled synthetic harness): SFT rows that teach a tiny model made in code
to route a task to an agent by reading the agent cards and the router memory (`rl.methods.monoscale.core.router_prompt`).

The teacher (`teacher_route`) is how the router is meant to read its context: a "use AGENT for TYPE" entry for
the task's type wins (the newest); an "avoid" entry excludes that agent; otherwise the newest card that claims
the type, the cold start of a router meeting new agents; otherwise the first agent shown. An agent marked
registered-but-not-preferred is chosen only through a "use" entry. Pools, memories and markings are drawn at
random, so the model has to read its context, not remember pools.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rl.methods.monoscale.core import NOT_PREFERRED, AgentCard, MemoryEntry, RouterMemory, Task, router_prompt
from rl.registry import register, register_alias

KINDS = [f"type{i}" for i in range(6)]
AGENTS = [f"agent{i}" for i in range(10)]


def teacher_route(task: Task, memory: RouterMemory, cards: list[AgentCard]) -> str:
    names = {c.name for c in cards}
    use = [e.agent for e in memory.entries if e.when == task.kind and e.prefer and e.agent in names]
    if use:
        return use[-1]
    avoid = {e.agent for e in memory.entries if e.when == task.kind and not e.prefer}
    open_cards = [c for c in cards if c.name not in avoid and NOT_PREFERRED not in c.description]
    claims = [c for c in open_cards if task.kind in c.description.split()]
    return claims[-1].name if claims else (open_cards or cards)[0].name


def random_context(rng: random.Random) -> tuple[list[AgentCard], RouterMemory]:
    """A pool of 3-10 agents (three generalists, then specialists claiming one or two types), some marked
    not preferred, and a memory of up to 8 use/avoid entries about them."""
    size = rng.randint(3, 10)
    cards = []
    for i in range(size):
        if i < 3:
            cards.append(AgentCard(AGENTS[i], "a generalist agent"))
            continue
        claimed = rng.sample(KINDS, rng.choice([1, 2]))
        desc = f"a specialist for {' and '.join(claimed)}"
        if rng.random() < 0.3:
            desc += NOT_PREFERRED
        cards.append(AgentCard(AGENTS[i], desc))
    entries = []
    for _ in range(rng.randint(0, 8)):
        entries.append(MemoryEntry(rng.choice(cards).name, rng.choice(KINDS), prefer=rng.random() < 0.7,
                                   reliability=round(rng.uniform(0.1, 0.95), 2)))
    memory = RouterMemory().extended(entries) if entries else RouterMemory()
    return cards, memory


def task_text(rng: random.Random) -> str:
    """A task's text as the router sees it: empty (a type only) or a short arithmetic task (`typed_arithmetic_rows`)."""
    return rng.choice(["", f"{rng.randint(2, 60)}{rng.choice('+*/-%^')}{rng.choice([2, 4, 5, 8])}"])


def router_rows(num: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        cards, memory = random_context(rng)
        task = Task("t", rng.choice(KINDS), task_text(rng))
        rows.append({"prompt": router_prompt(task, memory, cards), "target": teacher_route(task, memory, cards)})
    return rows


def harness_tokens() -> list[str]:
    phrases = ["Agents:\n", "Memory:\n", "\nAgent:", "Task (", "): ", "- ", ": a generalist agent",
               ": a specialist for ", " and ", NOT_PREFERRED, "use ", "avoid ", " for ", "; reliability ",
               "; fails when ", " tasks (", "% success)", "(empty)", *KINDS, *AGENTS]
    return [p for p in dict.fromkeys(phrases) if len(p) > 1]


TYPED_TASKS = {"type0": "sum", "type1": "product", "type2": "ratio", "type3": "difference", "type4": "square",
               "type5": "remainder"}


def typed_arithmetic_rows(num: int, seed: int) -> list[dict[str, Any]]:
    """Tasks for a pool of real agents: {prompt, answer, kind}, the six types in turn: a sum `a+b` (type0), a
    product `a*b` (type1), a ratio `a/b` (type2, its answer the fraction `\\frac{a}{b}`), a difference `a-b`
    (type3), a square `a^2` (type4) and a remainder `a%b` (type5)."""
    rng, rows = random.Random(seed), []
    for i in range(num):
        a, b = rng.randint(2, 60), rng.choice([2, 4, 5, 8])
        kind = f"type{i % 6}"
        text, answer = {"type0": (f"{a}+{b}", a + b), "type1": (f"{a}*{b}", a * b),
                        "type2": (f"{a}/{b}", f"\\frac{{{a}}}{{{b}}}"), "type3": (f"{a}-{b}", a - b),
                        "type4": (f"{a}^2", a * a), "type5": (f"{a}%{b}", a % b)}[kind]
        rows.append({"prompt": text, "answer": str(answer), "kind": kind})
    return rows


@register("task", "monoscale")
def monoscale_router_task(out_dir: str | Path, *, num_train: int, num_eval: int, seed: int, **_: Any) -> dict[str, str]:
    """`data.synthetic`: `num_train` SFT rows that teach the router; the train and eval splits are typed
    arithmetic tasks (`typed_arithmetic_rows`: 200 and 60) for a pool of real agents (the `monoscale` stage with
    `agents`: replay and familiarization tasks, and the test set); `num_eval` held-out router rows (`router_eval`,
    the router's fidelity)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in (("sft", router_rows(num_train, seed)), ("router_eval", router_rows(num_eval, seed + 1))):
        path = out / f"monoscale_{split}.jsonl"
        path.write_text("".join(json.dumps({**r, "answer": r["target"]}) + "\n" for r in rows))
        paths[split] = str(path)
    for split, rows in (("train", typed_arithmetic_rows(200, seed + 2)), ("eval", typed_arithmetic_rows(60, seed + 3))):
        path = out / f"monoscale_tasks_{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[split] = str(path)
    return paths


monoscale_router_task.added_tokens = harness_tokens()  # read by the model stage (model.tiny.task_tokens)

register_alias("task", "monoscale_router", "monoscale")
