"""The Agentic Proposing trajectory reward: a verifier ensemble's validity and a solver prober's difficulty.

`R_traj = V * (r_fmt * 1[Finalize well formed] + r_valid + 1[rho > 0] * D(rho))` (rl/methods/agentic_proposing/README.md, [RECONSTRUCTION]
of the combination; the validity gate and "bonus only when solvable" are from the paper), where

* V is the majority vote of the verifiers (`verifiers`): `sympy` (`rl.methods.agentic_proposing.core.sympy_check`: an arithmetic
  problem is well-posed, uses the seed's skills, and the stated answer is its value), `answer_form` (the
  stated answer is a closed-form value math-verify parses: the code check of a natural-language problem) and any number of judge groups (frozen engine actors of `reward.judges`, asked
  `verifier_template` and read by their final yes/no);
* rho is the prober's pass rate: the judge group `prober` (a frozen solver) samples `k` answers to each valid
  problem (`solver_template`, at its own sampling settings) and rho is the share equivalent to the verified
  answer under math-verify (`match`: `equivalent` reads the solver's last `\\boxed{}`, else its last number;
  `math_verify` requires the `\\boxed{}`, as the `math` reward does); D is `1 - rho` (`difficulty: linear`) or
  `1[lo <= rho <= hi]` (`band`).

The format bonus `r_fmt` goes to a Finalize answer math-verify reads as a closed-form value (`7`, `\\frac{1}{2}`,
`0.75`, `\\sqrt{2}`), not to integers alone.

It returns `{"score", "valid", ...}`: `valid` becomes `batch.valid`, which the `mgpo` estimator uses to zero
an invalid trajectory's step rewards. The seed (ground truth) of each prompt is a dict naming the skills'
`operators` the problem must use.
"""

from __future__ import annotations

import re
from typing import Any

from rl.answers import parse_value, stated_answer
from rl.methods.agentic_proposing.core import (
    majority_valid,
    parse_final,
    pass_rate,
    sympy_check,
)
from rl.registry import lookup, register, register_alias
from rl.reward import uses_judges

VERIFIER_TEMPLATE = ("Is this math problem well-posed, and is the stated answer its correct value? Work it out, "
                     "then end with 'Verdict: yes' or 'Verdict: no'.\nProblem: {problem}\nStated answer: {answer}\n")
SOLVER_TEMPLATE = "Solve the problem. Put the final answer in \\boxed{{}}.\nProblem: {problem}\n"
CHECKS = ("sympy", "answer_form")  # the verifiers that are code, not judges
_VERDICT = re.compile(r"verdict\W*(yes|no)\b", re.IGNORECASE)
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def mgpo_trajectory_reward(valid: bool, format_ok: bool, pass_rate: float, *, r_fmt: float = 0.1,
                           r_valid: float = 1.0, difficulty: str = "linear",
                           band: tuple[float, float] = (0.125, 0.875)) -> float:
    """MGPO trajectory reward `V * (r_fmt*1[fmt] + r_valid + 1[rho > 0] * D(rho))` [RECONSTRUCTION, rl/methods/agentic_proposing/README.md].

    `pass_rate` is the prober's pass@k estimate rho of the proposed problem; `D(rho) = 1 - rho`
    (`difficulty="linear"`) or `1[lo <= rho <= hi]` (`"band"`). An invalid problem gets 0, and the
    difficulty bonus is paid only for a solvable one (rho > 0).
    """
    if not valid:
        return 0.0
    if difficulty == "linear":
        bonus = 1.0 - pass_rate
    elif difficulty == "band":
        bonus = float(band[0] <= pass_rate <= band[1])
    else:
        raise ValueError(f"difficulty must be linear or band, got {difficulty!r}")
    return (r_fmt if format_ok else 0.0) + r_valid + (bonus if pass_rate > 0 else 0.0)


def answer_parses(answer: str) -> bool:
    """The `answer_form` check: math-verify reads a closed-form value (no free symbols) in the stated answer."""
    parsed = parse_value(answer)
    return bool(parsed) and not getattr(parsed[0], "free_symbols", {None})


def final_verdict(text: str) -> bool | None:
    """A verifier's verdict: the last `Verdict: yes|no` (markdown allowed), else its last yes/no word;
    None when it gave neither."""
    found = _VERDICT.findall(text) or _YES_NO.findall(text)
    return found[-1].lower() == "yes" if found else None


