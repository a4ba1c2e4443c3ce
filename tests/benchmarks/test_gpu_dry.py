"""The prepared GPU check rehearsed on the CPU: the plan of docs/benchmarks/gpu.md adds up, and each
of its steps runs `bash benchmarks/gpu.sh --dry STEP` through its real scripts until every process
reaches its first CUDA use (benchmarks/_child.py), so an import or wiring break fails here, not on
the device."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "docs" / "benchmarks" / "gpu.md"
#: A machine start (the device tool: "a minute or more"), the plan's ceiling (13 of the 15 minutes,
#: two starts included) and the whole lease, in seconds.
START_S, PLAN_LIMIT_S, LEASE_S = 120, 13 * 60, 15 * 60
CALL = re.compile(r"^\| (\d|retry) \| `bash benchmarks/gpu\.sh --budget-s (\d+) ([a-z_ ]+)` \| `\[\"\.whl\"\]` \| (\d+) \|",
                  re.M)
#: No machine is started with less device time left than this (seconds).
START_FLOOR_S = 4 * 60


def plan_calls(retry: bool = False) -> list[tuple[int, list[str], int]]:
    """(budget s, steps, timeout_s) of each call in the plan's table, in order (or of its retry row)."""
    return [(int(budget), steps.split(), int(timeout)) for call, budget, steps, timeout in CALL.findall(PLAN.read_text())
            if (call == "retry") == retry]


def test_the_plan_adds_up():
    calls, retries = plan_calls(), plan_calls(retry=True)
    assert [step for _, steps, _ in calls for step in steps] == ["quickstart", "speed", "giant", "long_context"]
    for budget, steps, timeout in calls + retries:
        assert timeout >= budget + 10, f"{steps}: timeout_s {timeout} leaves gpu.sh's budget {budget} no margin"
    assert len(calls) * START_S + sum(t for _, _, t in calls) <= PLAN_LIMIT_S
    # The retry replaces the second call when the first is lost: it must fit, and be allowed to start.
    (_, _, first), (_, _, retry) = calls[0], retries[0]
    assert 2 * START_S + first + retry <= LEASE_S
    assert LEASE_S - (START_S + first) >= START_FLOOR_S


STEPS = ["quickstart", "speed", "giant", "long_context"]
#: The dry runs' budget: the wiring is checked, not the time (a loaded CPU runs them far slower than CI).
DRY_BUDGET_S = 590


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Each step's `gpu.sh --dry` run: (rc, output, steps.txt). The steps run side by side (a dry run
    is mostly imports, one process at a time), so the four take the time of the longest."""
    started = {}
    for step in STEPS:
        work = tmp_path_factory.mktemp(step)
        budget = DRY_BUDGET_S
        env = {**os.environ, "OUT": str(work / "out"), "MAXIMUS_CACHE": str(work / "cache"),
               "PYTHONPATH": str(REPO / "src"),  # gpu.sh's python3: this interpreter's, where it has one
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
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


STOP = re.escape("dry run stopped at the first CUDA use")
#: Per step, the lines of its dry run (patterns): every child process it starts, stopped at its
#: first CUDA use, and where.
EXPECTED = {
    "quickstart": [re.escape("quickstart: dry run stopped at the first CUDA use (maximus-train's device check)")],
    "speed": [rf"model 8b: {STOP}, benchmarks/_reference_model\.py:\d+ \(build\)",
              rf"worker bf16 qlora 1 x 2048 \[default config\] maximus: {STOP}, src/maximus/models\.py:\d+ \(resolve_device\)",
              rf"worker bf16 qlora 1 x 2048 \[default config\] peft: {STOP}, benchmarks/speed\.py:\d+ \(matmul_rate\)"],
    "long_context": [rf"model 8b: {STOP}, benchmarks/_reference_model\.py:\d+ \(build\)",
                     r"planner: longest context under 16GB with [\d.]+ GiB of host memory for offloaded state = [\d,]+ tokens",
                     rf"tiled 16384: {STOP}, benchmarks/_cuda_peak\.py:\d+ \(__enter__\)",
                     rf"card [\d]+: {STOP}, benchmarks/_cuda_peak\.py:\d+ \(__enter__\)",
                     rf"peer 16384: {STOP}, benchmarks/_reference_model\.py:\d+ \(build\)"],
}


@pytest.mark.parametrize("step", ["quickstart", "speed", "long_context"])
def test_dry_run_reaches_every_child(dry_runs, step):
    rc, output, steps_txt = dry_runs[step]
    assert rc == 0, output
    assert "Traceback" not in output
    for pattern in EXPECTED[step]:
        assert re.search(pattern, output), f"{pattern} not in:\n{output}"
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


#: Dependencies of Maximus that are neither on the device's image nor carried, and why the check's
#: steps never import them (a CPU run of each step's processes with only the image's and the carried
#: distributions importable passed without them).
OFF_THE_CHECK_PATHS = {
    "datasets": "Hugging Face hub datasets only (`dataset: hf:...`); the CLI's import of it is guarded",
    "gguf": "GGUF models and exports only",
    "rouge-score": "eval.metrics: rouge_l only",
}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def test_every_dependency_is_on_the_device_or_carried():
    import tomllib

    dependencies = {_name(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    image = {line.strip() for line in (REPO / "benchmarks" / "gpu_image_packages.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    carried = {_name(r) for r in re.findall(r"\b([A-Za-z0-9_.-]+)==", (REPO / "benchmarks" / "gpu_wheels.sh").read_text())}
    missing = sorted(d for d in dependencies if d not in image | carried | set(OFF_THE_CHECK_PATHS))
    assert missing == [], f"add {missing} to benchmarks/gpu_wheels.sh (or to OFF_THE_CHECK_PATHS, with the reason)"
