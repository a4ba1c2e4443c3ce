"""No function in src/maximus takes more than 12 parameters or is longer than 80 lines, except the
ones named in ALLOWED, each with its reason; an entry whose function is gone, or no longer over
the limit it is excused from, fails too, so the list cannot outlive its reasons.

Parameters: positional-only, positional, keyword-only, *args and **kwargs, without a method's
`self` / `cls`. Lines: from the `def` (decorators excluded) to the last line of the body.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "maximus"
MAX_PARAMS = 12
MAX_LINES = 80

#: (path under src/maximus, qualified name) -> (limits excused: "params" and / or "lines", reason).
ALLOWED: dict[tuple[str, str], tuple[frozenset[str], str]] = {
    ("memory/estimate.py", "estimate_peak"): (
        frozenset({"params", "lines"}),
        "the public keyword convenience over the estimator: one keyword per RunSpec field, for callers "
        "without a config (the planner and the trainer go through RunSpec)"),
    ("attention/kronecker.py", "kronecker_sketch_attention"): (
        frozenset({"lines"}),
        "a sectioned math kernel: its sections share the block layout and masks in one autograd graph, "
        "on which the memory coefficients were measured (its docstring)"),
    ("losses/ghost_logit.py", "_GhostLogitLoss.forward"): (
        frozenset({"lines"}),
        "a sectioned math kernel: each chunk's gradients are formed while its logits exist (its docstring)"),
    ("kernels/triton/rms_norm.py", "_rms_norm_backward_kernel"): (
        frozenset({"params"}), "a Triton kernel: pointers, strides and block sizes are its parameters"),
    ("kernels/triton/rope.py", "_rope_rotate"): (
        frozenset({"params"}), "a Triton kernel: pointers, strides and block sizes are its parameters"),
    ("kernels/triton/rope.py", "_rope_kernel"): (
        frozenset({"params"}), "a Triton kernel: pointers, strides and block sizes are its parameters"),
}


@dataclass(frozen=True)
class Function:
    path: str  # under src/maximus
    name: str  # qualified: Class.method, outer.inner
    line: int
    params: int
    lines: int
    docstring: str

    def over(self) -> set[str]:
        """The limits this function exceeds."""
        return {limit for limit, over in (("params", self.params > MAX_PARAMS), ("lines", self.lines > MAX_LINES))
                if over}

    def describe(self) -> str:
        return (f"src/maximus/{self.path}:{self.line} {self.name}: {self.params} parameters (limit {MAX_PARAMS}), "
                f"{self.lines} lines (limit {MAX_LINES})")


def functions(source: str, path: str) -> list[Function]:
    """Every function and method defined in `source`, nested ones included."""
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None)
                          + (a.kwarg is not None))
                positional = a.posonlyargs + a.args
                if positional and positional[0].arg in ("self", "cls"):
                    params -= 1
                found.append(Function(path, prefix + child.name, child.lineno, params,
                                      child.end_lineno - child.lineno + 1, ast.get_docstring(child) or ""))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def size_problems(found: list[Function], allowed: dict) -> list[str]:
    """One line per function over a limit it is not excused from, and per stale ALLOWED entry."""
    problems = []
    by_key = {(f.path, f.name): f for f in found}
    for f in found:
        excused = allowed.get((f.path, f.name), (frozenset(), ""))[0]
        if f.over() - excused:
            problems.append(f.describe())
    for (path, name), (excused, _) in allowed.items():
        f = by_key.get((path, name))
        if f is None:
            problems.append(f"src/maximus/{path} {name}: in the allowlist but no longer defined; remove the entry")
        elif not excused & f.over():
            problems.append(f"{f.describe()}: in the allowlist for {' and '.join(sorted(excused))} but within the "
                            f"limit now; remove the entry")
    return problems


def all_functions() -> list[Function]:
    return [f for path in sorted(SRC.rglob("*.py"))
            for f in functions(path.read_text(), path.relative_to(SRC).as_posix())]


def test_the_check_counts_parameters_and_lines_and_names_the_place():
    source = ("class A:\n"
              "    def method(self, a, b, /, c, *args, d, e=1, **kw):\n"
              "        def inner(x):\n"
              "            return x\n"
              "        return inner\n"
              "def wide(" + ", ".join(f"p{i}" for i in range(13)) + "):\n"
              "    pass\n"
              "def long():\n" + "    x = 1\n" * 80)
    found = functions(source, "m.py")
    assert [(f.name, f.line, f.params, f.lines) for f in found] == [
        ("A.method", 2, 7, 4), ("A.method.inner", 3, 1, 2), ("wide", 6, 13, 2), ("long", 8, 0, 81)]
    assert size_problems(found, {}) == [
        "src/maximus/m.py:6 wide: 13 parameters (limit 12), 2 lines (limit 80)",
        "src/maximus/m.py:8 long: 0 parameters (limit 12), 81 lines (limit 80)"]
    # An excuse covers only the limit it names; a stale or vanished entry is a problem too.
    allowed = {("m.py", "wide"): (frozenset({"lines"}), "r"), ("m.py", "long"): (frozenset({"lines"}), "r"),
               ("m.py", "A.method"): (frozenset({"params"}), "r"), ("m.py", "gone"): (frozenset({"lines"}), "r")}
    assert size_problems(found, allowed) == [
        "src/maximus/m.py:6 wide: 13 parameters (limit 12), 2 lines (limit 80)",
        "src/maximus/m.py:6 wide: 13 parameters (limit 12), 2 lines (limit 80): in the allowlist for lines "
        "but within the limit now; remove the entry",
        "src/maximus/m.py:2 A.method: 7 parameters (limit 12), 4 lines (limit 80): in the allowlist for params "
        "but within the limit now; remove the entry",
        "src/maximus/m.py gone: in the allowlist but no longer defined; remove the entry"]


def test_no_function_takes_more_than_12_parameters_or_runs_over_80_lines():
    problems = size_problems(all_functions(), ALLOWED)
    assert not problems, ("group parameters into a dataclass, split long functions into named steps, or add an "
                          "entry with its reason to ALLOWED:\n" + "\n".join(problems))


def test_every_long_math_kernel_says_in_its_docstring_why_it_is_one_function():
    by_key = {(f.path, f.name): f for f in all_functions()}
    kernels = [key for key, (excused, reason) in ALLOWED.items() if "sectioned math kernel" in reason]
    assert len(kernels) == 2
    for key in kernels:
        doc = by_key[key].docstring
        assert "One function of sections" in doc and "rather than several" in doc, key
