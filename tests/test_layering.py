"""The house's layers follow from its folders: every import between the packages points down the table below,
no modules import each other in a circle, every module lies in a layer, and the Ray-free library (`rl/`)
imports neither Ray nor DeepSpeed nor vLLM. Every import statement counts, also those inside functions (a
lazy import is still a dependency)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bottom to top: a module may import its own layer and the layers below it
LAYERS = ("models", "rl", "rollout", "rewards", "cluster")
RAY_FREE = {"rl": ("ray", "deepspeed", "vllm")}


def layer_of(path: Path) -> str | None:
    """The layer a file lies in: the first folder of its path inside the repository, if that is a layer."""
    top = path.relative_to(ROOT).parts[0]
    return top if top in LAYERS else None


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        # mutants/: the copy of the tree `make mutation` works in (git-ignored, not the project's code)
        if rel.parts[0] in ("tests", "benchmarks", "recipes", ".venv", "docs", "mutants", "site") \
                or rel.parts[0].startswith("."):
            continue
        name = ".".join(rel.with_suffix("").parts)
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
            a, b = layer_of(files[src]), layer_of(files[dst])
            if a in LAYERS and b in LAYERS and LAYERS.index(b) > LAYERS.index(a):
                bad.append(f"{files[src].relative_to(ROOT)} ({a}) imports {files[dst].relative_to(ROOT)} ({b})")
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


def test_every_module_lies_in_a_layer():
    assert sorted(str(p.relative_to(ROOT)) for p in project_modules().values() if layer_of(p) is None) == []


def test_no_upward_imports_and_no_circles():
    mods = project_modules()
    edges, _ = graph(mods)
    assert upward_edges(edges, mods) == []
    assert [[str(mods[m].relative_to(ROOT)) for m in c] for c in cycles(edges)] == []


def test_the_library_imports_no_ray_deepspeed_vllm():
    mods = project_modules()
    _, everything = graph(mods)
    bad = [f"{mods[m].relative_to(ROOT)} imports {n}" for m in sorted(mods) for n in sorted(everything[m])
           if n.split(".")[0] in RAY_FREE.get(layer_of(mods[m]), ())]
    assert bad == []


def remote_calls_at(path: Path, root: Path) -> list[str]:
    return [f"{path.relative_to(root)}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"]


def remote_calls(path: Path) -> list[str]:
    """`x.method.remote(...)` calls in a file: Ray's actor API, which a Ray-free module must not use even on a
    handle it was given (a stage calls its actors through `StageRuntime.call`)."""
    return remote_calls_at(path, ROOT)


def test_the_library_calls_no_actor_by_rays_api():
    mods = project_modules()
    assert [c for m in sorted(mods) if layer_of(mods[m]) in RAY_FREE for c in remote_calls(mods[m])] == []


def test_the_remote_call_check_finds_one(tmp_path):
    (tmp_path / "stage.py").write_text("def run(rt, w):\n    return rt.wait(w.reset.remote(1))\n")
    assert [c.rsplit(":", 1)[1] for c in remote_calls_at(tmp_path / "stage.py", tmp_path)] == ["2"]


def test_no_module_imports_a_private_name_of_another():
    mods = project_modules()
    bad = []
    for name, path in sorted(mods.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in mods and node.module != name:
                bad += [f"{path.relative_to(ROOT)}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_")]
    assert bad == []


def test_the_checks_name_both_files_of_a_bad_edge_a_circle_and_a_stray_module(tmp_path):
    files = {m: ROOT / (m.replace(".", "/") + ".py") for m in ("rl.batch", "cluster.rl_roles", "rollout.worker")}
    edges = {"rl.batch": {"rollout.worker"}, "rollout.worker": {"cluster.rl_roles"}, "cluster.rl_roles": {"rl.batch"}}
    assert upward_edges(edges, files) == ["rl/batch.py (rl) imports rollout/worker.py (rollout)",
                                          "rollout/worker.py (rollout) imports cluster/rl_roles.py (cluster)"]
    assert cycles(edges) == [["cluster.rl_roles", "rl.batch", "rollout.worker"]]
    assert layer_of(ROOT / "rl" / "methods" / "x.py") == "rl" and layer_of(ROOT / "tools" / "x.py") is None
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "helper.py").write_text("import rl\n")
    assert list(project_modules(tmp_path)) == ["tools.helper"]
