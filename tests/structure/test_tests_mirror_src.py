"""The test folders mirror src/maximus: each folder under tests/ is named after the module or
package of src/maximus it tests (`tests/kernels` for `maximus/kernels/`, `tests/forward` for
`maximus/forward.py`), except the folders in NOT_A_MODULE, each with its reason; no test file sits
at the top of tests/ (only the shared builders and conftest.py do)."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src" / "maximus"

#: Test folders with no single counterpart in src/maximus, and why.
NOT_A_MODULE = {
    "structure": "checks over the whole source tree (floors, import cycles, function size, this layout), not "
                 "of maximus/structure.py, whose helpers are tested through the modules that use them",
    "docs": "checks the user documentation (links, commands, figures), not a module",
    "benchmarks": "checks the scripts of benchmarks/, outside src/maximus",
}


def folders_with_tests(root: Path = TESTS) -> list[str]:
    """The folders directly under `root` that hold a test file (test_*.py)."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("test_*.py")))


def src_names(src: Path = SRC) -> set[str]:
    """The modules and packages directly in `src` (``forward`` for forward.py, ``kernels`` for kernels/)."""
    return ({p.stem for p in src.glob("*.py") if p.stem != "__init__"}
            | {p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists()})


def test_every_test_folder_names_a_module_or_package_of_src_maximus():
    unmatched = [name for name in folders_with_tests() if name not in src_names() and name not in NOT_A_MODULE]
    assert unmatched == [], ("name each tests/ folder after the src/maximus module or package it tests, or add it "
                             f"to NOT_A_MODULE with its reason: {unmatched}")


def test_every_exempt_folder_still_exists():
    assert sorted(set(NOT_A_MODULE) - set(folders_with_tests())) == [], "remove it from NOT_A_MODULE"


def test_no_test_file_sits_at_the_top_of_tests():
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == [], "move it into the folder of the module it tests"


def test_the_names_are_read_from_the_tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "data_dir").mkdir()  # no __init__.py: not a package
    (tmp_path / "mod.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    assert src_names(tmp_path) == {"pkg", "mod"}
    (tmp_path / "pkg" / "test_a.py").write_text("")
    (tmp_path / "data_dir" / "helper.py").write_text("")
    assert folders_with_tests(tmp_path) == ["pkg"]
