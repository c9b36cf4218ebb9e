"""DSR's model-free parts (rl/methods/dsr/README.md): the LeanLite checker (looprl's small typed expression
language standing in for Lean 4 where no toolchain is installed), operator-tree assembly, spans, the smallest
containing node, the repair ladder, splicing with hypothesis renaming, and LeanScorer's Sugeno aggregation."""

import pytest

from rl.methods.dsr.core import (
    TreeError,
    assemble,
    check,
    component_of_column,
    repair_ladder,
    replace_node,
    smallest_containing,
    spans,
    splice,
    sugeno_score,
)


def leaf(text):
    return {"formal_content": text, "children": []}


# x ^ 2 + abs(y) > 0, with a parenthesised wrapper around abs(y)
TREE = {"formal_content": "<SLOT> > <SLOT>", "children": [
    {"formal_content": "<SLOT> + <SLOT>", "children": [
        {"formal_content": "<SLOT> ^ <SLOT>", "children": [leaf("x"), leaf("2")]},
        {"formal_content": "(<SLOT>)", "children": [
            {"formal_content": "abs(<SLOT>)", "children": [leaf("y")]}]}]},
    leaf("0")]}
LINEAR = "x ^ 2 + (abs(y)) > 0"


def _errors(statement):
    return [(e.column, e.message) for e in check(statement)]


def test_leanlite_accepts_well_typed_statements():
    assert check("theorem test (x : Real) (h1 : x > 0) : x ^ 2 > 0 := by sorry") == []
    assert check("theorem test (n : Nat) : ∀ m : Nat, m + n ≥ n ∧ ¬ (n < 0) := by sorry") == []
    assert check("theorem test (x y : Real) (h : x ≤ y) : max(x, y) = y → sqrt(abs(x)) ≥ 0 := by sorry") == []


def test_leanlite_reports_each_error_at_its_column():
    s = "theorem test (x : Real) : sqrt(x, 2) > y := by sorry"
    assert _errors(s) == [(s.index("sqrt"), "function 'sqrt' expects 1 arguments, got 2"),
                          (s.index("y :="), "unknown identifier 'y'")]
    s = "theorem test (x : Real) (n : Nat) (h : x > n) : x > 0 := by sorry"
    assert _errors(s) == [(s.index("n) :"), "type mismatch in '>': Real and Nat")]
    s = "theorem test (n : Nat) : n + 1 ∧ n > 0 := by sorry"
    assert _errors(s) == [(s.index("n + 1"), "type mismatch: expected a Prop, got Nat")]
    s = "theorem test (x : Real) : x + > 1 := by sorry"
    assert _errors(s) == [(s.index("> 1"), "unexpected '>'")]
    s = "theorem test (n : Nat) : sqrt(n) > 0 := by sorry"
    assert _errors(s) == [(s.index("sqrt"), "sqrt expects a Real, got Nat")]
    assert _errors("theorem test (x : Real) : x > 0") == [(len("theorem test (x : Real) : x > 0"),
                                                             "expected ':= by sorry'")]


def test_assembling_the_tree_reproduces_the_linear_code():
    assert assemble(TREE) == LINEAR
    with pytest.raises(TreeError, match="2 slots but 1 children"):
        assemble({"formal_content": "<SLOT> + <SLOT>", "children": [leaf("x")]})


def test_spans_and_the_smallest_containing_node_is_the_deepest():
    sp = spans(TREE)
    assert sp[()] == (0, len(LINEAR))
    for path, (a, b) in sp.items():
        node = TREE
        for i in path:
            node = node["children"][i]
        assert LINEAR[a:b] == assemble(node)
    assert smallest_containing(TREE, LINEAR.index("y")) == (0, 1, 0, 0)  # the leaf y
    assert smallest_containing(TREE, LINEAR.index("abs")) == (0, 1, 0)
    assert smallest_containing(TREE, LINEAR.index(">")) == ()  # the root's own operator


