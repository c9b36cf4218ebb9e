"""DSR (rl/methods/dsr/README.md; confirmed from the released code): Decompose, Structure, Repair for
autoformalization. This module holds the model-free parts:

* **LeanLite**, a small typed expression language of looprl's own with a real checker (`check`), standing in for
  Lean 4 + Mathlib where no Lean toolchain is installed (the CPU tests and the effect run; labelled as such
  wherever it appears). Statements read as Lean's do: `theorem test (x : Real) (h1 : x > 0) : x ^ 2 > 0 := by
  sorry`. Types Nat, Int, Real and Prop; arithmetic `+ - * / ^` on one numeric type (a numeral takes the type of
  the other side); comparisons `= ≠ < > ≤ ≥` give Prop; `∧ ∨ → ¬` on Prop; `∀ x : T, P` and `∃ x : T, P`;
  functions `abs` (1), `max` and `min` (2), `sqrt` (1, Real). Errors carry the column where they start, as Lean's
  first-error JSON does.
* The operator tree (OPT) of a component: nodes with `formal_content` holding `<SLOT>` placeholders and ordered
  `children`; structure-first assembly by slot filling (`assemble`), each node's span in the text (`spans`), the
  smallest node containing an error column (`smallest_containing`), the repair ladder node → parent → grandparent
  … → component → statement skipping redundant wrappers (`repair_ladder`).
* Splicing components into a statement with hypotheses renamed h1, h2, … (`splice`).
* LeanScorer's Sugeno aggregation of per-condition grades (`sugeno_score`, pass ≥ 0.6).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

NUMERIC = ("Nat", "Int", "Real")
TYPES = (*NUMERIC, "Prop")
FUNCTIONS = {"abs": 1, "max": 2, "min": 2, "sqrt": 1}
SLOT = "<SLOT>"


@dataclass
class LeanLiteError:
    column: int  # 0-based offset in the checked text
    message: str

    def as_json(self) -> dict[str, Any]:
        return {"pos": {"column": self.column}, "severity": "error", "data": self.message}


_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<id>[A-Za-z_][A-Za-z_0-9']*)|(?P<op>:=|≤|≥|≠|→|∧|∨|¬|∀|∃|[-+*/^()<>=:,]))")


class _ParseError(Exception):
    def __init__(self, column: int, message: str):
        super().__init__(message)
        self.column, self.message = column, message


def _tokens(text: str) -> list[tuple[str, str, int]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            col = pos + len(text[pos:]) - len(text[pos:].lstrip())
            raise _ParseError(col, f"unexpected character {text[col]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    out.append(("end", "", len(text)))
    return out


@dataclass
class _Node:
    kind: str  # num | var | app | bin | unary | quant
    value: str
    column: int
    args: list[_Node] = field(default_factory=list)
    binder_type: str | None = None


class _Parser:
    PREC = [("→",), ("∨",), ("∧",), ("=", "≠", "<", ">", "≤", "≥"), ("+", "-"), ("*", "/"), ("^",)]

    def __init__(self, text: str):
        self.toks, self.i = _tokens(text), 0

    def peek(self) -> tuple[str, str, int]:
        return self.toks[self.i]

    def take(self, value: str | None = None) -> tuple[str, str, int]:
        tok = self.toks[self.i]
        if value is not None and tok[1] != value:
            raise _ParseError(tok[2], f"expected {value!r}, found {tok[1] or 'end of input'!r}")
        self.i += 1
        return tok

    def expr(self, level: int = 0) -> _Node:
        if level == len(self.PREC):
            return self.unary()
        if self.PREC[level] == ("→",):  # right-associative
            left = self.expr(level + 1)
            if self.peek()[1] == "→":
                op = self.take()
                return _Node("bin", "→", left.column, [left, self.expr(level)])
            return left
        left = self.expr(level + 1)
        while self.peek()[1] in self.PREC[level]:
            op = self.take()
            left = _Node("bin", op[1], left.column, [left, self.expr(level + 1)])  # errors start where it does
        return left

    def unary(self) -> _Node:
        kind, value, col = self.peek()
        if value in ("¬", "-"):
            self.take()
            return _Node("unary", value, col, [self.unary()])
        if value in ("∀", "∃"):
            self.take()
            _, name, ncol = self.take()
            self.take(":")
            _, typ, tcol = self.take()
            if typ not in NUMERIC:
                raise _ParseError(tcol, f"unknown type {typ!r}")
            self.take(",")
            return _Node("quant", value, col, [_Node("var", name, ncol), self.expr()], binder_type=typ)
        if kind == "num":
            self.take()
            return _Node("num", value, col)
        if kind == "id":
            self.take()
            if self.peek()[1] == "(" and value in FUNCTIONS:
                self.take("(")
                args = [self.expr()]
                while self.peek()[1] == ",":
                    self.take(",")
                    args.append(self.expr())
                self.take(")")
                return _Node("app", value, col, args)
            return _Node("var", value, col)
        if value == "(":
            self.take("(")
            inner = self.expr()
            self.take(")")
            return inner
        raise _ParseError(col, f"unexpected {value or 'end of input'!r}")


def _type_of(node: _Node, env: dict[str, str], errors: list[LeanLiteError], want: str | None = None) -> str | None:
    """The node's type (None when unknown after an error); numerals take `want` when it is numeric."""
    if node.kind == "num":
        if want in NUMERIC:
            if want != "Real" and "." in node.value:
                errors.append(LeanLiteError(node.column, f"numeral {node.value} is not a {want}"))
            return want
        return "Real" if "." in node.value else "Nat"
    if node.kind == "var":
        if node.value not in env:
            errors.append(LeanLiteError(node.column, f"unknown identifier '{node.value}'"))
            return None
        return env[node.value]
    if node.kind == "app":
        arity = FUNCTIONS[node.value]
        if len(node.args) != arity:
            errors.append(LeanLiteError(node.column, f"function '{node.value}' expects {arity} arguments, got "
                                                     f"{len(node.args)}"))
            return None
        types = _numeric_operands(node.args, env, errors, node.value, "Real" if node.value == "sqrt" else want)
        if types is None:
            return None
        if node.value == "sqrt" and types != "Real":
            errors.append(LeanLiteError(node.column, f"sqrt expects a Real, got {types}"))
            return None
        return types
    if node.kind == "unary":
        if node.value == "¬":
            _expect_prop(node.args[0], env, errors)
            return "Prop"
        t = _type_of(node.args[0], env, errors, want)
        if t is not None and t not in NUMERIC:
            errors.append(LeanLiteError(node.column, f"negation of a {t}"))
            return None
        if t == "Nat":
            errors.append(LeanLiteError(node.column, "negation of a Nat (use Int)"))
        return t
    if node.kind == "quant":
        inner = dict(env)
        inner[node.args[0].value] = node.binder_type or "Real"
        _expect_prop(node.args[1], inner, errors)
        return "Prop"
    op = node.value
    if op in ("→", "∧", "∨"):
        for a in node.args:
            _expect_prop(a, env, errors)
        return "Prop"
    t = _numeric_operands(node.args, env, errors, op, want if op in "+-*/^" else None)
    if op in ("=", "≠", "<", ">", "≤", "≥"):
        return "Prop"
    return t


