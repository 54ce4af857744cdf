"""The architecture's import rule, read from the source: imports point down only (the radixkv
command's radixkv_cli -> demo, batchrun, evalrun, trlrun -> hf_patch -> radixkv -> cuda_ext), and no modules import each other in a
circle, deferred imports inside functions included (an import under ``if TYPE_CHECKING`` is a
type annotation's, not a dependency, and is left out)."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEVEL = {"cuda_ext": 0, "radixkv": 1, "hf_patch": 2, "demo": 3, "batchrun": 3, "evalrun": 3, "trlrun": 3,
         "radixkv_cli": 4}  # fmt: skip


def _modules() -> dict[str, Path]:
    modules = {}
    for package in LEVEL:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a name imported from a package that is not a
    submodule of it is an edge to the package itself)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for statement in node.body
            for inner in ast.walk(statement)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found is not None and found != module:
                    graph[module].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_down_only():
    graph = import_graph(_modules())
    upward = sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if LEVEL[target.split(".")[0]] > LEVEL[module.split(".")[0]]
    )
    assert upward == []
    assert len(graph) > 100, "the walk found too few modules to mean anything"


def test_no_modules_import_each_other_in_a_circle():
    assert circles(import_graph(_modules())) == []


def test_the_checks_see_a_circle_and_imports_deferred_into_functions():
    graph = {"hf_patch.a": {"hf_patch.b"}, "hf_patch.b": {"hf_patch.c"}, "hf_patch.c": {"hf_patch.a"}}
    assert circles(graph) == [["hf_patch.a", "hf_patch.b", "hf_patch.c"]]
    modules = _modules()
    # step_loop_reason imports it inside the function
    assert "hf_patch.running_batch" in import_graph(modules)["demo.engine.step_loop"]