def test_the_repair_ladder_climbs_from_the_parent_and_skips_wrappers():
    # the error at y: start at its parent abs(y); the wrapper (abs(y)) is skipped; then the sum, then the root
    assert repair_ladder(TREE, (0, 1, 0, 0)) == [(0, 1, 0), (0,), ()]
    assert repair_ladder(TREE, (0, 0, 1)) == [(0, 0), (0,), ()]
    assert repair_ladder(TREE, ()) == [()]
    fixed = replace_node(TREE, (0, 1, 0), "abs(z)")
    assert assemble(fixed) == "x ^ 2 + (abs(z)) > 0" and assemble(TREE) == LINEAR  # the original is untouched


def test_splicing_renames_hypotheses_and_maps_columns_to_components():
    conditions = ["(x : Real)", "(h : x > 0)", "(hx : x < 5)"]
    s = splice(conditions, "x ^ 2 < 25")
    assert s == "theorem test (x : Real) (h1 : x > 0) (h2 : x < 5) : x ^ 2 < 25 := by sorry"
    assert check(s) == []
    assert component_of_column(conditions, "x ^ 2 < 25", s.index("h2")) == 2
    assert component_of_column(conditions, "x ^ 2 < 25", s.index("25")) == 3  # the conclusion
    assert component_of_column(conditions, "x ^ 2 < 25", s.index("theorem")) == -1


@pytest.mark.parametrize("grades,score", [("AAB", 2 / 3), ("ABB", 1 / 3), ("AAC", 0.0), ("C", 0.0), ("AAA", 1.0),
                                          ("B", 0.0), ("ABBBB", 0.2)])
def test_sugeno_matches_hand_computed_cases(grades, score):
    # AAB: max(min(1, 2/3), min(0.5, 2/3 * 0.9)) = 0.667, a pass; ABB: max(min(1, 1/3), min(0.5, 1/3 * 0.6)) =
    # 0.333; a lone B: μ = (0 / 1) * 0.9 = 0; ABBBB: max(min(1, 1/5), min(0.5, 1/5 * max(1 - 0.8, 0))) = 0.2
    got = sugeno_score(list(grades))
    assert got == pytest.approx(score)
    assert (got >= 0.6) == (score >= 0.6)


# a conclusion "x ^ 2 + (abs(y)) > 0" over (x : Real): y is undeclared, the error sits at the leaf y
CONDITIONS = ["(x : Real)", "(h1 : x > 0)"]
NL = ["x is a real number", "x is positive", "x squared plus the absolute value of x is positive"]


class Recorder:
    """A test double of the repair model for the control flow alone (the effect run uses a taught model): it
    records every request and answers with `answers(request)` (by default the code unchanged: a repair that fails)."""

    def __init__(self, answers=None):
        self.requests, self.answers = [], answers or (lambda r: r.code)

    def __call__(self, request):
        self.requests.append(request)
        return self.answers(request)


def test_the_released_split_spends_one_call_locally_and_three_globally():
    from rl.methods.dsr.core import tree_guided_repair
    rec = Recorder()
    trace = tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL), rec, budget=4)
    # y is at (0, 1, 0, 0): one subtree repair at its parent abs(y) fails, then three statement-level rewrites
    assert [(r.kind, r.code) for r in rec.requests] == [("subtree", "abs(y)")] + [
        ("statement", splice(CONDITIONS, LINEAR))] * 3
    assert rec.requests[0].nl == "" and all(r.nl for r in rec.requests[1:])  # local repair sees no NL
    assert rec.requests[0].declared == "(x : Real) (h1 : x > 0)"
    assert len(trace.calls) == 4 and trace.errors == 1
    # a global rewrite that fixes the statement on the second global call ends the repair there
    fix = Recorder(lambda r: r.code.replace("abs(y)", "abs(x)") if r.kind == "statement" and len(fix.requests) > 2
                   else r.code)
    trace = tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL), fix, budget=4)
    assert [r.kind for r in fix.requests] == ["subtree", "statement", "statement"] and trace.errors == 0


