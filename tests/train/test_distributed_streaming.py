"""Streamed frozen weights under torch.distributed (torchrun, 2 CPU processes, gloo).

- DDP: a QLoRA run with ``optimization.offload.params: on`` equals the same 2-process run with the
  weights resident: every step's loss and the final adapter (fp32, to 1e-6). DDP leaves the frozen
  weights out of its start-up broadcast (`maximus.compat.ddp_leave_out`); before that, the
  streamed layers' released storages crashed it (SIGSEGV).
- FSDP2 cannot shard weights the streamer releases between uses (``fully_shard`` failed with
  "setStorage: ... out of bounds for storage of size 0"): ``training.distributed: fsdp`` with
  streamed weights is refused in one line before anything loads; ``auto`` runs DDP.
"""
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from maximus import Config
from maximus.errors import ConfigError
from maximus.memory.spec_from_config import fixed_strategy

from tiny import build_tiny_model_dir, tiny_config, write_prompt_completion
from two_ranks import rank_report, run_two_ranks


def _torchrun(cfg: dict, tmp: Path) -> Path:
    name = Path(cfg["output_dir"]).name
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MAXIMUS_CACHE": str(tmp / "cache")}
    logs = tmp / f"{name}-logs"
    proc = run_two_ranks(["-m", "maximus.train", "--config", str(path)], logs, env=env)
    assert proc.returncode == 0, rank_report(proc, logs)
    return Path(cfg["output_dir"])


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if line.strip() and "loss" in json.loads(line)]


def test_ddp_with_streamed_weights_equals_ddp_with_resident_ones(tmp_path):
    model = build_tiny_model_dir(tmp_path / "llama", layers=4, hidden=128)
    data = write_prompt_completion(tmp_path / "data.jsonl")
    runs = {}
    for mode in ("off", "on"):
        cfg = tiny_config(model, data, tmp_path / mode, method="qlora",
                          optimization={"offload": {"params": mode}, "gradient_checkpointing": "off"},
                          training={"max_steps": 3, "distributed": "ddp"}, eval={"split": 0.1, "before": False})
        runs[mode] = _torchrun(cfg, tmp_path)
    for mode, run in runs.items():
        summary = json.loads((run / "run.json").read_text())
        assert summary["distributed"] == {"strategy": "ddp", "world_size": 2}
        assert summary["plan"]["offload_params"] is (mode == "on")
    reference = _losses(runs["off"])
    assert len(reference) == 3
    assert _losses(runs["on"]) == pytest.approx(reference, abs=1e-6)
    ours, theirs = (load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (runs["on"], runs["off"]))
    assert ours.keys() == theirs.keys() and ours
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("params", ["on", "disk"])
def test_fsdp_with_streamed_weights_is_refused_in_one_line(params):
    cfg = Config.from_dict({"model": "m", "dataset": "d.jsonl", "training": {"distributed": "fsdp"},
                            "optimization": {"offload": {"params": params}}})
    with pytest.raises(ConfigError) as err:
        fixed_strategy(cfg, "lora", 2)
    assert err.value.one_line() == (
        f"training.distributed: fsdp cannot shard streamed weights (optimization.offload.params: {params}) "
        f"(hint: set training.distributed: ddp to stream on every rank, or optimization.offload.params: off "
        f"to shard the weights instead)")
    assert fixed_strategy(cfg, "qlora", 2)[0] == "ddp"  # QLoRA never shards: it streams under DDP
    auto = Config.from_dict({"model": "m", "dataset": "d.jsonl", "training": {"distributed": "auto"},
                             "optimization": {"offload": {"params": params}}})
    assert fixed_strategy(auto, "lora", 2) == ("ddp", [])