def _has_var(node: _Node) -> bool:
    return node.kind == "var" or any(_has_var(a) for a in node.args if not (node.kind == "quant" and a is node.args[0]))


def _expect_prop(node: _Node, env: dict[str, str], errors: list[LeanLiteError]) -> None:
    t = _type_of(node, env, errors)
    if t is not None and t != "Prop":
        errors.append(LeanLiteError(node.column, f"type mismatch: expected a Prop, got {t}"))


def _numeric_operands(args: list[_Node], env: dict[str, str], errors: list[LeanLiteError], what: str,
                      want: str | None = None) -> str | None:
    """The common numeric type of `args` (numerals follow the others), or None after an error."""
    known = [_type_of(a, env, []) for a in args if _has_var(a)]  # a variable-free side takes the other's type
    target = next((t for t in known if t is not None), want)
    if target is None:  # variable-free on every side: the widest type a side forces (sqrt gives a Real)
        probe = {_type_of(a, env, []) for a in args}
        target = next((t for t in ("Real", "Int") if t in probe), None)
    types = [_type_of(a, env, errors, target) for a in args]
    if any(t is None for t in types):
        return None
    bad = [(a, t) for a, t in zip(args, types) if t not in NUMERIC]
    if bad:
        errors.append(LeanLiteError(bad[0][0].column, f"'{what}' expects numbers, got {bad[0][1]}"))
        return None
    if len(set(types)) > 1:
        a, t = next((a, t) for a, t in zip(args, types) if t != types[0])
        errors.append(LeanLiteError(a.column, f"type mismatch in '{what}': {types[0]} and {t}"))
        return None
    return types[0]


_STATEMENT = re.compile(r"^\s*theorem\s+\w+\s*(?P<binders>.*?)\s*:\s*(?P<goal>[^:].*?)\s*:=\s*by\s+sorry\s*$", re.S)


def check(statement: str) -> list[LeanLiteError]:
    """Check a LeanLite statement `theorem NAME (binders…) : goal := by sorry`; returns its errors (empty: it
    compiles). Binders `(x y : T)` declare variables, `(h : P)` hypotheses (P must be a Prop over declared
    variables); the goal must be a Prop. Parsing stops at the first syntax error; type errors are all reported."""
    errors: list[LeanLiteError] = []
    head = re.match(r"\s*theorem\s+\w+", statement)
    if not head:
        return [LeanLiteError(0, "expected 'theorem NAME'")]
    pos, env = head.end(), {}
    while True:
        m = re.match(r"\s*\(", statement[pos:])
        if not m:
            break
        start = pos + m.end()
        depth, end = 1, start
        while end < len(statement) and depth:
            depth += {"(": 1, ")": -1}.get(statement[end], 0)
            end += 1
        if depth:
            return [LeanLiteError(start - 1, "unclosed '('")]
        inner = statement[start:end - 1]
        if ":" not in inner:
            return [LeanLiteError(start, "expected ':' in binder")]
        names, body = inner.split(":", 1)
        body_col = start + len(names) + 1
        names_list = names.split()
        if not names_list:
            return [LeanLiteError(start, "binder without a name")]
        if body.strip() in TYPES:
            for n in names_list:
                env[n] = body.strip()
        else:
            errors += _check_expr(body, body_col, env, prop=True)
            for n in names_list:
                env[n] = "Proof"
        pos = end
    rest = statement[pos:]
    m = re.match(r"\s*:(?!=)", rest)
    if not m:
        return errors + [LeanLiteError(pos + len(rest) - len(rest.lstrip()), "expected ':' before the goal")]
    goal_start = pos + m.end()
    tail = statement.rfind(":=")
    if tail < goal_start or not re.match(r":=\s*by\s+sorry\s*$", statement[tail:]):
        return errors + [LeanLiteError(len(statement.rstrip()), "expected ':= by sorry'")]
    errors += _check_expr(statement[goal_start:tail], goal_start, env, prop=True)
    return sorted(errors, key=lambda e: e.column)


