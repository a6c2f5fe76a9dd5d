"""Imports point down, never in a circle (DESIGN.md): the import graph of ``tilefuse/**/*.py``, read with ``ast``
(nothing is imported), has no cycle.

What counts as an edge ``A -> B``: every ``import`` / ``from ... import`` statement of module A, at module level or
inside a function or class (a deferred import still makes A depend on B), relative ones resolved against A's
package. ``from P import name`` is an edge to the module ``P.name`` where that module exists, else to ``P``.
``import P.Q.R`` is an edge to ``P.Q.R`` only: the parent packages a dotted import runs first are not edges
of A, as they are of every module (a package's ``__init__`` is its area's face and imports its public module;
counted for each child, every area would be a circle through its own face). An explicit import of a package
(``import tilefuse.moe``, ``from tilefuse import moe``) is an edge to that package's ``__init__`` like any other.
Imports by name at run time (``importlib.import_module``: the kernel registry, the lazy areas of
``tilefuse/__init__``) are not statements and are not read.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "tilefuse"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package (``__init__.py`` names its package)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve_base(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module a (possibly relative) ``from`` names."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    package = parts if is_package else parts[:-1]
    base = package[:len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that ``module`` (source at ``path``) imports, anywhere in its body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(module, is_package, node.level, node.module)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {m for m in found if m in modules and m != module}


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    files = module_files(root, package)
    names = set(files)
    return {m: imports_of(m, p, names) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; sorted by first name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def one_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A closed path through the component's first module (breadth-first: a shortest one)."""
    start, members = component[0], set(component)
    parent = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return component  # unreachable for a strongly connected component


def describe(graph: dict[str, set[str]]) -> list[str]:
    return [f"{', '.join(c)} (e.g. {' -> '.join(one_circle(graph, c))})" for c in cycles(graph)]


def test_no_import_circles_in_tilefuse():
    graph = import_graph()
    assert len(graph) > 50 and graph["tilefuse.moe.ops"], "the package was not read"
    found = describe(graph)
    assert not found, "import circles in tilefuse:\n  " + "\n  ".join(found)


def kernel_modules(root: Path = ROOT) -> list[str]:
    """``tilefuse._jit.KERNEL_MODULES``, read from the source."""
    tree = ast.parse((root / PACKAGE / "_jit.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "KERNEL_MODULES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("tilefuse/_jit.py defines no KERNEL_MODULES")


def test_kernel_modules_never_import_their_areas_public_modules():
    """A kernel module imports neither its area's package nor a module the area's ``__init__`` imports (the
    public ops): checks both need live below both (``tilefuse/_check.py``, an area's ``_checks.py``)."""
    graph = import_graph()
    kernels = kernel_modules()
    assert "tilefuse.moe._moe_gate_kernel" in kernels
    wrong = []
    for mod in kernels:
        area = mod.rpartition(".")[0]
        public = {area} | graph[area]
        wrong += [f"{mod} -> {m}" for m in sorted(graph[mod] & public)]
    assert not wrong, "kernel modules importing their area's public modules:\n  " + "\n  ".join(wrong)


# ----------------------------------------------------------------------------------------------------
# The checker itself, on packages written for the test
# ----------------------------------------------------------------------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path, "pkg")


def test_a_circle_through_a_deferred_relative_import_is_named(tmp_path):
    graph = _package(tmp_path, {
        "__init__.py": "",
        "area/__init__.py": "from .ops import *\n",
        "area/ops.py": "from pkg.area import _kernel\nfrom pkg import _low\n",
        "area/_kernel.py": "import torch\ndef f():\n    from . import ops\n    return ops\n",
        "_low.py": "import os\n",
    })
    assert graph["pkg.area._kernel"] == {"pkg.area.ops"}
    assert graph["pkg.area"] == {"pkg.area.ops"}
    assert cycles(graph) == [["pkg.area._kernel", "pkg.area.ops"]]
    (text,) = describe(graph)
    assert text.startswith("pkg.area._kernel, pkg.area.ops (e.g. pkg.area._kernel -> pkg.area.ops -> ")


def test_imports_that_point_down_are_no_circle(tmp_path):
    graph = _package(tmp_path, {
        "__init__.py": "import importlib\n",
        "a.py": "from . import b\nimport pkg.c\n",
        "b.py": "from .c import value\n",
        "c.py": "value = 1\n",
        "sub/__init__.py": "from ..a import b\n",
    })
    assert graph["pkg.a"] == {"pkg.b", "pkg.c"} and graph["pkg.sub"] == {"pkg.a"}
    assert cycles(graph) == []


def test_a_three_module_circle_is_one_component(tmp_path):
    graph = _package(tmp_path, {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "from pkg import c\n",
                                "c.py": "class K:\n    def m(self):\n        from pkg.a import x\n"})
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert one_circle(graph, ["pkg.a", "pkg.b", "pkg.c"]) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