def pass_rates(prober: Any, finals: dict[int, tuple[str, str]], k: int, solver_template: str, match: str,
               seed: int) -> dict[int, float]:
    """The prober's pass@k estimate rho of each valid problem: `k` sampled solutions, each right when its stated
    answer (`equivalent`: last `\\boxed{}`, else last number) or its boxed answer (`math_verify`) is equivalent to
    the problem's stated answer."""
    order = list(finals)
    answers = prober.generate([solver_template.format(problem=finals[i][0]) for i in order for _ in range(k)],
                              seed=seed)
    rho = {}
    for j, i in enumerate(order):
        said = answers[j * k:(j + 1) * k]
        if match == "equivalent":
            rho[i] = pass_rate([stated_answer(a) for a in said], finals[i][1])
        else:  # the built-in `math` reward (math-verify), looked up by name: rewards/ lies above this layer
            verify = lookup("reward", "math")
            rho[i] = sum(verify("", a, ground_truth=finals[i][1]) or 0.0 for a in said) / k
    return rho


@register("reward", "agentic_proposing")
@uses_judges
def agentic_proposing_reward(prompts: list[str], responses: list[str], *, ground_truth: list[Any],
                             judges: dict[str, Any], verifiers: list[str] = ("sympy",), prober: str | None = "prober",
                             k: int = 16, difficulty: str = "linear", band: list[float] = (0.125, 0.875),
                             r_fmt: float = 0.1, r_valid: float = 1.0, verifier_template: str = VERIFIER_TEMPLATE,
                             solver_template: str = SOLVER_TEMPLATE, max_value: int = 10**6, match: str = "equivalent",
                             seed: int = 0, **_: Any) -> list[dict[str, Any]]:
    """Per proposal: `score` (R_traj), `valid` (V), and the components `has_final`, `format_ok`,
    `sympy_valid`, `judge_yes` (share of judge votes for valid), `verified` (V as a number, whose mean is the
    share of valid problems), `pass_rate` and `in_band` (valid problems)."""
    if match not in ("equivalent", "math_verify"):
        raise ValueError(f"agentic_proposing: match must be equivalent or math_verify, got {match!r}")
    for name in [v for v in verifiers if v not in CHECKS] + ([prober] if prober else []):
        if name not in judges:
            raise ValueError(f"agentic_proposing needs reward.judges.{name} (have {sorted(judges)})")
    if difficulty not in ("linear", "band"):
        raise ValueError(f"agentic_proposing: difficulty must be linear or band, got {difficulty!r}")
    finals = [parse_final(r) for r in responses]
    out: list[dict[str, Any]] = [{} for _ in responses]
    votes: list[list[bool]] = [[] for _ in responses]  # every verifier's vote
    judge_votes: list[list[bool]] = [[] for _ in responses]  # the model judges' votes
    judged = [i for i, f in enumerate(finals) if f is not None]
    for name in verifiers:
        if name in CHECKS:
            for i in judged:
                seed_info = ground_truth[i] if isinstance(ground_truth[i], dict) else {}
                ok = (sympy_check(*finals[i], operators=list(seed_info.get("operators", [])), max_abs=max_value)
                      if name == "sympy" else answer_parses(finals[i][1]))
                votes[i].append(ok)
                out[i][f"{name}_valid"] = float(ok)
            continue
        said = judges[name].generate([verifier_template.format(problem=finals[i][0], answer=finals[i][1])
                                      for i in judged], seed=seed)
        for i, text in zip(judged, said):
            votes[i].append(bool(final_verdict(text)))  # no verdict: a vote against
            judge_votes[i].append(votes[i][-1])
    valid = [f is not None and majority_valid(votes[i]) for i, f in enumerate(finals)]
    probed = [i for i in judged if valid[i]]
    rho = (pass_rates(judges[prober], {i: finals[i] for i in probed}, k, solver_template, match, seed)
           if prober and probed else {})
    lo, hi = band
    for i, final in enumerate(finals):
        format_ok = final is not None and answer_parses(final[1])
        row = out[i]
        row.update(has_final=float(final is not None), format_ok=float(format_ok), valid=valid[i],
                   verified=float(valid[i]))
        if judge_votes[i]:
            row["judge_yes"] = sum(judge_votes[i]) / len(judge_votes[i])
        if i in rho:
            row.update(pass_rate=rho[i], in_band=float(lo <= rho[i] <= hi))
        row["score"] = mgpo_trajectory_reward(valid[i], format_ok, rho.get(i, 0.0), r_fmt=r_fmt, r_valid=r_valid,
                                              difficulty=difficulty, band=(lo, hi))
    return out

register_alias("reward", "agentic_proposer", "agentic_proposing")