def _check_expr(text: str, offset: int, env: dict[str, str], prop: bool) -> list[LeanLiteError]:
    errors: list[LeanLiteError] = []
    try:
        parser = _Parser(text)
        node = parser.expr()
        kind, value, col = parser.peek()
        if kind != "end":
            raise _ParseError(col, f"unexpected {value!r} after the expression")
    except _ParseError as e:
        return [LeanLiteError(offset + e.column, e.message)]
    visible = {k: v for k, v in env.items() if v != "Proof"}
    if prop:
        _expect_prop(node, visible, errors)
    else:
        _type_of(node, visible, errors)
    for e in errors:
        e.column += offset
    return errors


def sugeno_score(grades: list[str]) -> float:
    """LeanScorer's Sugeno integral over per-condition grades A (1), B (0.5), C (0): max over α ∈ {1, 0.5} of
    min(α, μ(conditions graded ≥ α)), μ(S) = 0 if S holds a C; 1 if S is every condition and all are A; else
    (#A / n) × the B penalty (one B: 0.9; k ≥ 2: max(1 − 0.2k, 0))."""
    n = len(grades)
    if n == 0 or "C" in grades:
        return 0.0
    if all(g == "A" for g in grades):
        return 1.0
    n_b = grades.count("B")
    penalty = 1.0 if n_b == 0 else 0.9 if n_b == 1 else max(1 - 0.2 * n_b, 0.0)

    def mu(subset_grades: list[str]) -> float:
        if "C" in subset_grades:
            return 0.0
        if len(subset_grades) == n and all(g == "A" for g in subset_grades):
            return 1.0
        return (subset_grades.count("A") / n) * (penalty if "B" in subset_grades else 1.0)
    at_1 = [g for g in grades if g == "A"]
    at_half = [g for g in grades if g in ("A", "B")]
    return max(min(1.0, mu(at_1) if at_1 else 0.0), min(0.5, mu(at_half)))


# -- operator trees ------------------------------------------------------------------------------------------------
Path_ = tuple[int, ...]  # a node's address: child indices from the component's root


class TreeError(ValueError):
    """An operator tree that cannot be assembled (slot count against children, malformed node): the caller falls
    back to the component's linear code."""


def assemble(node: dict[str, Any]) -> str:
    """Structure-first assembly: the node's `formal_content` with each `<SLOT>` filled, in order, by its children's
    assembled text."""
    if not isinstance(node, dict) or not isinstance(node.get("formal_content"), str):
        raise TreeError(f"not an operator-tree node: {node!r}")
    children = node.get("children") or []
    parts = node["formal_content"].split(SLOT)
    if len(parts) - 1 != len(children):
        raise TreeError(f"{len(parts) - 1} slots but {len(children)} children in {node['formal_content']!r}")
    out = parts[0]
    for child, rest in zip(children, parts[1:]):
        out += assemble(child) + rest
    return out


def spans(node: dict[str, Any], offset: int = 0, path: Path_ = ()) -> dict[Path_, tuple[int, int]]:
    """Every node's [start, end) in its component's assembled text, by path."""
    out: dict[Path_, tuple[int, int]] = {}
    parts = node["formal_content"].split(SLOT)
    pos = offset + len(parts[0])
    for i, (child, rest) in enumerate(zip(node.get("children") or [], parts[1:])):
        sub = spans(child, pos, (*path, i))
        out.update(sub)
        pos = sub[(*path, i)][1] + len(rest)
    out[path] = (offset, pos)
    return out


def node_at(tree: dict[str, Any], path: Path_) -> dict[str, Any]:
    for i in path:
        tree = tree["children"][i]
    return tree


def smallest_containing(tree: dict[str, Any], column: int) -> Path_:
    """The deepest node whose span contains `column` (a column of the component's text); the root when none
    does (e.g. a column at the very end)."""
    best: Path_ = ()
    for path, (start, end) in spans(tree).items():
        if start <= column < end and len(path) > len(best):
            best = path
    return best


_WRAPPER = re.compile(r"^\s*\(\s*<SLOT>\s*\)\s*$|^\s*\(\s*h\w*\s*:\s*<SLOT>\s*\)\s*$")


def is_wrapper(node: dict[str, Any]) -> bool:
    """A redundant wrapper: a parenthesised single child, or a hypothesis label `(hN : <SLOT>)`."""
    return bool(_WRAPPER.match(node["formal_content"])) and len(node.get("children") or []) == 1


def repair_ladder(tree: dict[str, Any], error_node: Path_) -> list[Path_]:
    """The nodes tree-guided repair tries, in order: the error node's parent, then each ancestor up to the
    component's root, skipping redundant wrappers (the root is never skipped). The caller goes on to component
    repair (with the NL) and the statement-level global repair."""
    ladder: list[Path_] = []
    path = error_node[:-1]  # the root's parent is the root itself
    while True:
        if path == () or not is_wrapper(node_at(tree, path)):
            ladder.append(path)
        if path == ():
            return ladder
        path = path[:-1]


