"""Builders shared by the tests: tiny random models of real architectures saved like hub
checkpoints, generated datasets and small run configs. Import as `from tiny import ...`
(a unique module name: several conftest.py files exist under tests/)."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ARCHS = ("llama", "mistral", "qwen2")
_WORDS = "red green blue gold stone river cloud tiger eagle maple north south".split()


def build_tiny_model_dir(path: Path, arch: str = "llama", *, hidden: int = 64, layers: int = 2, seed: int = 0,
                         tie: bool = False, heads: int = 4, kv_heads: int = 2, max_positions: int = 512,
                         texts: list[str] | None = None) -> Path:
    """A random `arch` causal LM (2 layers, hidden 64, GQA) with a byte-level BPE tokenizer trained
    on `texts` (default: the tokenizer module's own sample)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(texts, vocab_size=300)
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                  tie_word_embeddings=tie)
    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
           "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    return save_random_model(path, cls[1], cls[0](**common), tok, seed=seed)


def save_random_model(path: Path, model_cls, config, *companions, seed: int = 0) -> Path:
    """`model_cls(config)` with seeded random weights, saved to `path` like a hub checkpoint
    (safetensors) together with its `companions` (tokenizer, processor) via save_pretrained."""
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(str(path), safe_serialization=True)
    for companion in companions:
        companion.save_pretrained(str(path))
    return path


#: The words `build_vocab8k_llama`'s tokenizer knows, and the texts written for it are made of.
MEASURE_WORDS = [f"w{i}x" for i in range(200)]


def measure_text(rng: random.Random, words: int) -> str:
    """`words` of MEASURE_WORDS drawn by `rng`, space-separated."""
    return " ".join(rng.choice(MEASURE_WORDS) for _ in range(words))


def build_vocab8k_llama(path: Path, *, max_positions: int, tied: bool = False) -> Path:
    """A random 2-layer Llama (hidden 128, 4/2 heads) whose vocabulary has 8,192 rows, so that the
    loss phase and full copies of the embedding and the head weigh what they do in real models: the
    model of the tests that hold the planner's predicted peak against the meter's (`measured_run`).
    Its tokenizer (300 tokens) knows MEASURE_WORDS. `tied`: the head shares the embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer([" ".join(MEASURE_WORDS)] * 4, vocab_size=300)
    config = LlamaConfig(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=tied)
    return save_random_model(path, LlamaForCausalLM, config, tok)


def measured_run(cfg) -> tuple[int, int, dict]:
    """(predicted, measured, run.json) of a real `maximus.Trainer` run of `cfg`: run.json's
    `plan.peak_bytes` and `memory.peak_bytes` (the meter's)."""
    from maximus import Trainer

    Trainer(cfg).train()
    run = json.loads((Path(cfg.output_dir) / "run.json").read_text())
    return run["plan"]["peak_bytes"], run["memory"]["peak_bytes"], run


def merge_sections(cfg: dict, sections: dict) -> dict:
    """`cfg` with each of `sections` merged into its mapping (or replacing a plain value)."""
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


#: The config of the project's source article (shared/MISSION.md), word for word.
ARTICLE_YAML = """\
model: "mistralai/Mistral-12B-v0.1"
dataset: "my_dataset"
optimization:
  target_vram: 16GB
  use_ghost_logit: true
  kronecker_sketching: true
training:
  batch_size: 4
  epochs: 3
"""


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
#: passed) and one torch thread (`one_thread`).
LLAMA_CPP_MARKS = [pytest.mark.llama_cpp, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes gain nothing from threads, and on a shared 2-core machine they lose a lot.
    Use it module-wide with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_prompt_completion(path: Path, n: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            words = rng.sample(_WORDS, 3)
            f.write(json.dumps({"prompt": f"Reverse: {' '.join(words)}\nAnswer:",
                                "completion": " " + " ".join(reversed(words))}) + "\n")
    return path



def tiny_config(model_dir: Path, data: Path, out: Path, **sections) -> dict:
    """A small, fast run config (fp32, no eval generations) as a dict; `sections` update it."""
    cfg = {
        "model": str(model_dir), "dataset": {"path": str(data), "format": "prompt_completion"},
        "method": "lora", "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8},
        "optimization": {"gradient_checkpointing": "off"},
        "training": {"batch_size": 4, "micro_batch_size": 2, "max_steps": 4, "learning_rate": 1e-2,
                     "warmup_steps": 0, "seq_len": 64, "dtype": "fp32", "seed": 0},
        "eval": {"split": 0.1, "before": True},
        "logging": {"progress": "none"},
    }
    return merge_sections(cfg, sections)


class OpRecorder(TorchDispatchMode):
    """Records every aten op called and the largest tensor (in elements) any op produced."""

    def __init__(self):
        super().__init__()
        self.ops = set()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def backward_node_names(loss: torch.Tensor) -> set[str]:
    """The class names of every autograd node behind `loss` (which kernels a backward really runs)."""
    names, stack, seen = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(f for f, _ in node.next_functions)
    return names


def kernel_switch_runs(model_dir: Path, data: Path, out: Path, key: str) -> tuple[dict, dict]:
    """Two 2-step trainer runs (eager kernels) with ``optimization.<key>`` true and false: per value,
    run.json's ``kernels.<key>`` count of routed modules and the per-step losses."""
    from maximus import Config, Trainer

    counts, losses = {}, {}
    for on in (True, False):
        run = out / str(on)
        cfg = tiny_config(model_dir, data, run, training={"max_steps": 2}, eval={"before": False},
                          optimization={key: on, "kernels": "eager"})
        Trainer(Config.from_dict(cfg)).train()
        counts[on] = json.loads((run / "run.json").read_text())["kernels"][key]
        losses[on] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                      if '"loss"' in line]
    return counts, losses


#: Tiny config fields per Transformers model type, beyond the common ones (`build_family_model_dir`).
FAMILY_FIELDS: dict[str, dict] = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": 16}, "olmo2": {},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0, "sliding_window": 16},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0,
                    "sliding_window": 16, "sliding_window_pattern": 2},
    "phi3": {},
    "granite": {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.25},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "router_aux_loss_coef": 0.01},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01},
    "gpt_oss": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                "router_aux_loss_coef": 0.01},
}