def test_failed_repairs_climb_node_parent_grandparent_component_statement_when_local_calls_allow():
    from rl.methods.dsr.core import tree_guided_repair
    rec = Recorder()
    trace = tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL), rec, budget=4,
                               local_calls=3)
    # its parent abs(y), then (wrapper skipped) the sum, then the global call kept for last
    assert [(r.kind, r.code) for r in rec.requests] == [
        ("subtree", "abs(y)"), ("subtree", "x ^ 2 + (abs(y))"), ("subtree", LINEAR), ("statement", splice(CONDITIONS, LINEAR))]
    assert all(r.nl == "" for r in rec.requests[:3]) and rec.requests[3].nl
    assert len(trace.calls) == 4 and trace.errors == 1
    rec = Recorder()
    tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL), rec, budget=8, local_calls=7)
    # with room: the root, then the component with its NL, then global rewrites until the budget is spent
    assert [r.kind for r in rec.requests] == ["subtree"] * 3 + ["component"] + ["statement"] * 4
    assert rec.requests[3].nl == NL[2]


def test_a_local_fix_is_kept_and_followed_by_the_mandatory_global_check():
    from rl.methods.dsr.core import tree_guided_repair
    rec = Recorder(lambda r: "abs(x)" if r.code == "abs(y)" else r.code)
    trace = tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL), rec, budget=4)
    assert [r.kind for r in rec.requests] == ["subtree", "statement"]
    assert trace.errors == 0 and trace.statement == splice(CONDITIONS, "x ^ 2 + (abs(x)) > 0")
    assert trace.calls[0]["accepted"] and trace.calls[1]["errors_after"] == 0


def test_global_repair_keeps_a_rewrite_only_when_it_has_fewer_errors():
    from rl.methods.dsr.core import global_repair
    broken = splice(CONDITIONS, LINEAR)
    worse = "theorem test (x : Real) : y + z > w := by sorry"  # three errors instead of one: never kept
    rec = Recorder(lambda r: worse)
    trace = global_repair(broken, " ".join(NL), rec, budget=4)
    assert len(rec.requests) == 4 and trace.statement == broken and not any(c["accepted"] for c in trace.calls)
    rec = Recorder(lambda r: r.code.replace("abs(y)", "abs(x)"))
    trace = global_repair(broken, " ".join(NL), rec, budget=4)
    assert len(rec.requests) == 1 and trace.errors == 0


def test_generated_statements_compile_their_trees_spell_them_and_injected_errors_land_in_one_component():
    import random

    from rl.methods.dsr.core import inject_local_error, random_statement
    rng = random.Random(0)
    for _ in range(200):
        item = random_statement(rng)
        codes = item["conditions"] + [item["conclusion"]]
        assert check(splice(item["conditions"], item["conclusion"])) == []
        assert all(t is None or assemble(t) == c for t, c in zip(item["trees"], codes))
        assert len(item["nl"]) == len(codes) and item["nl_statement"].startswith("Let ")
        broken = inject_local_error(item, rng)
        i = broken["error_component"]
        errors = check(splice(broken["conditions"], broken["conclusion"]))
        assert errors and {component_of_column(broken["conditions"], broken["conclusion"], e.column)
                           for e in errors} == {i}
        b_codes = broken["conditions"] + [broken["conclusion"]]
        assert [c for k, c in enumerate(b_codes) if k != i] == [c for k, c in enumerate(codes) if k != i]
        assert assemble(broken["trees"][i]) == b_codes[i]


