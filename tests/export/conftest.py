"""A finished tiny LoRA run shared by the export tests (trained once per session, a few seconds)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiny import tiny_config, write_prompt_completion


def train_tiny_run(model_dir: Path, out: Path, steps: int = 3, **sections) -> Path:
    from maximus.config import Config
    from maximus.train.trainer import Trainer

    data = write_prompt_completion(out.parent / f"{out.name}-data.jsonl")
    cfg = tiny_config(model_dir, data, out, training={"max_steps": steps}, eval={"split": 0.1, "before": False},
                      **sections)
    Trainer(Config.from_dict(cfg)).train()
    return out


@pytest.fixture(scope="session")
def lora_run(tiny_llama, tmp_path_factory) -> Path:
    return train_tiny_run(tiny_llama, tmp_path_factory.mktemp("runs") / "lora")