def replace_node(tree: dict[str, Any], path: Path_, text: str) -> dict[str, Any]:
    """A copy of the tree with the node at `path` replaced by a leaf holding `text` (a repaired snippet)."""
    import copy
    out = copy.deepcopy(tree)
    if path == ():
        return {"formal_content": text, "children": []}
    parent = node_at(out, path[:-1])
    parent["children"][path[-1]] = {"formal_content": text, "children": []}
    return out


def rename_hypotheses(binders: list[str]) -> list[str]:
    """Generic hypothesis labels `(h : …)` (and any `(hX : …)` on a Prop) renamed h1, h2, … in order."""
    out, k = [], 0
    for b in binders:
        m = re.match(r"^\(\s*(h\w*)\s*:(.*)\)$", b.strip())
        if m and m.group(2).strip() not in TYPES:
            k += 1
            out.append(f"(h{k} :{m.group(2)})")
        else:
            out.append(b.strip())
    return out


THEOREM = "theorem test "  # every statement's frame before its first component


def splice(conditions: list[str], conclusion: str) -> str:
    """`theorem test <conditions…> : <conclusion> := by sorry`, hypotheses renamed h1, h2, …"""
    binders = " ".join(rename_hypotheses(conditions))
    return f"{THEOREM}{binders} : {conclusion} := by sorry".replace("  ", " ")


def component_spans(conditions: list[str], conclusion: str) -> list[tuple[int, int]]:
    """Each component's [start, end) in `splice(conditions, conclusion)`: the conditions (as renamed), then the
    conclusion."""
    out, pos = [], len(THEOREM)
    for c in rename_hypotheses(conditions):
        out.append((pos, pos + len(c)))
        pos += len(c) + 1
    goal = pos + 2  # past ": " (with no conditions `pos` is the frame's end, where ": " starts)
    return [*out, (goal, goal + len(conclusion))]


def component_of_column(conditions: list[str], conclusion: str, column: int) -> int:
    """Which component (index into conditions; len(conditions) for the conclusion) a column of `splice(...)` falls
    in; -1 for the statement's own frame (`theorem test`, `:=`)."""
    for i, (start, end) in enumerate(component_spans(conditions, conclusion)):
        if start <= column < end:
            return i
    return -1


# -- repair ----------------------------------------------------------------------------------------------------------
NO_ERRORS = "no errors: check the statement against the NL"  # the global re-check's request after a local success
Checker = Callable[[str], list[LeanLiteError]]  # statement -> its errors, first first: `check` or a Lean compiler


@dataclass
class RepairRequest:
    """One call to the repair model. `kind`: subtree (the broken snippet, the error and the declared variables, no
    NL: the "micro-surgeon"), component (the component's code, the error and its NL) or statement (the whole
    statement, its errors and the NL: global repair)."""
    kind: str
    code: str
    error: str
    declared: str = ""
    nl: str = ""


@dataclass
class RepairTrace:
    statement: str
    errors: int
    calls: list[dict[str, Any]] = field(default_factory=list)


def _declared(conditions: list[str], upto: int) -> str:
    return " ".join(c for c in rename_hypotheses(conditions)[:upto])


RepairSteps = Generator[RepairRequest, str, RepairTrace]


def drive(steps: RepairSteps, repair: Callable[[RepairRequest], str]) -> RepairTrace:
    """Run one repair procedure (a generator of model calls) with `repair(request) -> fixed code`."""
    try:
        request = next(steps)
        while True:
            request = steps.send(repair(request))
    except StopIteration as stop:
        return stop.value


def drive_batched(procedures: list[RepairSteps], repair_batch: Callable[[list[RepairRequest]], list[str]]
                  ) -> list[RepairTrace]:
    """Run many repair procedures in lockstep: each round sends every pending request to the repair model in one
    batch (`repair_batch(requests) -> fixes`, e.g. one engine call), so a statement's calls stay sequential while
    the model decodes the statements together."""
    traces: list[RepairTrace | None] = [None] * len(procedures)
    pending: dict[int, RepairRequest] = {}
    for i, steps in enumerate(procedures):
        try:
            pending[i] = next(steps)
        except StopIteration as stop:
            traces[i] = stop.value
    while pending:
        order = sorted(pending)
        fixes = repair_batch([pending[i] for i in order])
        if len(fixes) != len(order):
            raise ValueError(f"repair_batch returned {len(fixes)} fixes for {len(order)} requests")
        for i, fixed in zip(order, fixes):
            try:
                pending[i] = procedures[i].send(fixed)
            except StopIteration as stop:
                traces[i] = stop.value
                del pending[i]
    return [t for t in traces if t is not None]


def tree_guided_repair(conditions: list[str], conclusion: str, trees: list[dict[str, Any] | None],
                       nl_components: list[str], nl_statement: str, repair: Any, budget: int = 4,
                       rng: Any = None, local_calls: int = 1) -> RepairTrace:
    """`tree_guided_repair_steps` run with `repair(RepairRequest) -> str`."""
    return drive(tree_guided_repair_steps(conditions, conclusion, trees, nl_components, nl_statement, budget, rng,
                                          local_calls=local_calls), repair)



def _component_text(conditions: list[str], conclusion: str, i: int) -> str:
    return rename_hypotheses(conditions)[i] if i < len(conditions) else conclusion


