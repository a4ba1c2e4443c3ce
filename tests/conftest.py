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


# GGUF export tests run llama.cpp itself (tests/export/test_gguf_llama_cpp.py). Off CI they skip where
# llama-cpp-python is not installed; in CI (CI=true) a run in which none of them passed is a failure.
def pytest_configure(config):
    config.addinivalue_line("markers", "llama_cpp: runs llama.cpp through llama-cpp-python; must not skip in CI")


_llama_cpp_passed = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed and "llama_cpp" in report.keywords:
        _llama_cpp_passed.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI") == "true" and exitstatus == 0 and not _llama_cpp_passed:
        print("\nerror: CI=true but no llama.cpp test (marker llama_cpp) passed: the GGUF export went unchecked")
        session.exitstatus = 1