def test_repair_examples_teach_the_fix_at_each_level():
    import random

    from rl.methods.dsr.core import inject_local_error, random_statement, repair_examples
    rng = random.Random(1)
    for _ in range(50):
        item = random_statement(rng)
        broken = inject_local_error(item, rng)
        rows = repair_examples(item, broken)
        assert [r["kind"] for r in rows] == ["subtree", "component", "statement"]
        subtree, component, statement = rows
        assert subtree["prompt"].startswith("SUBTREE ") and "| VARS (x : Real)" in subtree["prompt"]
        assert "NL " in component["prompt"] and "NL Let " in statement["prompt"]
        # the statement target is the original, which compiles; the subtree target spliced back in fixes it too
        assert statement["target"].strip() == splice(item["conditions"], item["conclusion"])
        assert check(statement["target"].strip()) == []
        i = broken["error_component"]
        fixed = (broken["conditions"] + [broken["conclusion"]])[:]
        fixed[i] = (item["conditions"] + [item["conclusion"]])[i]
        assert component["target"].strip() == fixed[i]
        snippet = subtree["prompt"][len("SUBTREE "):subtree["prompt"].index(" | ERROR")]
        broken_code = (broken["conditions"] + [broken["conclusion"]])[i]
        assert snippet != subtree["target"].strip() and snippet in broken_code
        if broken_code.count(snippet) == 1:  # the fix of the snippet is the fix of the component
            assert broken_code.replace(snippet, subtree["target"].strip()) == fixed[i]


# -- the role models' formats, the task and the batched driver ---------------------------------------------------------
def test_the_braced_tree_spells_the_code_and_round_trips():
    from rl.methods.dsr.core import opt_from_text, opt_to_text
    text = opt_to_text(TREE)
    assert text == "{{{{x} ^ {2}} + {({abs({y})})}} > {0}}"
    assert text.replace("{", "").replace("}", "") == assemble(TREE) and opt_from_text(text) == TREE
    for bad in ("{x + {2}", "{x} + {2}", "x", "{x}}"):
        with pytest.raises(TreeError):
            opt_from_text(bad)


def test_formalizer_answers_are_assembled_structure_first_with_the_linear_fallback():
    from rl.methods.dsr.core import formalize_target, parse_formalization
    code, tree = parse_formalization(formalize_target(assemble(TREE), TREE))
    assert code == assemble(TREE) and tree == TREE
    # the tree wins over a linear code that disagrees with it (DSR assembles from the tree)
    assert parse_formalization(" x > 1 <SEP> {{x} > {2}}")[0] == "x > 2"
    assert parse_formalization(" x > 1 <SEP> {{x} > {2}")[0:2] == ("x > 1", None)
    llm = 'Here:\n```lean\n(h : x > 0)\n```\n```json\n{"formal_content": "(h : <SLOT>)", "children": [' \
          '{"formal_content": "<SLOT> > <SLOT>", "children": [{"formal_content": "x", "children": []}, ' \
          '{"formal_content": "0", "children": []}]}]}\n```'
    assert parse_formalization(llm, "llm")[0] == "(h : x > 0)" and parse_formalization(llm, "llm")[1] is not None
    assert parse_formalization("```lean\n(h : x > 0)\n```", "llm") == ("(h : x > 0)", None)


def test_decompositions_and_statements_read_back():
    from rl.methods.dsr.core import decompose_target, parse_decomposition, statement_components
    assert parse_decomposition(decompose_target(["x is a real number", "x is at least 2"], "x squared is at least 4")) \
        == (["x is a real number", "x is at least 2"], "x squared is at least 4")
    with pytest.raises(ValueError):
        parse_decomposition("x is a real number ; x is at least 2")
    llm = "Conditions:\n1. x is a real number\n2. x > 2\nConclusion: x ^ 2 > 4"
    assert parse_decomposition(llm, "llm") == (["x is a real number", "x > 2"], "x ^ 2 > 4")
    assert parse_decomposition("Conditions:\nNo conditions\nConclusion: 1 + 1 = 2", "llm") == ([], "1 + 1 = 2")
    statement = splice(CONDITIONS, LINEAR)
    assert statement_components(statement) == (CONDITIONS, LINEAR)
    assert statement_components("theorem test (x : Real) x > 0 := by sorry") is None
    assert statement_components("theorem test (x : Real : x > 0 := by sorry") is None


def _lookup_repairer(rows):
    """Not a model: the task's own supervised answers looked up by prompt (the driver under test, not a repairer);
    an unknown prompt gets its code back unchanged."""
    table = {r["prompt"]: r["target"].strip() for r in rows}

    def repair(request):
        from rl.methods.dsr.core import format_request
        return table.get(format_request(request), request.code)
    return repair