def _with_component(conditions: list[str], conclusion: str, i: int, text: str) -> tuple[list[str], str]:
    """The statement's conditions and conclusion with component `i` replaced by `text`."""
    if i < len(conditions):
        return [text if k == i else c for k, c in enumerate(conditions)], conclusion
    return list(conditions), text


def _spells(tree: dict[str, Any], text: str) -> bool:
    """Whether the operator tree assembles to the component's text (a malformed tree does not)."""
    try:
        return assemble(tree) == text
    except TreeError:
        return False


def _local_request(conditions: list[str], conclusion: str, tree: dict[str, Any] | None, comp: int,
                   err: LeanLiteError, exhausted: set, nl_component: str
                   ) -> tuple[Path_ | str, RepairRequest, int] | None:
    """The next local repair of component `comp` for error `err`: the lowest rung of its operator tree's ladder
    above the smallest node containing the error that is not exhausted, else the whole component with its NL
    (None when that is exhausted too); the request and the column of the statement where its edit starts. A
    component without a tree, or whose tree no longer spells it, is repaired whole."""
    text = _component_text(conditions, conclusion, comp)
    start = component_spans(conditions, conclusion)[comp][0]
    target: Path_ | str = "component"
    if tree is not None and _spells(tree, text):
        node = smallest_containing(tree, err.column - start)
        target = next((p for p in repair_ladder(tree, node) if (comp, p) not in exhausted), "component")
    if target == "component":
        if (comp, "component") in exhausted:
            return None
        return target, RepairRequest("component", text, err.message, _declared(conditions, comp), nl_component), start
    return target, RepairRequest("subtree", assemble(node_at(tree, target)), err.message,
                                 _declared(conditions, comp)), start + spans(tree)[target][0]


def tree_guided_repair_steps(conditions: list[str], conclusion: str, trees: list[dict[str, Any] | None],
                             nl_components: list[str], nl_statement: str, budget: int = 4,
                             rng: Any = None, check: Checker = check, local_calls: int = 1) -> RepairSteps:
    """DSR's repair within `budget` model calls (a generator: it yields each `RepairRequest` and is sent the
    model's fixed code; `drive`, `drive_batched`): map the first error's column to
    its component, find the smallest operator-tree node containing it, and repair from its parent up the ladder
    (`repair_ladder`; a failed node is marked exhausted and the next rung is tried), then the component with its
    NL, for at most `local_calls` calls (and never the last one); the rest go to statement-level global repair,
    which runs after a local success (the semantic re-check, once) or while errors remain. The released code's
    split of a 4-call budget is 1 local and 3 global (its `local_repair_turns=1`, `global_repair_turns=3`); a
    larger `local_calls` climbs the ladder further. A local attempt succeeds when the statement then compiles or
    its first error lies outside the edited span (partial success); a global attempt is kept when it has fewer
    errors (as many: kept with probability 0.5, `rng`). [RECONSTRUCTION]: the released global repair is one
    conversation of up to 3 turns judged by its last candidate; here each global call is judged and kept on its
    own, so a later call starts from the best statement so far. `trees[i]` None: component i has no valid tree
    (component repair)."""
    import random
    rng = rng or random.Random(0)
    conditions, trees = list(conditions), list(trees)
    errors = check(splice(conditions, conclusion))
    calls: list[dict[str, Any]] = []
    exhausted: set[tuple[int, Path_ | str]] = set()
    local_success = False
    while errors and len(calls) < min(local_calls, budget - 1):
        err = errors[0]
        comp = component_of_column(conditions, conclusion, err.column)
        if comp < 0:
            break
        local = _local_request(conditions, conclusion, trees[comp], comp, err, exhausted, nl_components[comp])
        if local is None:
            break
        target, request, edit_start = local
        fixed = yield request
        new_tree = None if target == "component" else replace_node(trees[comp], target, fixed)
        new_conditions, new_conclusion = _with_component(conditions, conclusion, comp,
                                                         fixed if new_tree is None else assemble(new_tree))
        new_errors = check(splice(new_conditions, new_conclusion))
        ok = local_fix_holds(errors, new_errors, edit_start, len(fixed))
        calls.append({"kind": request.kind, "component": comp, "node": None if new_tree is None else list(target),
                      "code": request.code, "fixed": fixed, "accepted": ok, "errors_after": len(new_errors)})
        if not ok:
            exhausted.add((comp, target))
            continue
        # rungs exhausted before this success lie under the repaired node, a leaf now: no later ladder reaches them
        conditions, conclusion, trees[comp] = new_conditions, new_conclusion, new_tree
        errors, local_success = new_errors, True
    statement = splice(conditions, conclusion)
    global_done = False
    while len(calls) < budget and (errors or (local_success and not global_done)):
        statement, errors = yield from _global_call(statement, errors, nl_statement, rng, calls, check)
        global_done = True
    return RepairTrace(statement, len(errors), calls)


def local_fix_holds(errors: list[LeanLiteError], new_errors: list[LeanLiteError], start: int, length: int) -> bool:
    """A local repair succeeds when the statement then compiles or its first error lies outside the edited span
    (partial success), with no more errors than before."""
    outside = not new_errors or not (start <= new_errors[0].column < max(start + length, start + 1))
    return outside and len(new_errors) <= len(errors)


