"""The LeanLite autoformalization task (`data.synthetic.task: dsr`): DSR's CPU setting (rl/methods/dsr/README.md), a labelled synthetic harness. Statements are in LeanLite, looprl's own small typed language with a real
checker (`rl.methods.dsr.core.check`), standing in for Lean 4 + Mathlib, which cannot be installed here.

One tiny model is taught every DSR role from the SFT split, the role named first in the prompt (`rl.methods.dsr.core`'s `tiny`
formats):

* decomposer: `DECOMPOSE <NL statement> =>` → the conditions (`;`-separated) `||` the conclusion;
* formalizer: `FORMALIZE condition|conclusion <NL component> =>` → the LeanLite fragment `<SEP>` its operator tree
  (braced form; hypotheses as `(h : …)`, renamed h1, h2, … at assembly as DSR does);
* repairer: the three requests of `rl.methods.dsr.core.repair_examples` (the broken subtree without NL, the component with its
  NL, the whole statement with the NL) → the original code;
* judge: `JUDGE <NL component> | <fragment> =>` → A (the fragment states it), B (minor: the comparison's
  strictness flipped), C (major: another variable, numeral or direction; a wrong type).

The RL split holds formalizer prompts with the gold fragment as `answer`; the held-out split holds whole statements:
`prompt` (the NL), `answer` (the gold statement), `item` (its components, trees and NL) and `broken` (a copy with
one injected local error, for the repair comparison).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rl.methods.dsr import core as dsr
from rl.registry import register
from rl.tasks import write_splits

_FLIP_STRICT = {" > ": " ≥ ", " ≥ ": " > ", " < ": " ≤ ", " ≤ ": " < "}
_FLIP_DIRECTION = {" > ": " < ", " < ": " > ", " ≥ ": " ≤ ", " ≤ ": " ≥ "}


def perturb(code: str, grade: str, rng: random.Random) -> str | None:
    """`code` changed as the judge's grade `grade` describes (B: strictness flipped; C: the direction flipped,
    another variable or numeral), or None when the fragment has nothing to change."""
    if code.endswith(": Real)") and " : " in code and grade == "C":
        return code.replace(": Real)", ": Nat)")
    ops = [op for op in _FLIP_STRICT if op in code]
    if not ops:
        return None
    op = ops[-1]
    head, _, tail = code.rpartition(op)  # the comparison is the last operator of that kind in the fragment
    if grade == "B":
        return head + _FLIP_STRICT[op] + tail
    kind = rng.choice(["direction", "variable", "numeral"])
    if kind == "variable":
        names = [c for c in "xyzu" if f" {c}" in f" {code}" or f"({c}" in code]
        if names:
            old = rng.choice(names)
            new = rng.choice([c for c in "xyzu" if c != old])
            body = code.split(" : ", 1)
            head, rest = (body[0] + " : ", body[1]) if code.startswith("(h") else ("", code)
            return head + "".join(new if ch == old else ch for ch in rest)
    if kind == "numeral":
        digits = [i for i, ch in enumerate(code) if ch.isdigit() and not (code.startswith("(h") and i < 4)]
        if digits:
            i = rng.choice(digits)
            return code[:i] + str((int(code[i]) % 9) + 1) + code[i + 1:]
    return head + _FLIP_DIRECTION[op] + tail


def formal_components(item: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any] | None]]:
    """(tag, NL, generic fragment, generic tree) per component: hypotheses labelled `(h : …)` as a formalizer
    writes them before the assembly renames them."""
    import copy
    out = []
    codes = item["conditions"] + [item["conclusion"]]
    for i, (nl, code, tree) in enumerate(zip(item["nl"], codes, item["trees"])):
        tag = "conclusion" if i == len(codes) - 1 else "condition"
        if tree is not None and code.startswith("(h"):
            tree = copy.deepcopy(tree)
            tree["formal_content"] = "(h : <SLOT>)"
            code = dsr.assemble(tree)
        out.append((tag, nl, code, tree))
    return out


def sft_rows(item: dict[str, Any], rng: random.Random) -> list[dict[str, str]]:
    """Every role's supervised rows from one statement (and a broken copy of it)."""
    n_vars = sum(t is None for t in item["trees"])
    rows = [{"prompt": dsr.decompose_prompt(item["nl_statement"]),
             "target": dsr.decompose_target(item["nl"][:-1], item["nl"][-1]), "role": "decomposer"}]
    for tag, nl, code, tree in formal_components(item):
        rows.append({"prompt": dsr.formalize_prompt(tag, nl), "target": dsr.formalize_target(code, tree),
                     "role": "formalizer"})
    codes = item["conditions"] + [item["conclusion"]]
    for i, (nl, code) in enumerate(zip(item["nl"], codes)):
        if rng.random() < (0.8 if i < n_vars else 0.5):  # a share of the components (declarations are alike)
            continue
        grades = [("A", code)] + [(g, bad) for g in ("B", "C") if (bad := perturb(code, g, rng)) is not None]
        for grade, text in grades:
            rows.append({"prompt": dsr.judge_prompt(nl, text), "target": f" {grade}", "role": "judge"})
    broken = dsr.inject_local_error(item, rng)
    rows += [{"prompt": r["prompt"], "target": r["target"], "role": f"repairer:{r['kind']}"}
             for r in dsr.repair_examples(item, broken)]
    # the semantic re-check after a local success (no errors left): a statement that compiles but says something
    # else (the undeclared name replaced by a wrong variable) is rewritten to the NL's; a faithful one is kept
    gold = dsr.splice(item["conditions"], item["conclusion"])
    statement = dsr.splice(broken["conditions"], broken["conclusion"])
    names = [v for v in "xyzu" if f"({v} : Real)" in statement]
    wrong = statement.replace(" w", " " + rng.choice(names)).replace("(w", "(" + rng.choice(names))
    for text in (wrong, gold) if wrong != statement and not dsr.check(wrong) else (gold,):
        request = dsr.RepairRequest("statement", text, dsr.NO_ERRORS, nl=item["nl_statement"])
        rows.append({"prompt": dsr.format_request(request), "target": " " + gold, "role": "repairer:recheck"})
    return rows


