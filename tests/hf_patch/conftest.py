"""Builders for the Hugging Face stack tests: tiny Llamas with a LoRA / DoRA adapter, and tiny
prompt-completion and preference datasets for the real TRL trainers."""
from __future__ import annotations

import random

import pytest
import torch

from tiny import _WORDS, one_thread  # noqa: F401  (a fixture)


@pytest.fixture(scope="module", autouse=True)
def _tiny_shapes_one_thread(one_thread):
    """Every test here runs tiny shapes: one thread (see tiny.one_thread)."""


def lora_model(model_dir, *, dora: bool = False, init: bool = True, seed: int = 0, qlora: bool = False):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = None
    if qlora:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=quant)
    if qlora:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, use_dora=dora,
                                            init_lora_weights=init))


def prompt_completion_rows(n: int = 48, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(_WORDS, 3)
        rows.append({"prompt": f"Reverse: {' '.join(words)}\nAnswer:", "completion": " " + " ".join(reversed(words))})
    return rows


def preference_rows(n: int = 24, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(_WORDS, 3)
        rows.append({"prompt": f"Reverse: {' '.join(words)}\nAnswer:", "chosen": " " + " ".join(reversed(words)),
                     "rejected": " " + " ".join(words)})
    return rows