def _global_call(statement: str, errors: list[LeanLiteError], nl: str, rng: Any, calls: list[dict[str, Any]],
                 check: Checker) -> Generator[RepairRequest, str, tuple[str, list[LeanLiteError]]]:
    """One statement-level rewrite (recorded in `calls`), kept when it has fewer errors (as many: with probability
    0.5)."""
    msg = "; ".join(e.message for e in errors[:3]) if errors else NO_ERRORS
    fixed = yield RepairRequest("statement", statement, msg, nl=nl)
    new_errors = check(fixed)
    keep = len(new_errors) < len(errors) or (len(new_errors) == len(errors) and rng.random() < 0.5)
    calls.append({"kind": "statement", "code": statement, "fixed": fixed, "accepted": keep,
                  "errors_after": len(new_errors)})
    return (fixed, new_errors) if keep else (statement, errors)


def global_repair(statement: str, nl_statement: str, repair: Any, budget: int = 4, rng: Any = None) -> RepairTrace:
    """`global_repair_steps` run with `repair(RepairRequest) -> str`."""
    return drive(global_repair_steps(statement, nl_statement, budget, rng), repair)


def global_repair_steps(statement: str, nl_statement: str, budget: int = 4, rng: Any = None,
                        check: Checker = check) -> RepairSteps:
    """The baseline at the same call budget: statement-level rewrites only, each kept as in `tree_guided_repair`
    (a generator of model calls, as `tree_guided_repair_steps`)."""
    import random
    rng = rng or random.Random(0)
    errors = check(statement)
    calls: list[dict[str, Any]] = []
    while errors and len(calls) < budget:
        statement, errors = yield from _global_call(statement, errors, nl_statement, rng, calls, check)
    return RepairTrace(statement, len(errors), calls)


# -- synthetic statements (the effect run's data: LeanLite, labelled as such) -----------------------------------------
_OPS = {"+": ("<SLOT> + <SLOT>", "{0} plus {1}", 1), "-": ("<SLOT> - <SLOT>", "{0} minus {1}", 1),
        "*": ("<SLOT> * <SLOT>", "{0} times {1}", 2)}
_FUNCS = {"abs": ("abs(<SLOT>)", "the absolute value of {0}"), "max": ("max(<SLOT>, <SLOT>)", "the maximum of {0} and {1}"),
          "sqrt": ("sqrt(<SLOT>)", "the square root of {0}")}
_CMPS = {">": "is greater than", "<": "is less than", "≥": "is at least", "≤": "is at most"}


def _leaf(text: str) -> dict[str, Any]:
    return {"formal_content": text, "children": []}


def random_expression(rng: Any, variables: list[str], depth: int) -> tuple[dict[str, Any], str, int]:
    """A Real-valued expression over `variables`: (operator tree, NL, precedence: 3 atom, 2 product, 1 sum)."""
    if depth == 0 or rng.random() < 0.3:
        if rng.random() < 0.7:
            v = rng.choice(variables)
            return _leaf(v), v, 3
        n = str(rng.randint(1, 9))
        return _leaf(n), n, 3
    kind = rng.random()
    if kind < 0.35:
        name = rng.choice(list(_FUNCS))
        content, nl = _FUNCS[name]
        args = [random_expression(rng, variables, depth - 1) for _ in range(content.count(SLOT))]
        return {"formal_content": content, "children": [a[0] for a in args]}, nl.format(*(a[1] for a in args)), 3
    if kind < 0.45:
        base = random_expression(rng, variables, 0)
        return {"formal_content": "<SLOT> ^ <SLOT>", "children": [base[0], _leaf("2")]}, f"{base[1]} squared", 3
    op = rng.choice(list(_OPS))
    content, nl, prec = _OPS[op]
    kids = []
    for side in (0, 1):
        tree, text, p = random_expression(rng, variables, depth - 1)
        if p < prec or (op == "-" and side == 1 and p == prec):  # keep the reading: parenthesise
            tree, text = {"formal_content": "(<SLOT>)", "children": [tree]}, f"({text})"
        kids.append((tree, text))
    return {"formal_content": content, "children": [k[0] for k in kids]}, nl.format(kids[0][1], kids[1][1]), prec


def random_statement(rng: Any, n_vars: int = 2, n_hyps: int = 2, depth: int = 2) -> dict[str, Any]:
    """A LeanLite statement over Real variables with hypotheses and a conclusion, each comparison component with its
    operator tree and NL: {conditions, conclusion, trees (None for variable declarations), nl, nl_statement}."""
    variables = ["x", "y", "z", "u"][:n_vars]
    conditions, trees, nl = [f"({v} : Real)" for v in variables], [None] * n_vars, [f"{v} is a real number"
                                                                                       for v in variables]
    comps = []
    for _ in range(n_hyps + 1):
        (lt, ln, _), (rt, rn, _) = (random_expression(rng, variables, depth), random_expression(rng, variables, 0))
        cmp = rng.choice(list(_CMPS))
        comps.append(({"formal_content": f"<SLOT> {cmp} <SLOT>", "children": [lt, rt]}, f"{ln} {_CMPS[cmp]} {rn}"))
    for k, (tree, text) in enumerate(comps[:-1], 1):
        conditions.append(f"(h{k} : {assemble(tree)})")
        trees.append({"formal_content": f"(h{k} : <SLOT>)", "children": [tree]})
        nl.append(text)
    conclusion_tree, conclusion_nl = comps[-1]
    trees.append(conclusion_tree)
    nl.append(conclusion_nl)
    nl_statement = "Let " + ", ".join(variables) + " be real numbers. Suppose " + "; ".join(nl[n_vars:-1]) + \
        f". Show that {conclusion_nl}."
    return {"conditions": conditions, "conclusion": assemble(conclusion_tree), "trees": trees, "nl": nl,
            "nl_statement": nl_statement}