def test_repairs_run_in_lockstep_batches_give_the_traces_of_one_at_a_time():
    import random

    from rl.methods.dsr.core import (
        drive_batched,
        global_repair_steps,
        inject_local_error,
        random_statement,
        repair_examples,
        tree_guided_repair,
        tree_guided_repair_steps,
    )
    rng = random.Random(3)
    items = [random_statement(rng, n_hyps=1) for _ in range(12)]
    broken = [inject_local_error(it, rng) for it in items]
    repair = _lookup_repairer([r for it, b in zip(items, broken) for r in repair_examples(it, b)])
    one = [tree_guided_repair(b["conditions"], b["conclusion"], b["trees"], b["nl"], b["nl_statement"], repair,
                              rng=random.Random(k)) for k, b in enumerate(broken)]
    sizes = []

    def batch(requests):
        sizes.append(len(requests))
        return [repair(r) for r in requests]
    many = drive_batched([tree_guided_repair_steps(b["conditions"], b["conclusion"], b["trees"], b["nl"],
                                                   b["nl_statement"], rng=random.Random(k))
                          for k, b in enumerate(broken)], batch)
    assert [t.statement for t in many] == [t.statement for t in one]
    assert [t.calls for t in many] == [t.calls for t in one]
    assert sizes[0] == 12 and max(len(t.calls) for t in one) == len(sizes) <= 4  # one batch per round
    # the subtree answers of the table fix every statement locally, and the last call is the global re-check
    assert all(t.errors == 0 and t.calls[0]["kind"] == "subtree" and t.calls[-1]["kind"] == "statement" for t in one)
    globals_ = drive_batched([global_repair_steps(splice(b["conditions"], b["conclusion"]), b["nl_statement"])
                              for b in broken], batch)
    assert all(t.errors == 0 and len(t.calls) == 1 for t in globals_)


def test_the_dsr_task_teaches_every_role_on_distinct_statements(tmp_path):
    import collections
    import json
    import random

    from models.tiny import build_tiny_tokenizer
    from rl.methods.dsr.task import dsr_task, perturb
    paths = dsr_task(tmp_path, num_train=40, num_eval=10, sft_fraction=0.5, seed=0, n_hyps=1)
    sft, train, evals = ([json.loads(x) for x in open(paths[s])] for s in ("sft", "train", "eval"))
    roles = collections.Counter(r["role"] for r in sft)
    assert set(roles) == {"decomposer", "formalizer", "judge", "repairer:subtree", "repairer:component",
                          "repairer:statement", "repairer:recheck"}
    assert roles["decomposer"] == 20 and roles["formalizer"] == 20 * 4 and len(train) == 20 * 4
    tok = build_tiny_tokenizer(dsr_task.added_tokens)
    assert all(tok.unk_token_id not in tok(r["prompt"] + r["target"])["input_ids"] for r in sft)
    assert len({r["answer"] for r in evals}) == 10 and not {r["answer"] for r in evals} & {
        r["target"].strip() for r in sft if r["role"] == "repairer:statement"}
    for r in evals:
        assert check(r["answer"]) == [] and check(splice(r["broken"]["conditions"], r["broken"]["conclusion"]))
    rng = random.Random(0)
    assert perturb("(h : x + 1 > y)", "B", rng) == "(h : x + 1 ≥ y)"
    c = perturb("(h : x + 1 > y)", "C", rng)
    assert c != "(h : x + 1 > y)" and c.startswith("(h : ") and check(splice(["(x : Real)", "(y : Real)", c], "x > 0")) == []
    assert perturb("(x : Real)", "C", rng) == "(x : Nat)" and perturb("(x : Real)", "B", rng) is None


def test_sugeno_with_this_measure_is_the_share_of_a_grades_unless_a_c_appears():
    """Every grading of one to five conditions: μ of the α = 0.5 set never exceeds μ of the α = 1 set (as many A's,
    times a penalty of at most 1), so the integral is #A / n, and 0 with any C (also for no conditions at all)."""
    from itertools import product
    assert sugeno_score([]) == 0.0 and sugeno_score(["A"]) == 1.0
    for n in range(1, 6):
        for grades in product("ABC", repeat=n):
            want = 0.0 if "C" in grades else grades.count("A") / n
            assert sugeno_score(list(grades)) == pytest.approx(want), grades


