"""Agentic Proposing (Jiao et al. 2026, arXiv 2602.03279): the algorithm core, free of Ray and of models.

A proposer composes atomic problem-construction *skills* into a new problem in a Draft -> Check -> Refine ->
Finalize loop with tools (`rl.methods.agentic_proposing.env`); a verifier ensemble decides whether the problem is valid
and a solver prober estimates how hard it is (`rl.methods.agentic_proposing.reward`); MGPO (`rl.advantages.compute_mgpo_advantages`)
trains on the trajectory reward and the per-step rewards. Here:

* the skill library as data (`load_skills`): one JSON object per line with `name`, `category`, `template`
  (for a composable skill, `{x}` the problem so far and `{a}` its parameter; otherwise the skill in words),
  `params` (each parameter's integer range), `operator` (what the skill adds to a problem, which the
  symbolic verifier looks for), `checker` (`sympy`) and `description` (what the real-scale seeds show);
* `compose`: a problem drawn from a chain of skills (the expert trajectories of the SFT data);
* `sympy_check`: the symbolic member of the verifier ensemble (well-posed, uses the seed's skills, the stated
  answer is the problem's value);
* `parse_final` / `parse_block`: the proposer's Finalize block and its tool and reflection blocks;
* `majority_valid`: the ensemble's vote;
* `CurriculumSampler`: the prompt sampler that draws skill categories with probability inversely
  proportional to their validated proficiency (rl/methods/agentic_proposing/README.md item 6).

What the paper states and what is reconstructed is marked per function ([RECONSTRUCTION]: rl/methods/agentic_proposing/README.md).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.answers import equivalent
from rl.registry import register

SKILL_FIELDS = ("name", "category", "template")  # required; params, operator, checker, description optional
CHECKERS = ("sympy",)
# the problems the arithmetic skills build: integers, + - * % and parentheses (anything else is refused
# before sympy sees it, so a proposal cannot make the checker run code or build huge numbers)
EXPRESSION = re.compile(r"^[0-9+\-*%() ]{1,120}$")


@dataclass(frozen=True)
class Skill:
    """An atomic problem-construction skill: applying it to a problem `x` gives `template` with `{x}` and a
    parameter `{a}` drawn from `params["a"]` (an inclusive integer range)."""
    name: str
    category: str
    template: str
    params: dict[str, list[int]] = field(default_factory=dict)
    operator: str = ""
    checker: str = "sympy"
    description: str = ""

    def apply(self, x: str, rng: random.Random) -> str:
        if "{x}" not in self.template:
            raise ValueError(f"skill {self.name!r}: template {self.template!r} has no {{x}}, so it does not compose")
        values = {k: rng.randint(int(lo), int(hi)) for k, (lo, hi) in self.params.items()}
        return self.template.format(x=x, **values)


def load_skills(path: str | Path) -> dict[str, Skill]:
    """The skill library of a JSONL file, by name. A bad line fails with the file, line and key."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"skill library {path} does not exist")
    skills: dict[str, Skill] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not a JSON object ({exc})") from exc
        missing = [k for k in SKILL_FIELDS if k not in row]
        if missing:
            raise ValueError(f"{where}: skill without {missing} (a skill has {list(SKILL_FIELDS)})")
        if row.get("checker", "sympy") not in CHECKERS:
            raise ValueError(f"{where}: checker {row['checker']!r} is not one of {list(CHECKERS)}")
        for k, bounds in row.get("params", {}).items():
            if not (isinstance(bounds, list) and len(bounds) == 2 and all(isinstance(b, int) for b in bounds)
                    and bounds[0] <= bounds[1]):
                raise ValueError(f"{where}: params.{k} must be [low, high] integers, got {bounds!r}")
        if row["name"] in skills:
            raise ValueError(f"{where}: skill {row['name']!r} is defined twice")
        unknown = sorted(set(row) - {*SKILL_FIELDS, "params", "operator", "checker", "description"})
        if unknown:
            raise ValueError(f"{where}: unknown skill keys {unknown}")
        skills[row["name"]] = Skill(**row)
    if not skills:
        raise ValueError(f"skill library {path} has no skills")
    return skills


def compose(skills: list[Skill], rng: random.Random, start: tuple[int, int] = (1, 9)) -> tuple[str, list[int]]:
    """A problem applying `skills` in order to a starting integer (one expert composition), and its value
    after each skill (the worked steps a solver writes)."""
    problem, values = str(rng.randint(*start)), []
    for s in skills:
        problem = s.apply(problem, rng)
        value = evaluate(problem)
        if value is None:
            raise ValueError(f"skill {s.name!r} made {problem!r}, which is not an integer problem")
        values.append(value)
    return problem, values


