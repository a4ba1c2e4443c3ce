"""torchrun with 2 CPU processes (gloo) equals one process over the same global batch.

- DDP from scratch: every step's loss (metrics.jsonl) and the final adapter equal the one-process run.
- FSDP2 resumed from the DDP run's step-2 checkpoint (written under 2 processes): steps 3-4, the
  held-out loss, the adapter and the step-4 checkpoint (gathered from shards) equal the
  one-process run's, so checkpoints move between world sizes and strategies.
- The strategy choice and the batch check, without launching anything.

Every 2-process test launches through `two_ranks.run_two_ranks` (tests/two_ranks.py): each rank's
stdout and stderr go whole into files under a log folder, and a failure's message holds all of them,
so a rare crash can be diagnosed from the test report alone.
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from maximus import Config, Trainer
from maximus.errors import ConfigError
from maximus.memory.spec_from_config import QLORA_FSDP_NOTICE, fixed_strategy
from maximus.train.distributed import DistEnv
from maximus.train.run_directory import MARKER

from tiny import build_tiny_model_dir, tiny_config, write_prompt_completion
from two_ranks import rank_report, run_two_ranks

STEPS = 4


def _cfg(model: Path, data: Path, out: Path, **training) -> dict:
    # eval.before off (the resumed run skips it anyway); the split stays so every run trains on the same rows.
    return tiny_config(model, data, out, training={"max_steps": STEPS, "save_every": 2, "keep_checkpoints": 5, **training},
                       eval={"split": 0.1, "before": False})


def _torchrun(cfg: dict, tmp: Path) -> subprocess.CompletedProcess:
    name = Path(cfg["output_dir"]).name
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = tmp / f"{name}-logs"
    proc = run_two_ranks(["-m", "maximus.train", "--config", str(path)], logs, env=env)
    assert proc.returncode == 0, rank_report(proc, logs)
    return proc


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _assert_losses(run: Path, reference: dict[int, float], steps) -> None:
    got = _losses(run)
    # An empty file here means a non-main rank re-created metrics.jsonl under rank 0's open handle.
    assert sorted(got) == list(steps), f"metrics.jsonl of {run} has steps {sorted(got)}"
    for step in steps:
        assert got[step] == pytest.approx(reference[step], abs=1e-3), step


def _assert_tensors(a: dict, b: dict, atol=1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=0, atol=atol, msg=k)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Llama, its data, the one-process reference run and the 2-process DDP run."""
    tmp = tmp_path_factory.mktemp("dist")
    model = build_tiny_model_dir(tmp / "model", "llama")
    data = write_prompt_completion(tmp / "data.jsonl")
    Trainer(Config.from_dict(_cfg(model, data, tmp / "one"))).train()
    _torchrun(_cfg(model, data, tmp / "ddp", distributed="ddp"), tmp)
    return {"tmp": tmp, "model": model, "data": data, "one": tmp / "one", "ddp": tmp / "ddp"}


def _adapter(run: Path) -> dict:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def test_ddp_two_processes_equal_one(world):
    reference = _losses(world["one"])
    _assert_losses(world["ddp"], reference, range(1, STEPS + 1))
    _assert_tensors(_adapter(world["ddp"]), _adapter(world["one"]))
    summary = json.loads((world["ddp"] / "run.json").read_text())
    assert summary["distributed"] == {"strategy": "ddp", "world_size": 2}


def test_fsdp_resumes_a_two_process_checkpoint_and_equals_one(world):
    tmp = world["tmp"]
    run = tmp / "fsdp"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(world["ddp"] / "checkpoints" / "step-000002", run / "checkpoints" / "step-000002")
    shutil.copy(world["ddp"] / MARKER, run / MARKER)  # moved from a run of ours: maximus-train resumes it
    _torchrun(_cfg(world["model"], world["data"], run, distributed="fsdp"), tmp)

    _assert_losses(run, _losses(world["one"]), range(3, STEPS + 1))
    _assert_tensors(_adapter(run), _adapter(world["one"]))
    # The step-4 checkpoint was gathered from FSDP2 shards: the same tensors a single process saves.
    for name in ("trainable", "optimizer"):
        _assert_tensors(load_file(str(run / "checkpoints" / "step-000004" / f"{name}.safetensors")),
                        load_file(str(world["one"] / "checkpoints" / "step-000004" / f"{name}.safetensors")))
    ours, ref = (json.loads((r / "run.json").read_text()) for r in (run, world["one"]))
    assert ours["distributed"] == {"strategy": "fsdp", "world_size": 2}
    assert ours["eval"]["after"]["loss"] == pytest.approx(ref["eval"]["after"]["loss"], abs=1e-4)


@pytest.mark.parametrize("requested, method, optimizer, world, expected", [
    ("fsdp", "lora", "adamw", 1, ("single", [])),
    ("ddp", "full", "adamw", 2, ("ddp", [])),
    ("fsdp", "lora", "adamw", 2, ("fsdp", [])),
    ("fsdp", "qlora", "adamw", 2, ("ddp", [QLORA_FSDP_NOTICE.removeprefix("notice: ")])),
    ("auto", "full", "adamw", 2, (None, [])),  # sized against the memory by the planner
    ("auto", "qlora", "adamw", 2, ("ddp", [])),
    ("auto", "full", "adamw_8bit", 2, ("ddp", [])),
])
def test_fixed_strategy(requested, method, optimizer, world, expected):
    """DDP vs FSDP2 from the config, decided in one place for planned and unplanned runs."""
    cfg = Config.from_dict({"model": "m", "dataset": "d.jsonl", "training": {"distributed": requested,
                                                                              "optimizer": optimizer}})
    assert fixed_strategy(cfg, method, world) == expected


def test_fsdp_with_an_optimizer_it_cannot_shard_is_refused_once():
    cfg = Config.from_dict({"model": "m", "dataset": "d.jsonl",
                            "training": {"distributed": "fsdp", "optimizer": "adamw_8bit"}})
    with pytest.raises(ConfigError) as err:
        fixed_strategy(cfg, "full", 2)
    assert str(err.value).startswith("training.distributed: fsdp supports the torch AdamW optimizer without offload only")


def test_batch_must_split_evenly_across_processes():
    env = DistEnv(True, world_size=2, rank=1)
    env.check_batch(4)
    with pytest.raises(ConfigError) as err:
        env.check_batch(5)
    assert str(err.value) == ("training.batch_size (5) must be a multiple of the number of processes (2) "
                              "(hint: use a batch_size divisible by 2 or change --nproc_per_node)")
    DistEnv().check_batch(5)  # one process: anything goes


def test_shard_gives_each_rank_a_contiguous_slice_covering_the_batch():
    rows = list(range(8))
    parts = [DistEnv(True, world_size=4, rank=r).shard(rows) for r in range(4)]
    assert parts == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert DistEnv().shard(rows) == rows