def _error_sites(tree: dict[str, Any]) -> tuple[list[Path_], list[Path_]]:
    """A tree's variable leaves and its one-argument function nodes (where `inject_local_error` can break it)."""
    nodes = [(p, node_at(tree, p)) for p in spans(tree)]
    return ([p for p, n in nodes if not n["children"] and n["formal_content"].isalpha()],
            [p for p, n in nodes if n["formal_content"] in ("abs(<SLOT>)", "sqrt(<SLOT>)")])


def has_error_site(item: dict[str, Any]) -> bool:
    return any(t is not None and any(_error_sites(t)) for t in item["trees"])


def inject_local_error(item: dict[str, Any], rng: Any) -> dict[str, Any]:
    """The item with one local error in one comparison component (an undeclared variable, or a function given an
    extra argument), its tree updated to spell the broken code; `error_component` names the component."""
    import copy
    out = copy.deepcopy(item)
    sites = _error_sites
    comps = [i for i, t in enumerate(out["trees"]) if t is not None and any(sites(t))]
    if not comps:
        raise ValueError("inject_local_error: no variable or one-argument function to break (has_error_site)")
    i = rng.choice(comps)
    tree = out["trees"][i]
    paths, funcs = sites(tree)
    if funcs and (not paths or rng.random() < 0.5):
        node = node_at(tree, rng.choice(funcs))
        node["formal_content"] = node["formal_content"].replace(")", ", 1)")
    else:
        node_at(tree, rng.choice(paths))["formal_content"] = "w"
    text = assemble(tree)
    if i < len(out["conditions"]):
        out["conditions"][i] = text
    else:
        out["conclusion"] = text
    out["error_component"] = i
    return out


def format_request(request: RepairRequest, style: str = "tiny") -> str:
    """The repair model's prompt for one request: `tiny`, the text a taught repairer reads before `=>`; `llm`,
    DSR's repair instructions (looprl's wording): the micro-surgeon sees the snippet, the error and the declared
    variables only; component and statement repair also see the NL."""
    if style == "tiny":
        context = f"VARS {request.declared}" if request.kind == "subtree" else f"NL {request.nl}"
        return f"{request.kind.upper()} {request.code} | ERROR {request.error} | {context} =>"
    if request.kind == "subtree":
        return ("Fix this Lean 4 expression so that it compiles. Change as little as possible and answer with the "
                f"fixed expression only.\nDeclared: {request.declared}\nExpression: {request.code}\nError: {request.error}")
    what = "binder or proposition" if request.kind == "component" else "theorem statement"
    return (f"Fix this Lean 4 {what} so that it compiles and states the natural-language text faithfully. Answer "
            f"with the fixed code only.\nText: {request.nl}\nCode: {request.code}\nError: {request.error}")


def repair_examples(original: dict[str, Any], broken: dict[str, Any]) -> list[dict[str, str]]:
    """Supervised rows {prompt, target} for a repair model from a statement and its broken copy
    (`inject_local_error`): the subtree request at the first rung of the ladder (the broken snippet → the
    original's), the component request and the statement request, each with the first error."""
    i = broken["error_component"]
    conds, concl = broken["conditions"], broken["conclusion"]
    statement = splice(conds, concl)
    err = check(statement)[0]
    start = component_spans(conds, concl)[i][0]
    tree, tree_ok = broken["trees"][i], original["trees"][i]
    rung = repair_ladder(tree, smallest_containing(tree, err.column - start))[0]
    declared = _declared(conds, i)
    codes = original["conditions"] + [original["conclusion"]]
    b_codes = conds + [concl]
    requests = [(RepairRequest("subtree", assemble(node_at(tree, rung)), err.message, declared),
                 assemble(node_at(tree_ok, rung))),
                (RepairRequest("component", b_codes[i], err.message, declared, broken["nl"][i]), codes[i]),
                (RepairRequest("statement", statement, err.message, nl=broken["nl_statement"]),
                 splice(original["conditions"], original["conclusion"]))]
    return [{"prompt": format_request(r), "target": " " + t, "kind": r.kind} for r, t in requests]


# -- the role models' texts -------------------------------------------------------------------------------------------
# Two prompt styles: `tiny`, the compact formats the CPU models are taught in code (one model taught every role,
# the role named first), and `llm`, instructions in the spirit of DSR's released prompts for instruction-tuned
# models at real scale (looprl's wording; the operator tree as DSR's JSON).
SEP = " <SEP> "


def opt_to_text(tree: dict[str, Any]) -> str:
    """The operator tree in the tiny formalizer's braced form: each node in braces, its slots replaced by its
    children; deleting the braces gives the assembled code (LeanLite has no braces)."""
    parts = tree["formal_content"].split(SLOT)
    out = "{" + parts[0]
    for child, rest in zip(tree.get("children") or [], parts[1:]):
        out += opt_to_text(child) + rest
    return out + "}"