def test_malformed_tree_nodes_are_refused_as_tree_errors():
    with pytest.raises(TreeError, match="not an operator-tree node"):
        assemble({"children": []})
    with pytest.raises(TreeError, match="not an operator-tree node"):
        assemble("x + y")
    with pytest.raises(TreeError, match="not an operator-tree node"):
        assemble({"formal_content": "abs(<SLOT>)", "children": ["y"]})


def test_columns_between_nodes_and_components_belong_to_the_enclosing_one():
    # the space after the leaf x belongs to "x ^ 2", not to x; the space after a condition to the frame
    assert smallest_containing(TREE, LINEAR.index(" ^")) == (0, 0)
    conditions = ["(x : Real)", "(h : x > 0)"]
    s = splice(conditions, "x > 1")
    assert component_of_column(conditions, "x > 1", s.index(") (") + 1) == -1
    assert component_of_column(conditions, "x > 1", s.index(" : x > 1")) == -1
    assert splice([], "1 > 0") == "theorem test : 1 > 0 := by sorry" and check(splice([], "1 > 0")) == []
    assert component_of_column([], "1 > 0", splice([], "1 > 0").index("1 > 0")) == 0


def test_a_replaced_node_is_a_leaf_holding_the_repair():
    assert replace_node(TREE, (0, 1, 0), "abs(z)")["children"][0]["children"][1] == {
        "formal_content": "(<SLOT>)", "children": [{"formal_content": "abs(z)", "children": []}]}
    assert replace_node(TREE, (), "x > 0") == {"formal_content": "x > 0", "children": []}


def test_a_local_fix_holds_when_the_first_error_left_is_outside_the_edit_and_errors_did_not_grow():
    from rl.methods.dsr.core import LeanLiteError, local_fix_holds

    def errs(*columns):
        return [LeanLiteError(c, "e") for c in columns]
    assert local_fix_holds(errs(10), [], 10, 5)  # compiles
    assert not local_fix_holds(errs(10), errs(10), 10, 5)  # the edit's first column
    assert not local_fix_holds(errs(10), errs(14), 10, 5)  # its last
    assert local_fix_holds(errs(10), errs(15), 10, 5)  # just past it
    assert local_fix_holds(errs(10), errs(9), 10, 5)  # before it
    assert not local_fix_holds(errs(10), errs(10), 10, 0)  # an empty edit still covers its own column
    assert local_fix_holds(errs(10), errs(11), 10, 0)
    assert local_fix_holds(errs(10, 30), errs(20, 30), 10, 5)  # as many errors as before: partial success
    assert not local_fix_holds(errs(10), errs(20, 30), 10, 5)  # more errors: refused


def test_each_call_is_recorded_with_what_it_changed():
    from rl.methods.dsr.core import NO_ERRORS, tree_guided_repair
    rec = Recorder(lambda r: "abs(x)" if r.code == "abs(y)" else r.code)
    trace = tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL), rec, budget=4)
    broken, fixed = splice(CONDITIONS, LINEAR), splice(CONDITIONS, "x ^ 2 + (abs(x)) > 0")
    assert trace.calls == [
        {"kind": "subtree", "component": 2, "node": [0, 1, 0], "code": "abs(y)", "fixed": "abs(x)", "accepted": True,
         "errors_after": 0},
        {"kind": "statement", "code": fixed, "fixed": fixed, "accepted": False, "errors_after": 0}]  # as many: coin
    assert rec.requests[0].error == "unknown identifier 'y'"
    assert rec.requests[1].error == NO_ERRORS and rec.requests[1].nl == " ".join(NL)
    # a subtree fix whose first error stays inside the repaired node is refused, and recorded as such
    rec = Recorder(lambda r: "abs(w)" if r.code == "abs(y)" else r.code)
    trace = tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL), rec, budget=2)
    assert trace.calls[0] == {"kind": "subtree", "component": 2, "node": [0, 1, 0], "code": "abs(y)",
                              "fixed": "abs(w)", "accepted": False, "errors_after": 1}
    assert trace.calls[1] == {"kind": "statement", "code": broken, "fixed": broken, "accepted": False,
                              "errors_after": 1}
    assert trace.statement == broken and trace.errors == 1


