"""The floors of src/ hold: no module imports one on a floor above its own (CONTRIBUTING.md, "The
floors"), whether at module level or inside a function. Each module's floor is the one of the
longest prefix listed in `FLOORS`; a module no prefix names fails the test, so a new package
is placed on purpose."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_import_cycles import SRC, import_graph  # noqa: E402

#: Bottom to top. A module may import its own floor and the floors below.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    # what every floor may use: errors, the config schema, device facts, where things are in a model
    ("base", ("maximus.errors", "maximus.config", "maximus.device", "maximus.structure", "maximus.arguments",
              "maximus.user_code", "maximus.gguf_base", "maximus.files", "maximus.ownership")),
    # math on tensors and modules that load nothing: losses, attention, the model families, kernels
    ("math", ("maximus.losses", "maximus.attention", "maximus.vision", "maximus.families", "maximus.forward",
              "maximus.compat", "maximus.kernels")),
    # the plan: the config resolved into a RunSpec, the estimator, the planner; memory at run time
    ("plan", ("maximus.memory",)),
    # the model and the data: loading, adapters, datasets, evaluation, export, the HF Trainer patch
    ("model + data", ("maximus.models", "maximus.model_source", "maximus.layerwise_load", "maximus.qat", "maximus.data", "maximus.builtin",
                      "maximus.embed", "maximus.evaluate", "maximus.export", "maximus.hf_patch", "maximus.memory_callback")),
    # the trainer and what it writes into the run directory
    ("trainer", ("maximus.train",)),
    # commands over the library: the CLI, `maximus plan`, `maximus embed`, `maximus ui`
    ("commands", ("maximus", "maximus.cli", "maximus.plan_command", "maximus.data_command", "maximus.embed_command",
                  "maximus.ui", "maximus.train.__main__")),
]


def floor_of(module: str, floors=FLOORS) -> int | None:
    """The floor (index into `floors`) of the longest prefix of `module` listed there; None if none."""
    best, found = -1, None
    for i, (_, prefixes) in enumerate(floors):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), i
    return found


def upward_imports(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """``a (floor) -> b (floor)`` for every import from a lower floor to a higher one."""
    out = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            fa, fb = floor_of(a, floors), floor_of(b, floors)
            if fa is not None and fb is not None and fb > fa:
                out.append(f"{a} ({floors[fa][0]}) -> {b} ({floors[fb][0]})")
    return out


def test_every_module_has_a_floor():
    unplaced = sorted(m for m in import_graph() if floor_of(m) is None)
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    found = upward_imports(import_graph())
    assert not found, f"{len(found)} imports from a lower floor to a higher one: " + "; ".join(found)


def test_the_check_sees_an_upward_import_hidden_in_a_function(tmp_path):
    """The checker itself can fail: a lazy import of a higher floor is found, a lower one is not."""
    pkg = tmp_path / "maximus"
    (pkg / "memory").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "memory" / "__init__.py").write_text("")
    (pkg / "memory" / "plan.py").write_text("def f():\n    from maximus.train.order import g\n    return g\n")
    (pkg / "train").mkdir()
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "order.py").write_text("from maximus.memory import plan\n\ndef g():\n    return plan\n")
    floors = [("plan", ("maximus.memory",)), ("trainer", ("maximus.train",)), ("top", ("maximus",))]
    assert upward_imports(import_graph(tmp_path), floors) == [
        "maximus.memory.plan (plan) -> maximus.train.order (trainer)"]


def test_nothing_outside_the_trainer_reads_its_private_attributes():
    """A helper gets what it may read from the trainer's public attributes, never `trainer._x`."""
    import re

    found = [f"{p.relative_to(SRC)}:{i}" for p in (SRC / "maximus").rglob("*.py") if p.name != "trainer.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\btrainer\._[a-z]", line)]
    assert not found, f"private trainer attributes read at {found}"


if __name__ == "__main__":  # counts for a report: python tests/structure/test_floors.py
    import ast

    graph = import_graph()
    depth: dict[str, int] = {}

    def layer(m: str, seen=()) -> int:  # the longest chain of imports below a module (cycles cut)
        if m not in depth:
            depth[m] = 1 + max((layer(t, seen + (m,)) for t in graph[m] if t not in seen), default=-1)
        return depth[m]

    params, lines = [], []
    for path in (SRC / "maximus").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                n -= bool(a.args and a.args[0].arg in ("self", "cls"))
                where = f"{path.relative_to(SRC)}:{node.lineno} {node.name}"
                if n > 12:
                    params.append(f"{where} ({n})")
                if node.end_lineno - node.lineno + 1 > 80:
                    lines.append(f"{where} ({node.end_lineno - node.lineno + 1})")
    print(f"modules {len(graph)}; import layers {1 + max(layer(m) for m in graph)}; "
          f"upward imports {len(upward_imports(graph))}; functions over 12 parameters {len(params)}; "
          f"over 80 lines {len(lines)}")
    for item in upward_imports(graph) + params + lines:
        print("  " + item)