def write_dsr_task(out_dir: str | Path, num_train: int = 3000, num_eval: int = 200, sft_fraction: float = 0.9,
                   n_vars: int = 2, n_hyps: int = 2, depth: int = 2, seed: int = 1234) -> dict[str, str]:
    """Write `sft.jsonl` (every role's rows from `sft_fraction` of the training statements), `train.jsonl`
    (formalizer prompts, gold fragment as answer) and `eval.jsonl` (held-out statements with a broken copy);
    statements are distinct across the splits."""
    rng = random.Random(seed)
    items, seen = [], set()
    tries = 0
    while len(items) < num_train + num_eval:
        tries += 1
        if tries > 50 * (num_train + num_eval):
            raise ValueError(f"dsr task: could not draw {num_train + num_eval} distinct statements")
        item = dsr.random_statement(rng, n_vars=n_vars, n_hyps=n_hyps, depth=depth)
        key = dsr.splice(item["conditions"], item["conclusion"])
        if key not in seen and dsr.has_error_site(item):
            seen.add(key)
            items.append(item)
    eval_items, train_items = items[:num_eval], items[num_eval:]
    n_sft = int(len(train_items) * sft_fraction)
    sft = [row for item in train_items[:n_sft] for row in sft_rows(item, rng)]
    train = [{"prompt": dsr.formalize_prompt(tag, nl), "answer": code}
             for item in train_items[n_sft:] for tag, nl, code, _ in formal_components(item)]
    evals = [{"prompt": it["nl_statement"], "answer": dsr.splice(it["conditions"], it["conclusion"]), "item": it,
              "broken": dsr.inject_local_error(it, rng)} for it in eval_items]
    return write_splits(out_dir, {"sft": sft, "train": train, "eval": evals})


@register("task", "dsr")
def dsr_task(out_dir: str | Path, *, num_train: int, num_eval: int, sft_fraction: float, seed: int,
             n_vars: int = 2, n_hyps: int = 2, depth: int = 2, **_: Any) -> dict[str, str]:
    """LeanLite statements over `n_vars` Real variables with `n_hyps` hypotheses and expressions of depth
    `depth`; the SFT split teaches the four DSR roles."""
    return write_dsr_task(out_dir, num_train=num_train, num_eval=num_eval, sft_fraction=sft_fraction,
                          n_vars=n_vars, n_hyps=n_hyps, depth=depth, seed=seed)


# whole phrases with one token id each in the tiny tokenizer (model.tiny.task_tokens): the role words, LeanLite's
# keywords and the NL templates; the comparison signs are not in the character set, so they come as phrases.
dsr_task.added_tokens = [
    "DECOMPOSE ", "FORMALIZE ", "condition ", "conclusion ", "JUDGE ", "SUBTREE ", "COMPONENT ", "STATEMENT ",
    " | ERROR ", " | VARS ", " | NL ", " =>", " <SEP> ", " || ", "theorem test ", " := by sorry", " : Real)",
    " is a real number", "Let ", " be real numbers. Suppose ", ". Show that ", " is greater than ",
    " is less than ", " is at least ", " is at most ", " plus ", " minus ", " times ", " squared",
    "the absolute value of ", "the square root of ", "the maximum of ", "unknown identifier ",
    "function 'abs' expects 1 arguments, got 2", "function 'sqrt' expects 1 arguments, got 2",
    dsr.NO_ERRORS, " > ", " < ", " ≥ ", " ≤ ", "abs(", "sqrt(", "max(",
]