def write_long_documents(path: Path, seq_len: int, rows: int = 4, seed: int = 0) -> Path:
    """`rows` text documents longer than `seq_len` tokens of the tiny tokenizer, so that with
    ``packing: false`` every row is one document cut to exactly seq_len tokens."""
    rng = random.Random(seed)
    words = "red green blue gold stone river cloud tiger eagle maple north south seven quiet bright".split()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq_len))}) + "\n")
    return path


def long_run_config(model_dir: Path, data: Path, out: Path, seq_len: int, checkpointing: str) -> dict:
    """Two LoRA steps (r 4, fp32, CPU, batch 1) of one `seq_len`-token row each, no budget: the run
    whose predicted and measured peaks are compared at long sequences."""
    return {
        "model": str(model_dir), "dataset": {"path": str(data), "format": "text"}, "method": "lora",
        "output_dir": str(out), "device": "cpu", "lora": {"r": 4, "alpha": 8},
        "optimization": {"gradient_checkpointing": checkpointing, "target_vram": None},
        "training": {"batch_size": 1, "micro_batch_size": 1, "max_steps": 2, "learning_rate": 1e-3,
                     "warmup_steps": 0, "seq_len": seq_len, "dtype": "fp32", "packing": False, "seed": 0},
        "eval": {"enabled": False, "before": False}, "logging": {"progress": "none"}}


def build_family_model_dir(path: Path, model_type: str, *, hidden: int = 64, layers: int = 2, seed: int = 0,
                           tie: bool = False, prepare=None, **fields_over) -> Path:
    """A random causal LM of any family in `FAMILY_FIELDS` (2 layers, hidden 64, 4/2 GQA heads) with
    the byte-level BPE test tokenizer, saved like a hub checkpoint. `fields_over` override config
    fields; `prepare(model)` may change the weights before saving."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(None, vocab_size=300)
    fields = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                  tie_word_embeddings=tie)
    fields.update({**FAMILY_FIELDS[model_type], **fields_over})

    def build(config):
        model = AutoModelForCausalLM.from_config(config)
        if prepare is not None:
            with torch.no_grad():
                prepare(model)
        return model

    return save_random_model(path, build, AutoConfig.for_model(model_type, **fields), tok, seed=seed)
