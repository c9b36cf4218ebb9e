"""Agentic Proposing at tiny scale (a labelled synthetic harness): arithmetic skills composed into problems.

`data.synthetic.task: agentic_proposing` writes, from the skill library `recipes/skills/arithmetic.jsonl`:

* SFT rows that teach one tiny model three roles (the run then serves it as the proposer policy and as frozen
  judges, as `recipes/agentic_proposer_tiny.yaml` does):
  - **proposer**: expert Draft -> Check -> Refine -> Finalize trajectories for a seed ("Skills: add mul"),
    with the tools' outputs as the environment would print them. Like any imitation data they are imperfect,
    which leaves RL something to fix: a share skips the tools and states a guessed answer, a share drops one
    of the seed's skills, a share does not use the tool's output (`styles`);
  - **solver**: "Solve: <problem>" -> the value after each skill, then `\\boxed{value}` (the prober);
  - **verifier**: "Verify: <problem> = <answer>" -> the values, then yes or no (a judge of the ensemble).
* RL and held-out rows: seeds of 2-3 skills; `answer` holds the seed (its skills and their operators, which
  the symbolic verifier checks), `category` the curriculum's category (the first skill's).
* `solver_eval`: held-out problems with answers, for evaluating solvers trained on proposed problems.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rl.methods.agentic_proposing.core import Skill, compose, load_skills
from rl.registry import register, register_alias
from rl.tasks import write_splits

SKILLS_PATH = Path(__file__).resolve().parents[3] / "recipes" / "skills" / "arithmetic.jsonl"
STYLES = {"expert": 0.55, "no_tool": 0.2, "drop_skill": 0.1, "unused_tool": 0.15}
TOKENS = ["Skills: ", "<python>", "</python>", "<out>", "</out>", "<check>", "</check>", "<think>", "</think>",
          "<final>", "</final>", "Problem: ", " Answer: ", "Solve: ", "Verify: ", "\\boxed{", " yes", " no",
          "answer ", "ok", "error", "malformed"]


def seed_prompt(skills: list[Skill]) -> str:
    return "Skills: " + " ".join(s.name for s in skills) + "\n"


def solver_prompt(problem: str) -> str:
    return f"Solve: {problem}\n"


def verifier_prompt(problem: str, answer: str) -> str:
    return f"Verify: {problem} = {answer}\n"


def trajectory(skills: list[Skill], rng: random.Random, style: str) -> tuple[str, str]:
    """(problem, SFT target) of one proposer episode in `style`."""
    used = list(skills)
    if style == "drop_skill" and len(used) > 1:
        used.pop(rng.randrange(len(used)))
    problem, values = compose(used, rng)
    value = values[-1]
    guess = value if rng.random() < 0.3 else value + rng.choice([-3, -2, -1, 1, 2, 3, 5, 10])
    if style == "no_tool":
        return problem, f"<think>answer {guess}</think><final>Problem: {problem} Answer: {guess}</final>"
    tool = f"<python>{problem}</python><out>{value}</out>\n"
    if style == "unused_tool":
        return problem, f"{tool}<final>Problem: {problem} Answer: {guess}</final>"
    return problem, (f"{tool}<check>{problem}={value}</check><out>ok</out>\n<think>answer {value}</think>"
                     f"<final>Problem: {problem} Answer: {value}</final>")


def _seed(library: dict[str, Skill], rng: random.Random) -> list[Skill]:
    names = list(library)
    return [library[n] for n in rng.sample(names, rng.choice([2, 3]))]


def _seed_row(skills: list[Skill]) -> dict[str, Any]:
    return {"prompt": seed_prompt(skills), "category": skills[0].category,
            "answer": {"skills": [s.name for s in skills], "operators": [s.operator for s in skills]}}


def write_proposer_task(out_dir: str | Path, *, num_sft: int = 6000, num_train: int = 2000, num_eval: int = 64,
                        num_solver_eval: int = 200, seed: int = 1234, skills_path: str | Path = SKILLS_PATH,
                        role_shares: tuple[float, float, float] = (0.4, 0.35, 0.25)) -> dict[str, str]:
    """Write the splits (see the module docstring); `role_shares`: proposer, solver, verifier SFT rows."""
    library = load_skills(skills_path)
    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sft = []
    styles, weights = list(STYLES), list(STYLES.values())
    for _ in range(num_sft):
        role = rng.choices(["proposer", "solver", "verifier"], weights=role_shares)[0]
        skills = _seed(library, rng)
        if role == "proposer":
            style = rng.choices(styles, weights=weights)[0]
            _, target = trajectory(skills, rng, style)
            sft.append({"prompt": seed_prompt(skills), "target": target, "role": role, "style": style})
            continue
        problem, values = compose(skills, rng)
        worked = " ".join(str(v) for v in values)
        if role == "solver":
            sft.append({"prompt": solver_prompt(problem), "target": f"{worked} \\boxed{{{values[-1]}}}", "role": role})
        else:
            right = rng.random() < 0.5
            stated = values[-1] if right else values[-1] + rng.choice([-3, -2, -1, 1, 2, 3, 5, 10])
            sft.append({"prompt": verifier_prompt(problem, str(stated)), "target": f"{worked} {'yes' if right else 'no'}",
                        "role": role})
    splits = {"sft": sft,
              "train": [_seed_row(_seed(library, rng)) for _ in range(num_train)],
              "eval": [_seed_row(_seed(library, rng)) for _ in range(num_eval)],
              "solver_eval": []}
    for _ in range(num_solver_eval):
        problem, values = compose(_seed(library, rng), rng)
        splits["solver_eval"].append({"prompt": solver_prompt(problem), "answer": str(values[-1])})
    return write_splits(out, splits, prefix="proposer_")


def harness_tokens(skills_path: str | Path = SKILLS_PATH) -> list[str]:
    """The harness's fixed phrases, one token each of the tiny tokenizer (`model.tiny.task_tokens`)."""
    return [*TOKENS, *(f"{name} " for name in load_skills(skills_path)), *load_skills(skills_path)]


@register("task", "agentic_proposing")
def agentic_proposer_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float, seed: int,
                          **_: Any) -> dict[str, str]:
    """`data.synthetic`: `num_train` rows, `sft_fraction` of them SFT rows (all roles), the rest RL seeds."""
    num_sft = int(num_train * sft_fraction)
    return write_proposer_task(out_dir, num_sft=num_sft, num_train=num_train - num_sft, num_eval=num_eval, seed=seed)


agentic_proposer_task.added_tokens = harness_tokens()  # read by the model stage (model.tiny.task_tokens)

register_alias("task", "agentic_proposer", "agentic_proposing")
