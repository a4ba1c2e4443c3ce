"""A finished tiny LoRA run shared by the export tests (trained once per session, a few seconds)."""
from __future__ import annotations

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
