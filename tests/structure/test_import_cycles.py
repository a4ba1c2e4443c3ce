"""No import cycles in src/: every `import` (module level or inside a function) is an edge from
the importing module to the module that defines the name; a strongly connected group of two or
more modules, or a module importing itself, fails the test with the cycle spelled out."""
from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, for every .py file under `root`/maximus."""
    files = {module_name(p, root): p for p in (root / "maximus").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a name inside a.b
                    target = target.rpartition(".")[0]
                if target.startswith("maximus") and target != name:
                    graph[name].add(target)
                elif target == name:
                    graph[name].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan), plus self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_in_src():
    found = cycles(import_graph())
    assert not found, "import cycles in src/: " + "; ".join(" <-> ".join(group) for group in found)


def test_the_walk_sees_a_cycle_hidden_in_a_function(tmp_path):
    """The checker itself can fail: a lazy import inside a function still closes a cycle."""
    pkg = tmp_path / "maximus"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from maximus.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from maximus.a import f\n    return f\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph["maximus.c"] == {"maximus.a"}
    assert cycles(graph) == [["maximus.a", "maximus.b"]]



def test_ignore_index_is_defined_once():
    """The label without loss is one constant (maximus.structure.IGNORE_INDEX), never a literal."""
    defined = [str(p.relative_to(SRC)) for p in (SRC / "maximus").rglob("*.py")
               if re.search(r"^IGNORE_INDEX\s*=", p.read_text(), re.M)]
    literal = [f"{p.relative_to(SRC)}:{i}" for p in (SRC / "maximus").rglob("*.py")
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if re.search(r"[=!]= -100\b|= -100\b", line) and not line.startswith("IGNORE_INDEX")]
    assert defined == ["maximus/structure.py"] and literal == []
