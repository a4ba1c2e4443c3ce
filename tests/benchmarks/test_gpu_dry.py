"""The prepared GPU check rehearsed on the CPU: the plan of docs/benchmarks/gpu.md adds up, and each
of its steps runs `bash benchmarks/gpu.sh --dry STEP` through its real scripts until every process
reaches its first CUDA use (benchmarks/_child.py), so an import or wiring break fails here, not on
the device."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "docs" / "benchmarks" / "gpu.md"
#: A machine start (the device tool: "a minute or more"), the plan's ceiling (13 of the 15 minutes,
#: two starts included) and the whole lease, in seconds.
START_S, PLAN_LIMIT_S, LEASE_S = 120, 13 * 60, 15 * 60
CALL = re.compile(r"^\| (\d) \| `bash benchmarks/gpu\.sh --budget-s (\d+) ([a-z_ ]+)` \| `\[\"\.whl\"\]` \| (\d+) \|",
                  re.M)


def plan_calls() -> list[tuple[int, list[str], int]]:
    """(budget s, steps, timeout_s) of each call in the plan's table, in order."""
    return [(int(budget), steps.split(), int(timeout)) for _, budget, steps, timeout in CALL.findall(PLAN.read_text())]


def test_the_plan_adds_up():
    calls = plan_calls()
    assert [step for _, steps, _ in calls for step in steps] == ["quickstart", "speed", "giant", "long_context"]
    for budget, steps, timeout in calls:
        assert timeout >= budget + 10, f"{steps}: timeout_s {timeout} leaves gpu.sh's budget {budget} no margin"
    assert len(calls) * START_S + sum(t for _, _, t in calls) <= PLAN_LIMIT_S
    first = calls[0][2]
    assert 2 * (START_S + first) <= LEASE_S, "a retry of the first call does not fit the lease"


STEPS = ["quickstart", "speed", "giant", "long_context"]


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Each step's `gpu.sh --dry` run: (rc, output, steps.txt). The steps run side by side (a dry run
    is mostly imports, one process at a time), so the four take the time of the longest."""
    started = {}
    for step in STEPS:
        work = tmp_path_factory.mktemp(step)
        budget = next(b for b, steps, _ in plan_calls() if step in steps)
        env = {**os.environ, "OUT": str(work / "out"), "MAXIMUS_CACHE": str(work / "cache"),
               "PYTHONPATH": str(REPO / "src")}
        log = open(work / "output.txt", "w")
        proc = subprocess.Popen(["bash", str(REPO / "benchmarks" / "gpu.sh"), "--dry", "--budget-s", str(budget), step],
                                stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        started[step] = (proc, log, work, budget)
    runs = {}
    for step, (proc, log, work, budget) in started.items():
        proc.wait(timeout=budget)
        log.close()
        steps_txt = work / "out" / "steps.txt"
        runs[step] = (proc.returncode, (work / "output.txt").read_text(),
                      steps_txt.read_text() if steps_txt.is_file() else "")
    return runs


STOP = "dry run stopped at the first CUDA use"
#: Per step, the lines of its dry run: every child process it starts, stopped at its first CUDA use.
EXPECTED = {
    "quickstart": ["quickstart: dry run stopped at the first CUDA use (maximus-train's device check)"],
    "speed": [f"model 8b: {STOP}, benchmarks/_reference_model.py",
              f"worker bf16 qlora 1 x 2048 [default config] maximus: {STOP}, benchmarks/speed.py",
              f"worker bf16 qlora 1 x 2048 [default config] peft: {STOP}, benchmarks/speed.py"],
    "long_context": [f"model 8b: {STOP}, benchmarks/_reference_model.py",
                     "planner: longest context under 16GB with",
                     f"tiled 16384: {STOP}, benchmarks/_reference_model.py",
                     f"peer 16384: {STOP}, benchmarks/_reference_model.py"],
}


@pytest.mark.parametrize("step", ["quickstart", "speed", "long_context"])
def test_dry_run_reaches_every_child(dry_runs, step):
    rc, output, steps_txt = dry_runs[step]
    assert rc == 0, output
    assert "Traceback" not in output
    for line in EXPECTED[step]:
        assert line in output, output
    assert f"== {step}: rc 0 in" in steps_txt


def test_dry_run_of_the_giant_step(dry_runs):
    rc, output, steps_txt = dry_runs["giant"]
    if not (REPO / "benchmarks" / "giant.py").is_file():
        assert rc == 1
        assert "== giant: benchmarks/giant.py is not in this checkout" in output
        pytest.skip("benchmarks/giant.py is not in this checkout yet")
    assert rc == 0, output
    assert "Traceback" not in output
    assert "== giant: rc 0 in" in steps_txt


def test_a_child_that_times_out_is_one_failure_with_its_stderr_tail():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from _child import ChildFailed, run_child

    slow = [sys.executable, "-c", "import sys, time; print('loading 8B', file=sys.stderr, flush=True); time.sleep(30)"]
    with pytest.raises(ChildFailed) as failed:
        run_child(slow, 1, "worker ours")
    assert str(failed.value) == "worker ours timed out after 1 s; its stderr ended:\nloading 8B"
    broken = [sys.executable, "-c", "import sys; print('RuntimeError: no plan fits', file=sys.stderr); sys.exit(2)"]
    with pytest.raises(ChildFailed) as failed:
        run_child(broken, 30, "card 89718")
    assert str(failed.value) == "card 89718 failed (exit 2); its stderr ended:\nRuntimeError: no plan fits"
