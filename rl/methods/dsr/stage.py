"""The `dsr` stage: DSR (rl/methods/dsr/README.md, confirmed from the released code) as an evaluation
stage. Its four models are engine actors, each a `reward.judges` entry named in `roles` (one model may serve
several roles; a null `model_path` is the run's policy after its earlier stages):

1. decomposer: the NL statement → atomic conditions and one conclusion;
2. formalizer: each component → a fragment and its operator tree; structure-first assembly (the tree's slot filling,
   the linear code when the tree does not parse), hypotheses renamed h1, h2, …, spliced into `theorem test … :=
   by sorry`;
3. the compiler (`compiler`): `leanlite`, looprl's own typed expression language with a real checker (`rl.methods.dsr.core`;
   LABELLED: it stands in for Lean 4 + Mathlib where no toolchain is installed, as on the CPU machines), or `lean`
   (`lake env lean` in `lean_project`, a Lean 4 + Mathlib project, with `import Mathlib` prepended);
4. repairer: tree-guided repair within `budget` calls (`rl.methods.dsr.core.tree_guided_repair_steps`) and, as the control at
   the same budget, statement-level global repair; all statements are repaired in lockstep, one engine batch per
   round (`rl.methods.dsr.core.drive_batched`);
5. judge: LeanScorer's consistency check: each decomposed condition (and the conclusion) graded A/B/C against the
   formal component at its position, aggregated by the Sugeno integral (pass ≥ 0.6). LeanScorer decomposes the NL
   with its own model; here the decomposer's answer is reused.

Inputs: `from_nl` runs the whole pipeline on each held-out statement (`prompt`: the NL; `answer`: a reference
statement when there is one); `from_broken` repairs the held-out rows' `broken` statements (the synthetic `dsr`
task injects one local error per statement; the paper's SC-vs-CC comparison), scoring compile rate (SC), the judge's
pass rate (CC) and, against the reference, `kept` (every component the error did not touch unchanged) and `exact`.
Held-out rows come from the data's eval split, or from a PRIME file (`prime_path`: DSR's `benchmark/prime.json`,
156 items). Report: `stages/<name>/dsr.json`, with per-item traces.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rl.data import prompt_row_columns
from rl.methods.dsr import core as dsr
from rl.registry import register, register_alias
from rl.stages import Stage, StageContext, StageError, say, stage_cfg

ROLES = ("decomposer", "formalizer", "repairer", "judge")
MODES = ("tree", "global")
PRIME_FIELDS = ("informal_statement", "formal_statement")


def load_prime(path: str | Path) -> list[dict[str, Any]]:
    """DSR's PRIME benchmark (`benchmark/prime.json`: a JSON list of items with textbook, domain, theorem_index,
    informal_statement, formal_statement, informal_proof) as held-out rows {prompt, answer, metadata}."""
    p = Path(path)
    try:
        items = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise StageError(f"prime_path {str(p)!r}: not a readable JSON file ({e})") from e
    if not isinstance(items, list):
        raise StageError(f"prime_path {str(p)!r}: expected a JSON list of items, got {type(items).__name__}")
    rows = []
    for i, item in enumerate(items):
        missing = [k for k in PRIME_FIELDS if not isinstance(item, dict) or not isinstance(item.get(k), str)]
        if missing:
            raise StageError(f"prime_path {str(p)!r}: item {i} lacks {missing}")
        formal = item["formal_statement"]
        if "theorem" not in formal or "sorry" not in formal:
            raise StageError(f"prime_path {str(p)!r}: item {i}'s formal_statement is not a `theorem … sorry`")
        rows.append({"prompt": item["informal_statement"], "answer": formal,
                     "metadata": {k: item.get(k) for k in ("textbook", "domain", "theorem_index")}})
    return rows


class LeanCompiler:
    """Lean 4 + Mathlib as the checker: `lake env lean --json` on the statement with `import Mathlib`, run in
    `project` (a Lake project that depends on Mathlib); errors of severity `error`, with the column counted in the
    statement (the import line removed), first first."""

    def __init__(self, project: str, timeout_s: float = 300.0):
        import shutil
        if shutil.which("lake") is None or shutil.which("lean") is None:
            raise StageError("compiler: lean needs `lean` and `lake` on PATH (a Lean 4 toolchain with Mathlib); "
                             "use compiler: leanlite on machines without one")
        if not Path(project, "lakefile.lean").exists() and not Path(project, "lakefile.toml").exists():
            raise StageError(f"lean_project {project!r}: no lakefile.lean or lakefile.toml (a Lake project "
                             "depending on Mathlib)")
        self.project, self.timeout_s = project, timeout_s

    def __call__(self, statement: str) -> list[dsr.LeanLiteError]:
        header = "import Mathlib\n"
        with tempfile.NamedTemporaryFile("w", suffix=".lean", dir=self.project, delete=False) as f:
            f.write(header + statement + "\n")
        try:
            proc = subprocess.run(["lake", "env", "lean", "--json", f.name], cwd=self.project, capture_output=True,
                                  text=True, timeout=self.timeout_s)
        finally:
            Path(f.name).unlink(missing_ok=True)
        errors = []
        for line in proc.stdout.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("severity") != "error":
                continue
            pos = msg.get("pos") or {}
            lines = statement.split("\n")
            row = max(int(pos.get("line", 2)) - 2, 0)  # the import is line 1
            column = sum(len(x) + 1 for x in lines[:row]) + int(pos.get("column", 0))
            errors.append(dsr.LeanLiteError(column, str(msg.get("data", "")).strip()))
        if proc.returncode != 0 and not errors:
            errors.append(dsr.LeanLiteError(0, (proc.stderr or proc.stdout).strip()[-500:] or "lean failed"))
        return sorted(errors, key=lambda e: e.column)


@register("stage", "dsr")
class DSRStage(Stage):
    reads, publishes = ("policy",), ("autoformalize_report",)  # checked against the recipe's order
    config_keys = ("data", "reward", "trainer.eval_max_prompts")
    runs_in_driver = True

    def __init__(self, roles: dict[str, str] | None = None, prompt_style: str = "tiny",
                 compiler: str = "leanlite", lean_project: str | None = None, inputs: list[str] = ("from_nl",),
                 modes: list[str] = MODES, budget: int = 4, prime_path: str | None = None, seed: int = 0,
                 examples: int = 3, local_calls: int = 1):
        """`roles`: {decomposer, formalizer, repairer, judge} → a `reward.judges` entry each; `prompt_style`:
        tiny (the formats the CPU model is taught) | llm (instructions for instruction-tuned models); `compiler`:
        leanlite | lean (with `lean_project`); `inputs`: of from_nl, from_broken; `modes`: repair arms, of tree
        (DSR) and global (the control); `budget`: repair-model calls per statement (DSR: 4); `local_calls`: how
        many of them tree-guided repair may spend on local (subtree and component) repairs before the global ones
        (the released code: 1 of 4); `seed`: the global repair's accept-on-tie coin."""
        roles = dict(roles or {})
        missing = [r for r in ROLES if r not in roles]
        if missing:
            raise ValueError(f"dsr: roles needs a reward.judges entry for each of {list(ROLES)}; "
                             f"missing {missing}")
        if prompt_style not in ("tiny", "llm"):
            raise ValueError(f"dsr: prompt_style must be tiny or llm, got {prompt_style!r}")
        if compiler not in ("leanlite", "lean"):
            raise ValueError(f"dsr: compiler must be leanlite or lean, got {compiler!r}")
        if compiler == "lean" and not lean_project:
            raise ValueError("dsr: compiler: lean needs lean_project (a Lake project with Mathlib)")
        bad = [m for m in modes if m not in MODES] + [i for i in inputs if i not in ("from_nl", "from_broken")]
        if bad or not modes or not inputs:
            raise ValueError(f"dsr: modes must be among {list(MODES)} and inputs among "
                             f"['from_nl', 'from_broken'], got {list(modes)} and {list(inputs)}")
        if budget < 1:
            raise ValueError(f"dsr: budget must be ≥ 1 repair call, got {budget}")
        if not 0 <= local_calls < budget:
            raise ValueError(f"dsr: local_calls must be in 0..budget-1 (one call stays for the global repair), "
                             f"got {local_calls} with budget {budget}")
        self.local_calls = local_calls
        self.roles, self.style, self.compiler, self.lean_project = roles, prompt_style, compiler, lean_project
        self.inputs, self.modes, self.budget = list(inputs), list(modes), budget
        self.prime_path, self.seed, self.examples = prime_path, seed, examples

    # -- the pipeline --------------------------------------------------------------------------------------------
    def formalize(self, rows: list[dict[str, Any]], ask: dict[str, Any]) -> list[dict[str, Any]]:
        """Decompose, formalize and assemble each row's NL statement: {nl, conditions_nl, conclusion_nl,
        conditions, conclusion, trees, statement} (a decomposition that does not parse: no components)."""
        answers = ask["decomposer"]([dsr.decompose_prompt(r["prompt"], self.style) for r in rows])
        drafts, prompts = [], []
        for row, answer in zip(rows, answers):
            try:
                conds, concl = dsr.parse_decomposition(answer, self.style)
            except ValueError:
                conds, concl = [], ""
            if not concl:  # no conclusion: nothing to formalize (the statement stays empty and fails to compile)
                conds = []
            drafts.append({"nl": row["prompt"], "conditions_nl": conds, "conclusion_nl": concl})
            prompts += [dsr.formalize_prompt("condition", c, self.style) for c in conds]
            prompts += [dsr.formalize_prompt("conclusion", concl, self.style)] if concl else []
        outs = iter(ask["formalizer"](prompts))
        for d in drafts:
            parts = [dsr.parse_formalization(next(outs), self.style)
                     for _ in d["conditions_nl"] + ([d["conclusion_nl"]] if d["conclusion_nl"] else [])]
            conds = dsr.rename_hypotheses([c for c, _ in parts[:-1]]) if parts else []
            trees = [t for _, t in parts]
            for i, t in enumerate(trees[:len(conds)]):  # the tree spells the renamed binder too
                if t is not None and dsr.is_wrapper(t) and t["formal_content"].startswith("(h"):
                    t["formal_content"] = conds[i].split(":", 1)[0] + ": <SLOT>)"
            concl = parts[-1][0] if parts else ""
            d.update(conditions=conds, conclusion=concl, trees=trees,
                     statement=dsr.splice(conds, concl) if parts else "")
        return drafts

    def judge(self, drafts: list[dict[str, Any]], statements: list[str], ask: dict[str, Any]) -> list[float]:
        """LeanScorer's score per statement: each decomposed component graded against the formal component at its
        position (a missing one grades C), Sugeno-aggregated."""
        prompts, owners, grades = [], [], [[] for _ in drafts]
        for k, (d, st) in enumerate(zip(drafts, statements)):
            comps = dsr.statement_components(st)
            nls = d["conditions_nl"] + [d["conclusion_nl"]]
            codes = (comps[0] + [comps[1]]) if comps and len(comps[0]) == len(nls) - 1 else None
            if codes is None or not d["conclusion_nl"]:
                grades[k] = ["C"]
                continue
            for nl, code in zip(nls, codes):
                prompts.append(dsr.judge_prompt(nl, code, self.style))
                owners.append(k)
        for k, answer in zip(owners, ask["judge"](prompts) if prompts else []):
            grades[k].append(dsr.parse_grade(answer))
        return [dsr.sugeno_score(g) for g in grades]

    def repair(self, items: list[dict[str, Any]], mode: str, ask: dict[str, Any], check: Any) -> list[dsr.RepairTrace]:
        rng = random.Random(self.seed)
        procs = []
        for it in items:
            if mode == "tree" and it["conditions"] is not None:
                procs.append(dsr.tree_guided_repair_steps(it["conditions"], it["conclusion"], it["trees"],
                                                          it["nl_components"], it["nl"], self.budget, rng, check,
                                                          local_calls=self.local_calls))
            else:
                procs.append(dsr.global_repair_steps(it["statement"], it["nl"], self.budget, rng, check))
        return dsr.drive_batched(procs, lambda reqs: [s.strip() for s in ask["repairer"](
            [dsr.format_request(r, self.style) for r in reqs])])

    def run(self, ctx: StageContext) -> dict[str, str]:
        from rl.config import as_container
        cfg = stage_cfg(ctx)
        unknown = sorted({j for j in self.roles.values() if j not in cfg.reward.judges})
        if unknown:
            raise StageError(f"{ctx.name}: roles name {unknown}, not reward.judges entries ({sorted(cfg.reward.judges)})")
        if self.prime_path:
            rows = load_prime(self.prime_path)
        else:
            rows = ctx.rows("eval", prompt_row_columns(cfg.data) + ["item", "broken"])
        rows = rows[:cfg.trainer.eval_max_prompts]
        if not rows:
            raise StageError(f"{ctx.name}: no held-out statements (data.eval_path, a synthetic task's eval split or "
                             "prime_path)")
        if "from_broken" in self.inputs and not all("broken" in r and "item" in r for r in rows):
            raise StageError(f"{ctx.name}: inputs from_broken needs held-out rows with `item` and `broken` (the "
                             "synthetic dsr task writes them)")
        check = dsr.check if self.compiler == "leanlite" else LeanCompiler(str(self.lean_project))
        judges = {}
        for name in sorted(set(self.roles.values())):
            jc = as_container(cfg.reward.judges[name])
            if jc["chat_template"] is None:
                jc["chat_template"] = bool(cfg.data.chat_template)
            judges[name] = jc
        clients = ctx.runtime.start_judges(judges, ctx.require("policy"))
        ask = {role: clients[name].generate for role, name in self.roles.items()}
        report: dict[str, Any] = {"statements": len(rows), "compiler": self.compiler, "budget": self.budget,
                                  "local_calls": self.local_calls,
                                  "roles": self.roles, "inputs": {}}
        try:
            if "from_nl" in self.inputs:
                report["inputs"]["from_nl"] = self._from_nl(rows, ask, check)
            if "from_broken" in self.inputs:
                report["inputs"]["from_broken"] = self._from_broken(rows, ask, check)
        finally:
            ctx.runtime.stop_judges(clients)
        path = ctx.stage_dir / "dsr.json"
        path.write_text(json.dumps(report, indent=1, ensure_ascii=False))
        ctx.summary[ctx.name] = {inp: {mode: {k: v for k, v in r.items() if k not in ("items",)}
                                       for mode, r in arms.items()} for inp, arms in report["inputs"].items()}
        for inp, arms in report["inputs"].items():
            for mode, r in arms.items():
                say(f"{ctx.name}: {inp} {mode}: SC {r['sc']:.3f}, CC {r['cc']:.3f}"
                    + (f", kept {r['kept']:.3f}, exact {r['exact']:.3f}" if r.get("kept") is not None else "")
                    + f", repair calls {r['calls']:.2f}")
        return {"autoformalize_report": str(path)}

    def _score(self, traces: list[dsr.RepairTrace], drafts: list[dict[str, Any]], ask: dict[str, Any],
               references: list[str | None], erroneous: list[int | None]) -> dict[str, Any]:
        finals = [t.statement for t in traces]
        sc = [t.errors == 0 for t in traces]  # the checker's verdict on the final statement, kept by the trace
        cc = [score >= 0.6 for score in self.judge(drafts, finals, ask)]
        kept, exact = [], []
        for final, ref, bad in zip(finals, references, erroneous):
            if ref is None:
                continue
            exact.append(final.strip() == ref.strip())
            got, want = dsr.statement_components(final), dsr.statement_components(ref)
            if got is None or want is None or len(got[0]) != len(want[0]):
                kept.append(False)
                continue
            kept.append(all(g == w for i, (g, w) in enumerate(zip(got[0] + [got[1]], want[0] + [want[1]]))
                            if i != bad))
        return {"sc": statistics.mean(sc), "cc": statistics.mean(cc),
                "kept": statistics.mean(kept) if kept else None, "exact": statistics.mean(exact) if exact else None,
                "calls": statistics.mean(len(t.calls) for t in traces),
                "items": [{"statement": t.statement, "compiles": s, "consistent": c, "calls": t.calls}
                          for t, s, c in zip(traces, sc, cc)][:self.examples]}

    def _from_nl(self, rows: list[dict[str, Any]], ask: dict[str, Any], check: Any) -> dict[str, Any]:
        drafts = self.formalize(rows, ask)
        items = [{"conditions": d["conditions"] if d["statement"] else None, "conclusion": d["conclusion"],
                  "trees": d["trees"], "nl_components": d["conditions_nl"] + [d["conclusion_nl"]],
                  "nl": d["nl"], "statement": d["statement"]} for d in drafts]
        first = [not check(d["statement"]) for d in drafts]
        out = {}
        for mode in self.modes:
            out[mode] = {"sc_before_repair": statistics.mean(first),
                         **self._score(self.repair(items, mode, ask, check), drafts, ask,
                                       [r.get("answer") for r in rows], [None] * len(rows))}
        return out

    def _from_broken(self, rows: list[dict[str, Any]], ask: dict[str, Any], check: Any) -> dict[str, Any]:
        items, drafts = [], []
        for r in rows:
            b = r["broken"]
            items.append({"conditions": b["conditions"], "conclusion": b["conclusion"], "trees": b["trees"],
                          "nl_components": b["nl"], "nl": b["nl_statement"],
                          "statement": dsr.splice(b["conditions"], b["conclusion"])})
            drafts.append({"conditions_nl": b["nl"][:-1], "conclusion_nl": b["nl"][-1]})
        out = {}
        for mode in self.modes:
            out[mode] = self._score(self.repair(items, mode, ask, check), drafts, ask,
                                    [dsr.splice(r["item"]["conditions"], r["item"]["conclusion"]) for r in rows],
                                    [r["broken"]["error_component"] for r in rows])
        return out

register_alias("stage", "autoformalize", "dsr")
