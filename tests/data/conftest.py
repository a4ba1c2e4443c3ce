"""Fixtures for the data pipeline tests: a real tiny tokenizer and file writers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from maximus.config import DatasetSpec
from maximus.data.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture
def tok():
    """A fresh byte-level BPE tokenizer (EOS id 0, PAD id 1, no chat template)."""
    return build_tiny_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path):
    def write(records, name="data.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        return path

    return write


@pytest.fixture
def spec():
    def make(path, **kw) -> DatasetSpec:
        return DatasetSpec(path=str(path), **kw)

    return make
