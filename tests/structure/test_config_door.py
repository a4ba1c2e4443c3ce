"""The config reaches memory/ through one door (`maximus.memory.spec_from_config`): no other
module of memory/ imports `Config` or takes a config (a parameter named ``cfg`` / ``config``)."""
from __future__ import annotations

import ast
from pathlib import Path

MEMORY = Path(__file__).resolve().parents[2] / "src" / "maximus" / "memory"
DOOR = "spec_from_config.py"


def config_readers(path: Path) -> list[str]:
    """``file:line what`` for each import of `Config` and each parameter named cfg / config."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "maximus.config":
            found += [f"{path.name}:{node.lineno} imports Config" for a in node.names if a.name == "Config"]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            found += [f"{path.name}:{node.lineno} {node.name}({a.arg})" for a in args if a.arg in ("cfg", "config")]
    return found


def test_only_the_spec_builder_reads_the_config():
    readers = [r for p in sorted(MEMORY.glob("*.py")) if p.name != DOOR for r in config_readers(p)]
    assert readers == []


def test_the_check_sees_the_door_itself():
    assert any("plan_run(cfg)" in r for r in config_readers(MEMORY / DOOR))
