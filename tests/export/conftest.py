"""A finished tiny LoRA run shared by the export tests (trained once per session, a few seconds)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny import tiny_config, write_prompt_completion

#: Strings whose tokenization llama.cpp must reproduce (unicode, digits, whitespace runs, specials).
HELD_OUT = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "  leading spaces and trailing  ",
    "numbers 1234567 and 3.14159, 42!", "tabs\tand\nnew\nlines\n\n", "CamelCaseWord snake_case_word kebab-case",
    "What's the answer? It's 'four', isn't it?", "émigré café naïve façade", "日本語のテキスト", "emoji 🙂👍 mix",
    "a", "", "Reverse: red gold stone\nAnswer: stone gold red", "x = [1, 2, 3]; y = {'k': None}",
    "https://example.com/path?q=1&r=2", "ALL CAPS SENTENCE HERE", "don't won't can't shouldn't",
    "<|im_start|>user\nHi there<|im_end|>\n", "multiple     spaces     inside", "end with punctuation...",
]
PROMPTS = ["Reverse: red gold stone\nAnswer:", "The capital of France is", "Once upon a time"]


def llama_cpp_or_skip():
    """llama-cpp-python (llama.cpp itself, the GGUF export's checker), imported for a test module:
    where it is not installed the module skips, except in CI (CI=true: .ci/run installs it), where
    the ImportError is the failure. Such a module also sets `pytestmark = LLAMA_CPP_MARKS`."""
    try:
        import llama_cpp
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[llamacpp]' builds it)", allow_module_level=True)
    return llama_cpp


#: A llama.cpp test module's marks: `llama_cpp` (tests/conftest.py fails a CI run none of them
#: passed) and one torch thread (tests/tiny.py).
LLAMA_CPP_MARKS = [pytest.mark.llama_cpp, pytest.mark.usefixtures("one_thread")]


def train_tiny_run(model_dir: Path, out: Path, steps: int = 3, **sections) -> Path:
    from maximus.config import Config
    from maximus.train.trainer import Trainer

    data = write_prompt_completion(out.parent / f"{out.name}-data.jsonl")
    sections = {"eval": {"split": 0.1, "before": False}, **sections}
    cfg = tiny_config(model_dir, data, out, training={"max_steps": steps}, **sections)
    Trainer(Config.from_dict(cfg)).train()
    return out


@pytest.fixture(scope="session")
def lora_run(tiny_llama, tmp_path_factory) -> Path:
    return train_tiny_run(tiny_llama, tmp_path_factory.mktemp("runs") / "lora")
