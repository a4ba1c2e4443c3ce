"""DPO under FSDP2 with the output head sharded: 2 gloo processes equal one process.

The DPO loss reads the head through `forward.through_head` (policy and adapter-off reference
log-probs alike), so under FSDP2 the head is gathered for each call and its shards never hold more
than half the vocabulary. Oracle: the same config trained by one process; per-step losses must
agree to 1e-3 (the issue's bar), in practice to float32 rounding.
"""
import json
import os
import random
from pathlib import Path

import pytest
import yaml

from maximus import Config, Trainer
from tiny import build_tiny_model_dir, tiny_config
from two_ranks import rank_report, run_two_ranks

WORDS = "apple banana cherry grape lemon mango olive peach pear plum".split()


def _pairs(path: Path, n: int = 24) -> Path:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            words = rng.sample(WORDS, 3)
            f.write(json.dumps({"prompt": f"Reverse: {' '.join(words)}\nAnswer:",
                                "chosen": " " + " ".join(reversed(words)), "rejected": " " + " ".join(words)}) + "\n")
    return path


def _cfg(model: Path, data: Path, out: Path, **training) -> dict:
    cfg = tiny_config(model, data, out)
    cfg.update(objective="dpo", dataset={"path": str(data), "format": "preference"}, eval={"enabled": False})
    cfg["training"].update(batch_size=4, micro_batch_size=2, max_steps=3, seq_len=48, **training)
    return cfg


def _losses(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_dpo_fsdp_two_processes_equal_one(tmp_path):
    model = build_tiny_model_dir(tmp_path / "model")
    data = _pairs(tmp_path / "pairs.jsonl")
    Trainer(Config.from_dict(_cfg(model, data, tmp_path / "one"))).train()
    config = tmp_path / "fsdp.yaml"
    config.write_text(yaml.safe_dump(_cfg(model, data, tmp_path / "fsdp", distributed="fsdp")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = tmp_path / "logs"
    proc = run_two_ranks(["-m", "maximus.train", "--config", str(config)], logs, env=env)
    assert proc.returncode == 0, rank_report(proc, logs)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "fsdp")
    assert sorted(two) == sorted(one) == [1, 2, 3]
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-3), step
    summary = json.loads((tmp_path / "fsdp" / "run.json").read_text())
    assert summary["distributed"] == {"strategy": "fsdp", "world_size": 2}