def evaluate(problem: str, max_abs: int = 10**6) -> int | None:
    """The integer value of an arithmetic problem by SymPy, or None when it is not one: malformed, a
    modulus or division by zero, a non-integer, or a value beyond `max_abs`."""
    import sympy
    if not EXPRESSION.match(problem.strip()) or "**" in problem:  # no powers: no huge numbers to build
        return None
    try:
        value = sympy.sympify(problem.strip(), rational=True)
    except (sympy.SympifyError, SyntaxError, TypeError, ZeroDivisionError, ValueError):
        return None
    if not value.is_Integer or abs(int(value)) > max_abs:  # zoo / nan from a zero modulus are not integers
        return None
    return int(value)


def sympy_check(problem: str, answer: str, operators: list[str] = (), max_abs: int = 10**6) -> bool:
    """The symbolic verifier: the problem is well-posed (SymPy gives it an integer value), uses every
    operator of its seed's skills, and the stated answer is its value."""
    value = evaluate(problem, max_abs)
    if value is None or any(op not in problem for op in operators):
        return False
    return equivalent(answer, str(value))


FINAL = re.compile(r"<final>\s*Problem:\s*(?P<problem>.*?)\s*Answer:\s*(?P<answer>.*?)\s*</final>", re.S)


def parse_final(text: str) -> tuple[str, str] | None:
    """(problem, answer) of the last Finalize block of a proposer's episode, None without one."""
    found = list(FINAL.finditer(text))
    if not found:
        return None
    return found[-1].group("problem").strip(), found[-1].group("answer").strip()


BLOCK = re.compile(r"^\s*<(?P<tag>python|check|think|final)>(?P<body>.*?)</(?P=tag)>\s*$", re.S)


def parse_block(action: str) -> tuple[str, str] | None:
    """(tag, body) of one proposer turn: exactly one `<python>`, `<check>`, `<think>` or `<final>` block;
    None for anything else (a malformed turn)."""
    m = BLOCK.match(action)
    if m is None or "</" in m.group("body") or re.search(r"<(python|check|think|final)>", m.group("body")):
        return None
    return m.group("tag"), m.group("body").strip()


def majority_valid(votes: list[bool]) -> bool:
    """The verifier ensemble's verdict: valid when more than half of the voters say so (a tie is invalid,
    the conservative side of "an invalid problem gets zero reward")."""
    return sum(bool(v) for v in votes) * 2 > len(votes)


@dataclass
class CurriculumSampler:
    """Prompt sampler of the curriculum (rl/methods/agentic_proposing/README.md item 6, rule [RECONSTRUCTION]): each prompt's skill category
    is drawn with probability proportional to `1 / (proficiency + floor)`, then a row of that category
    uniformly. A category's proficiency is the exponential moving average (rate `ema`) of the share of its
    samples the verifiers judged valid (`batch.valid`; without a verdict, reward > 0), starting at `initial`.
    Rows name their category in `metadata_key` (a dataset column the trainer copies into each sample's
    metadata, `data.metadata_columns`). The state (proficiencies and the draw counter) is checkpointed, so a
    resumed run draws the same prompts."""
    categories: list[str]  # each row's category
    seed: int = 0
    floor: float = 0.1
    ema: float = 0.3
    initial: float = 0.5
    metadata_key: str = "category"
    proficiency: dict[str, float] = field(default_factory=dict)
    draws: int = 0

    def __post_init__(self) -> None:
        self.rows_of: dict[str, list[int]] = {}
        for i, c in enumerate(self.categories):
            self.rows_of.setdefault(str(c), []).append(i)
        for c in self.rows_of:
            self.proficiency.setdefault(c, self.initial)

    def probabilities(self) -> dict[str, float]:
        weights = {c: 1.0 / (self.proficiency[c] + self.floor) for c in sorted(self.rows_of)}
        total = sum(weights.values())
        return {c: w / total for c, w in weights.items()}

    def next(self, k: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + self.draws)
        self.draws += 1
        probs = self.probabilities()
        cats = rng.choices(list(probs), weights=list(probs.values()), k=k)
        return [rng.choice(self.rows_of[c]) for c in cats]

    def observe(self, batch: Any) -> dict[str, float]:
        """Update proficiencies from one step's scored batch; returns the metrics to log."""
        valid = batch.valid if batch.valid is not None else batch.rewards > 0
        return self.update([m.get(self.metadata_key) for m in batch.metadata], [bool(v) for v in valid.tolist()])

    def update(self, categories: list[Any], validated: list[bool]) -> dict[str, float]:
        """Update proficiencies from one step's samples' categories and verdicts; returns the metrics to log."""
        seen: dict[str, list[bool]] = {}
        for c, v in zip(categories, validated):
            if c is not None and str(c) in self.proficiency:
                seen.setdefault(str(c), []).append(bool(v))
        for c, vs in seen.items():
            self.proficiency[c] = (1 - self.ema) * self.proficiency[c] + self.ema * (sum(vs) / len(vs))
        out = {f"curriculum/proficiency/{c}": p for c, p in sorted(self.proficiency.items())}
        out.update({f"curriculum/prob/{c}": p for c, p in self.probabilities().items()})
        return out

    def state(self) -> dict[str, Any]:
        return {"draws": self.draws, "proficiency": dict(self.proficiency)}

    def load(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])
        self.proficiency.update({k: float(v) for k, v in state["proficiency"].items()})