def opt_from_text(text: str) -> dict[str, Any]:
    """Inverse of `opt_to_text`; TreeError on unbalanced braces or text outside the root."""
    text = text.strip()
    stack: list[dict[str, Any]] = []
    root: dict[str, Any] | None = None
    for ch in text:
        if ch == "{":
            if root is not None:
                raise TreeError(f"text after the root node in {text!r}")
            node = {"formal_content": "", "children": []}
            if stack:
                stack[-1]["formal_content"] += SLOT
                stack[-1]["children"].append(node)
            stack.append(node)
        elif ch == "}":
            if not stack:
                raise TreeError(f"unbalanced '}}' in {text!r}")
            node = stack.pop()
            if not stack:
                root = node
        elif stack:
            stack[-1]["formal_content"] += ch
        else:
            raise TreeError(f"text outside the tree in {text!r}")
    if stack or root is None:
        raise TreeError(f"unbalanced '{{' in {text!r}")
    return root


def decompose_prompt(nl_statement: str, style: str = "tiny") -> str:
    if style == "tiny":
        return f"DECOMPOSE {nl_statement} =>"
    return ("Decompose the mathematical statement into atomic conditions and one conclusion. One atomic fact per "
            "condition; declare every free variable with its domain; never split a quantifier from its predicate; "
            "a 'find' or 'for all' statement goes entirely into the conclusion; write 'No conditions' when there are "
            f"none.\nAnswer as:\nConditions:\n1. ...\n2. ...\nConclusion: ...\n\nStatement: {nl_statement}")


def decompose_target(conditions: list[str], conclusion: str) -> str:
    return " " + " ; ".join(conditions) + " || " + conclusion


def parse_decomposition(text: str, style: str = "tiny") -> tuple[list[str], str]:
    """(conditions, conclusion) from a decomposer's answer; ValueError when it names no conclusion."""
    if style == "tiny":
        if "||" not in text:
            raise ValueError(f"no '||' before the conclusion in {text!r}")
        conds, concl = text.split("||", 1)
        return [c.strip() for c in conds.split(" ; ") if c.strip()], concl.strip()
    m = re.search(r"Conclusion\s*:\s*(.+)", text)
    if not m:
        raise ValueError(f"no 'Conclusion:' in {text!r}")
    head = text[:m.start()]
    conds = [] if re.search(r"no conditions", head, re.I) else re.findall(r"^\s*\d+\.\s*(.+?)\s*$", head, re.M)
    return conds, m.group(1).strip()


def formalize_prompt(tag: str, nl: str, style: str = "tiny") -> str:
    """`tag`: condition | conclusion."""
    if style == "tiny":
        return f"FORMALIZE {tag} {nl} =>"
    return (f"Translate this {tag} of a theorem into a Lean 4 fragment ({'a binder such as (x : ℝ) or (h : …)' if tag == 'condition' else 'a proposition'}) "
            "and its operator tree: JSON nodes {\"formal_content\": text with <SLOT> placeholders, \"children\": "
            "[…]} whose slot filling spells the fragment exactly (keep parentheses as nodes).\nAnswer as:\n"
            f"```lean\n<fragment>\n```\n```json\n<tree>\n```\n\n{tag.capitalize()}: {nl}")


def formalize_target(code: str, tree: dict[str, Any] | None) -> str:
    return " " + code + SEP + opt_to_text(tree or {"formal_content": code, "children": []})


def parse_formalization(text: str, style: str = "tiny") -> tuple[str, dict[str, Any] | None]:
    """(code, tree) from a formalizer's answer, structure first: the code is the tree's assembly when the tree
    parses; otherwise the linear code with no tree (DSR's fallback)."""
    if style == "tiny":
        code, _, opt = text.partition(SEP.strip())
        code = code.strip()
        try:
            tree = opt_from_text(opt)
            return assemble(tree), tree
        except TreeError:
            return code, None
    import json
    lean = re.search(r"```lean\s*\n(.*?)```", text, re.S)
    code = (lean.group(1) if lean else text).strip()
    js = re.search(r"```json\s*\n(.*?)```", text, re.S)
    if js:
        try:
            tree = json.loads(js.group(1))
            return assemble(tree), tree
        except (ValueError, TreeError):
            pass
    return code, None


def judge_prompt(nl: str, code: str, style: str = "tiny") -> str:
    if style == "tiny":
        return f"JUDGE {nl} | {code} =>"
    return ("Grade how faithfully the Lean fragment states the condition: A (perfect match), B (minor "
            "inconsistency), C (major inconsistency or missing). Answer with the letter only.\n"
            f"Condition: {nl}\nLean: {code}")


def parse_grade(text: str) -> str:
    """The first of A, B, C the judge answers (anything else grades C)."""
    m = re.search(r"\b([ABC])\b", text)
    return m.group(1) if m else "C"


def statement_components(statement: str) -> tuple[list[str], str] | None:
    """The binders and the conclusion of a `theorem name binders… : conclusion := by sorry` statement (None when
    it does not read so): the judge pairs them with the decomposed NL."""
    m = re.match(r"^\s*theorem\s+\w+\s*(.*?)\s*:=\s*by\s+sorry\s*$", statement, re.S)
    if not m:
        return None
    body, binders, i = m.group(1), [], 0
    while i < len(body):
        if body[i].isspace():
            i += 1
        elif body[i] == "(":
            depth, j = 0, i
            while j < len(body):
                depth += {"(": 1, ")": -1}.get(body[j], 0)
                if depth == 0:
                    break
                j += 1
            if depth:
                return None
            binders.append(body[i:j + 1])
            i = j + 1
        elif body[i] == ":":
            return binders, body[i + 1:].strip()
        else:
            return None
    return None