def test_components_without_a_tree_or_whose_tree_no_longer_spells_them_are_repaired_whole():
    from rl.methods.dsr.core import tree_guided_repair
    conditions = ["(x : Real)", "(h : y > 0)", "(h : x < 5)"]  # y undeclared in the second condition
    nl = ["x is real", "y is positive", "x is below 5", "x is at most 9"]
    stale = {"formal_content": "<SLOT> > <SLOT>", "children": [leaf("z"), leaf("0")]}  # spells "z > 0"
    for trees in ([None, None, None, None], [None, stale, None, None], [None, "not a tree", None, None]):
        rec = Recorder(lambda r: "(h1 : x > 0)" if r.kind == "component" else r.code)
        trace = tree_guided_repair(conditions, "x ≤ 9", trees, nl, " ".join(nl), rec, budget=4)
        first = rec.requests[0]
        assert (first.kind, first.code, first.nl) == ("component", "(h1 : y > 0)", "y is positive")
        assert first.error == "unknown identifier 'y'" and first.declared == "(x : Real)"
        assert trace.errors == 0 and trace.statement == splice(["(x : Real)", "(h1 : x > 0)", "(h : x < 5)"], "x ≤ 9")
        assert [r.kind for r in rec.requests] == ["component", "statement"] and trace.calls[0]["node"] is None
    # with a tree: the subtree request carries the declarations before its component only
    tree = {"formal_content": "(h1 : <SLOT>)", "children": [
        {"formal_content": "<SLOT> > <SLOT>", "children": [leaf("y"), leaf("0")]}]}
    rec = Recorder()
    tree_guided_repair(conditions, "x ≤ 9", [None, tree, None, None], nl, " ".join(nl), rec, budget=4)
    assert (rec.requests[0].kind, rec.requests[0].code, rec.requests[0].declared) == ("subtree", "y > 0",
                                                                                      "(x : Real)")


def test_the_budget_and_the_local_share_default_to_the_released_four_and_one():
    from rl.methods.dsr.core import drive, global_repair, tree_guided_repair, tree_guided_repair_steps
    rec = Recorder()
    trace = tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL), rec)
    assert [r.kind for r in rec.requests] == ["subtree"] + ["statement"] * 3 and len(trace.calls) == 4
    rec = Recorder()
    drive(tree_guided_repair_steps(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL)), rec)
    assert [r.kind for r in rec.requests] == ["subtree"] + ["statement"] * 3
    rec = Recorder()
    global_repair(splice(CONDITIONS, LINEAR), "the NL", rec)
    assert len(rec.requests) == 4 and all(r.nl == "the NL" for r in rec.requests)
    # the last call of the budget is always global, whatever the local share asks for
    rec = Recorder()
    tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, " ".join(NL), rec, budget=2, local_calls=7)
    assert [r.kind for r in rec.requests] == ["subtree", "statement"]


def test_statements_that_compile_cost_no_call_and_frame_errors_go_straight_to_global_repair():
    from rl.methods.dsr.core import (
        drive_batched,
        global_repair_steps,
        tree_guided_repair,
        tree_guided_repair_steps,
    )
    good = ["(x : Real)", "(h1 : x > 0)"]
    rec = Recorder()
    trace = tree_guided_repair(good, "x ^ 2 > 0", [None, None, None], NL, " ".join(NL), rec)
    assert rec.requests == [] and trace.calls == [] and trace.errors == 0
    traces = drive_batched([tree_guided_repair_steps(good, "x ^ 2 > 0", [None, None, None], NL, "nl"),
                            global_repair_steps(splice(CONDITIONS, LINEAR), "nl")], lambda rs: [r.code for r in rs])
    assert [len(t.calls) for t in traces] == [0, 4] and traces[0].statement == splice(good, "x ^ 2 > 0")
    with pytest.raises(ValueError, match="repair_batch returned 0 fixes for 1 requests"):
        drive_batched([global_repair_steps(splice(CONDITIONS, LINEAR), "nl")], lambda rs: [])
    # an empty conclusion: the error sits on the frame (':='), no component holds it
    rec = Recorder()
    trace = tree_guided_repair(good, "", [None, None, None], NL, " ".join(NL), rec)
    assert [r.kind for r in rec.requests] == ["statement"] * 4 and trace.errors == 1


