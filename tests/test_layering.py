"""Imports point one way: driver → cluster → rewards → rollout → models and the algorithm core; no circles;
the algorithm core imports neither Ray nor DeepSpeed nor vLLM nor `models/`. Every import statement
counts, also those inside functions (a lazy import is still a dependency)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rl", "rollout", "rewards", "models", "cluster")
CORE = {"rl", "rl.batch", "rl.registry", "rl.config", "rl.data", "rl.advantages", "rl.losses", "rl.rltt", "rl.optim", "rl.memo", "rl.proposer", "rl.monoscale",
        "rl.sft_data", "rl.ep_order", "rl.bliss", "rl.zo_finetuner", "rl.curvature", "rl.kv_compress", "rl.guidance", "rl.dsr"}
# what each layer may import (its own layer included)
ALLOWED = {
    "core": {"core"},
    "models": {"models"},
    "rollout": {"core", "models", "rollout"},
    "rewards": {"core", "models", "rollout", "rewards"},  # a grader may call a rollout engine
    "cluster": {"core", "models", "rollout", "rewards", "cluster"},
    "driver": {"core", "models", "rollout", "rewards", "cluster", "driver"},
}
CORE_FORBIDDEN_THIRD_PARTY = ("ray", "deepspeed", "vllm")


def layer_of(module: str) -> str:
    if module in CORE:
        return "core"
    top = module.split(".")[0]
    return "driver" if top == "rl" else top


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def graph(mods: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project-internal edges, all imported names) per module."""
    internal, everything = {}, {}
    for name, path in mods.items():
        names = imports_of(path)
        everything[name] = names
        internal[name] = {m for m in names if m in mods and m != name}
    return internal, everything


def upward_edges(edges: dict[str, set[str]], files: dict[str, Path]) -> list[str]:
    bad = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            if layer_of(dst) not in ALLOWED[layer_of(src)]:
                bad.append(f"{files[src].relative_to(ROOT)} ({layer_of(src)}) imports "
                           f"{files[dst].relative_to(ROOT)} ({layer_of(dst)})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_upward_imports_and_no_circles():
    mods = project_modules()
    edges, _ = graph(mods)
    assert upward_edges(edges, mods) == []
    assert [[str(mods[m].relative_to(ROOT)) for m in c] for c in cycles(edges)] == []


def test_the_algorithm_core_imports_no_ray_deepspeed_vllm():
    mods = project_modules()
    _, everything = graph(mods)
    bad = [f"{mods[m].relative_to(ROOT)} imports {n}" for m in sorted(CORE) for n in sorted(everything[m])
           if n.split(".")[0] in CORE_FORBIDDEN_THIRD_PARTY]
    assert bad == []


def test_the_checks_name_both_files_of_a_bad_edge_and_a_circle():
    files = {m: ROOT / (m.replace(".", "/") + ".py") for m in ("rl.batch", "rl.trainer", "rollout.worker")}
    edges = {"rl.batch": {"rollout.worker"}, "rollout.worker": {"rl.trainer"}, "rl.trainer": {"rl.batch"}}
    assert upward_edges(edges, files) == ["rl/batch.py (core) imports rollout/worker.py (rollout)",
                                          "rollout/worker.py (rollout) imports rl/trainer.py (driver)"]
    assert cycles(edges) == [["rl.batch", "rl.trainer", "rollout.worker"]]
