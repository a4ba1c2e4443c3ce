"""Shared fixtures (builders live in tests/tiny.py). Nothing is downloaded."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# A fixed thread count: the trainer would otherwise pick one from the machine's load
# (maximus.kernels.cpu_threads), and reduction order, hence the last bits, would vary run to run.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import ARCHS, build_tiny_model_dir, tiny_config, write_prompt_completion  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model_dir(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture
def pc_data(tmp_path) -> Path:
    return write_prompt_completion(tmp_path / "data.jsonl")
