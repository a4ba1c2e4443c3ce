"""`training.context_parallel: auto` end to end: two torchrun processes (gloo, CPU) train a tiny
Llama whole (`Trainer.train`, `context_parallel_worker.py`'s "runs") under an
`optimization.target_vram` computed here from the estimator (`plan_run` without a budget: the
one plan each degree has, every lever fixed), so that the test follows the estimator:

- a budget that one process's whole rows do not fit and a two-way split does: the plan
  (run.json) records context_parallel 2 over one batch share, the trainer joins at 2;
- a budget that whole rows fit: the plan records 1, the two processes split the batch (DDP).

Both runs' losses (metrics.jsonl) and final adapters equal one process's on the same rows
(context_parallel 1, no budget) to 1e-5 in fp32. The two runs train one after the other in the
same two processes (`Trainer.train` twice): the second joins a process group of its own
(`maximus.train.distributed.init`).
"""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from maximus import Config, Trainer
from maximus.memory.planner import DEFAULT_MARGIN
from maximus.memory.spec_from_config import plan_run
from tiny import build_tiny_model_dir, tiny_config, write_prompt_completion
from two_ranks import rank_report, run_two_ranks

WORKER = Path(__file__).with_name("context_parallel_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _cfg(model: Path, data: Path, out: Path, degree, target_vram: int | None = None) -> dict:
    """Every memory lever fixed, so each degree has one plan and its peak is the estimator's."""
    optimization = {"gradient_checkpointing": "off", "offload": {"activations": "off", "optimizer": "off"},
                    "tile_tokens": "off", "loss_chunk_size": 512}
    if target_vram is not None:
        optimization["target_vram"] = target_vram
    return tiny_config(model, data, out, eval={"enabled": False}, optimization=optimization,
                       training={"batch_size": 2, "micro_batch_size": 1, "max_steps": 2, "seq_len": 96,
                                 "distributed": "ddp", "context_parallel": degree, "max_grad_norm": None})


def _peak(cfg: dict, world_size: int) -> int:
    """The estimator's per-process peak of `cfg`'s one plan over `world_size` batch shares (bytes)."""
    return plan_run(Config.from_dict(cfg), device="cpu", world_size=world_size, budget_bytes=None).peak_bytes


def _losses(run_dir: Path) -> torch.Tensor:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return torch.tensor([r["loss"] for r in rows if "loss" in r and "step" in r], dtype=torch.float64)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp_auto")
    model = build_tiny_model_dir(tmp / "llama", "llama", heads=4, kv_heads=2)
    data = write_prompt_completion(tmp / "data.jsonl", n=16)
    whole = _peak(_cfg(model, data, tmp / "x", 1), world_size=2)  # one row per process
    split = _peak(_cfg(model, data, tmp / "x", 2), world_size=1)  # each row over both
    assert split < whole
    usable = 1 - DEFAULT_MARGIN  # the planner holds a plan to the budget less its margin
    budgets = {"split": int((whole + split) / 2 / usable), "batch": int(whole * 1.05 / usable)}
    runs = {name: _cfg(model, data, tmp / name, "auto", budget) for name, budget in budgets.items()}
    spec = tmp / "launch.json"
    spec.write_text(json.dumps({"attention": False, "runs": runs}))
    proc = run_two_ranks([str(WORKER), str(spec), str(tmp)], tmp / "logs", env=ENV, timeout_s=300)
    assert proc.returncode == 0, rank_report(proc, tmp / "logs")
    Trainer(Config.from_dict(_cfg(model, data, tmp / "one", 1))).train()  # the same rows in one process
    return tmp, proc, budgets, (whole, split)


@pytest.mark.parametrize("name, degree, shares", [("split", 2, 1), ("batch", 1, 2)])
def test_auto_plans_the_fewest_ranks_per_row_that_fit_and_trains_as_one_process(launched, name, degree, shares):
    tmp, proc, budgets, (whole, split) = launched
    usable = budgets[name] * (1 - DEFAULT_MARGIN)
    assert (split <= usable < whole) if degree == 2 else (whole <= usable)
    assert f"{name}: joined at context_parallel {degree}, {shares} batch share(s)" in proc.stdout
    assert f"training.context_parallel auto: {degree} of 2 process(es) share each row" in proc.stderr
    summary = json.loads((tmp / name / "run.json").read_text())
    plan = summary["plan"]
    assert plan["context_parallel"] == degree and plan["world_size"] == shares
    assert summary["replans"] == [] and summary["distributed"] == {"strategy": "ddp", "world_size": 2}
    assert plan["budget_bytes"] == budgets[name]
    one, run = tmp / "one", tmp / name
    losses = _losses(run)
    assert len(losses) == 2
    torch.testing.assert_close(losses, _losses(one), rtol=0, atol=1e-5)
    mine, theirs = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (run, one))
    assert mine.keys() == theirs.keys() and len(mine) > 2
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=1e-5, msg=key)