def difficulty_band_share(pass_rates: list[float | None], band: tuple[float, float]) -> float:
    """Share of problems in the solvable-but-hard band `lo <= rho <= hi` (None: not probed, outside)."""
    if not pass_rates:
        return 0.0
    return sum(1 for r in pass_rates if r is not None and band[0] <= r <= band[1]) / len(pass_rates)


def pass_rate(answers: list[str | None], truth: str) -> float:
    """The prober's rho: the share of its k sampled answers equivalent to the verified answer (math-verify)."""
    if not answers:
        return 0.0
    return sum(1 for a in answers if equivalent(a, truth)) / len(answers)


@register("sampler", "curriculum")
def curriculum_sampler(rows: list[dict], seed: int, *, category_column: str = "category", floor: float = 0.1,
                       ema: float = 0.3, initial: float = 0.5) -> CurriculumSampler:
    """`trainer.prompt_sampler: {name: curriculum, params: {...}}`: rows name their skill category in
    `category_column`, which must also be in `data.metadata_columns` (so that scored samples carry it)."""
    missing = [i for i, r in enumerate(rows) if r.get(category_column) is None]
    if missing:
        raise ValueError(f"trainer.prompt_sampler curriculum: {len(missing)} training rows have no "
                         f"{category_column!r} column (first: row {missing[0]})")
    return CurriculumSampler([str(r[category_column]) for r in rows], seed, floor=floor, ema=ema, initial=initial,
                             metadata_key=category_column)


PROPOSER_PROMPT = (
    "Propose one new math problem, hard but solvable, that combines these skills:\n{skills}\n"
    "Work in blocks, one per turn: <think>plan or reflect</think>; <python>code</python> runs in a sandbox and "
    "its output comes back as <out>...</out>; <check>expression = answer</check> has SymPy check the equality. "
    "Draft the problem, check its answer with the tools, refine it, then finish with "
    "<final>Problem: ... Answer: ...</final>.")


def write_seeds(skills_path: str | Path, out: str | Path, num: int, *, seed: int = 0, per_seed: tuple[int, int] = (2, 3),
                template: str = PROPOSER_PROMPT) -> str:
    """Write `num` proposer seeds (JSONL: `prompt`, `category`, `answer` = the seed's skills and operators)
    drawing `per_seed` skills each from the library; the category is the first skill's."""
    library = load_skills(skills_path)
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        chosen = [library[n] for n in rng.sample(sorted(library), min(len(library), rng.randint(*per_seed)))]
        lines = "\n".join(f"- {s.name} ({s.category}): {s.description or s.template}" for s in chosen)
        rows.append({"prompt": template.format(skills=lines), "category": chosen[0].category,
                     "answer": {"skills": [s.name for s in chosen], "operators": [s.operator for s in chosen]}})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(out)


if __name__ == "__main__":  # python -m rl.methods.agentic_proposing.core SKILLS.jsonl OUT.jsonl NUM [SEED]
    import sys
    if len(sys.argv) not in (4, 5):
        sys.exit("usage: python -m rl.methods.agentic_proposing.core SKILLS.jsonl OUT.jsonl NUM [SEED]  (writes proposer seeds)")
    print(write_seeds(sys.argv[1], sys.argv[2], int(sys.argv[3]), seed=int(sys.argv[4]) if len(sys.argv) == 5 else 0))