def test_the_first_condition_is_a_component_like_any_other():
    from rl.methods.dsr.core import tree_guided_repair
    rec = Recorder(lambda r: "(x : Real)" if r.kind == "component" else r.code)
    trace = tree_guided_repair(["(x : Reel)"], "x > 0", [None, None], ["x is real", "x is positive"], "nl", rec)
    assert (rec.requests[0].kind, rec.requests[0].code, rec.requests[0].declared) == ("component", "(x : Reel)", "")
    assert trace.errors == 0


def test_a_rewrite_with_as_many_errors_is_kept_on_a_coin_flip_of_the_given_rng():
    """Global repair keeps a rewrite with fewer errors always, one with as many when the rng's draw is below 0.5
    (the default rng is `random.Random(0)`, whose first draw, 0.84, refuses it), one with more never."""
    import random

    from rl.methods.dsr.core import drive, global_repair, global_repair_steps, tree_guided_repair
    broken = splice(CONDITIONS, LINEAR)
    other = splice(CONDITIONS, "x ^ 2 + (abs(z)) > 0")  # another undeclared name: as many errors
    keeps = next(s for s in range(100) if random.Random(s).random() < 0.5)
    rec = Recorder(lambda r: other)
    assert global_repair(broken, "nl", rec, budget=1).statement == broken
    assert global_repair(broken, "nl", rec, budget=1, rng=random.Random(keeps)).statement == other
    assert drive(global_repair_steps(broken, "nl", budget=1), rec).statement == broken
    assert drive(global_repair_steps(broken, "nl", budget=1, rng=random.Random(keeps)), rec).statement == other
    local = Recorder(lambda r: other if r.kind == "statement" else r.code)
    assert tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, "nl", local, budget=2).statement == broken
    assert tree_guided_repair(CONDITIONS, LINEAR, [None, None, TREE], NL, "nl", local, budget=2,
                              rng=random.Random(keeps)).statement == other


def test_global_requests_name_the_first_three_errors():
    from rl.methods.dsr.core import global_repair
    statement = "theorem test (x : Real) : a + b + c + d > x := by sorry"
    rec = Recorder()
    global_repair(statement, "nl", rec, budget=1)
    assert rec.requests[0].error == ("unknown identifier 'a'; unknown identifier 'b'; unknown identifier 'c'")


def test_after_a_local_success_the_next_error_of_the_component_gets_its_own_ladder():
    from rl.methods.dsr.core import tree_guided_repair
    two = {"formal_content": "<SLOT> > <SLOT>", "children": [
        {"formal_content": "<SLOT> + <SLOT>", "children": [
            {"formal_content": "abs(<SLOT>)", "children": [leaf("y")]},
            {"formal_content": "abs(<SLOT>)", "children": [leaf("z")]}]}, leaf("0")]}
    conclusion = "abs(y) + abs(z) > 0"
    rec = Recorder(lambda r: {"abs(y)": "abs(x)", "abs(z)": "abs(x)"}.get(r.code, r.code))
    trace = tree_guided_repair(CONDITIONS, conclusion, [None, None, two], NL, " ".join(NL), rec, local_calls=3)
    assert [(r.kind, r.code) for r in rec.requests] == [("subtree", "abs(y)"), ("subtree", "abs(z)"),
                                                        ("statement", splice(CONDITIONS, "abs(x) + abs(x) > 0"))]
    assert [c["node"] for c in trace.calls[:2]] == [[0, 0], [0, 1]] and trace.errors == 0
