"""Nothing outside train/trainer.py reads a private attribute of the trainer: helpers get a narrow
view of the run (`maximus.train.views`), and what the trainer keeps to itself stays there."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "maximus"
TRAINER = SRC / "train" / "trainer.py"


def _names_the_trainer(node: ast.AST) -> bool:
    """`trainer` or `<anything>.trainer`."""
    return (isinstance(node, ast.Name) and node.id == "trainer") or (
        isinstance(node, ast.Attribute) and node.attr == "trainer")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_trainer_reads(source: str) -> list[str]:
    """`trainer._x`, `self.trainer._x` and `getattr(trainer, "_x")` in `source`, as
    ``line: text``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and _names_the_trainer(node.value):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and _names_the_trainer(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_check_finds_each_form_of_private_read():
    source = ("a = trainer._gathered\nb = self.trainer._stop_signal\nc = getattr(trainer, '_gathered', None)\n"
              "d = trainer.model\ne = trainer.__class__\nf = getattr(trainer, 'plan')\n")
    assert private_trainer_reads(source) == ["1: trainer._gathered", "2: self.trainer._stop_signal",
                                             "3: getattr(trainer, '_gathered', None)"]


def test_no_module_but_the_trainer_reads_its_private_attributes():
    found = {str(path.relative_to(SRC)): reads for path in sorted(SRC.rglob("*.py")) if path != TRAINER
             for reads in [private_trainer_reads(path.read_text())] if reads}
    assert found == {}, "pass a field of a view in maximus.train.views instead"
