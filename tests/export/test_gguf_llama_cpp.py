"""GGUF export checked by llama.cpp itself (llama-cpp-python, built from source): tiny Llama, Mistral
and Qwen2 models (tied and untied heads) with trained LoRA adapters and real tokenizers (the builtin
byte-level BPE; byte-level BPEs with Llama-3 / Qwen2 pre-tokenizers and a SentencePiece-style BPE with
byte fallback, trained here; RoPE scaling linear and Llama-3), against the merged HF model:

- tokenization of 20 held-out strings is equal;
- the greedy 32-token continuation of 3 prompts is equal for f16;
- next-token logits agree within 1e-2 relative for f16; q8_0 top-1 agreement >= 95 % over held-out
  tokens; the 4-bit (q4_0, and q4_k_m by llama.cpp's own quantiser) agreement is reported
  (and must beat chance by far).

In CI (CI=true) these tests may not skip: tests/conftest.py fails a CI run that did not pass them.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from maximus.cli import main
from maximus.export.gguf_vocab import LLAMA3_SPLIT, QWEN2_SPLIT

from conftest import HELD_OUT, PROMPTS, train_tiny_run
from tiny import _WORDS, LLAMA_CPP_MARKS, llama_cpp_or_skip, one_thread  # noqa: F401  (one_thread: a fixture, used through pytestmark)

llama_cpp = llama_cpp_or_skip()
pytestmark = LLAMA_CPP_MARKS

HELD_OUT_TEXT = ("Reverse: blue tiger maple\nAnswer: maple tiger blue\n"
                 "Once upon a time there was a little cat who lived in a house near the river. "
                 "She liked to read books and watch the birds fly over the trees every morning. "
                 "What is two plus two? Two plus two is four. Write a poem about the sea and the sky.")


def _corpus() -> list[str]:
    import random

    rng = random.Random(0)
    lines = [" ".join(rng.sample(_WORDS, 4)) for _ in range(200)]
    return lines + ["The quick brown fox jumps over the lazy dog. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
                    "What's the answer? It's four. Once upon a time there was a cat.", "émigré café 日本語 🙂"] * 4


def _byte_bpe(pre: str):
    """A byte-level BPE with the Llama-3 (BOS added, ignore_merges) or Qwen2 (NFC, ChatML) pipeline."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from maximus.data.templates import CHATML_TEMPLATE

    llama3 = pre == "llama3"
    specials = (["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"] if llama3
                else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend = Tokenizer(models.BPE(ignore_merges=llama3))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT if llama3 else QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if not llama3:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if llama3:
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 0)])
        return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                       eos_token="<|end_of_text|>", pad_token="<|pad|>")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML_TEMPLATE
    return tok


# Llama 3.1's RoPE scaling, shrunk so that the tiny head's frequencies span all three bands.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def _sentencepiece_bpe():
    """A Llama-2 / Mistral-v0.1 style tokenizer: BPE over '▁'-escaped text with byte fallback
    (<0x00>..<0xFF> after <unk> <s> </s>), BOS added; trained here, then laid out like the originals."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer_side = Tokenizer(models.BPE())
    trainer_side.normalizer = norm
    trainer_side.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=400, show_progress=False))
    trained = json.loads(trainer_side.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = norm
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")


def _model_dir(path: Path, arch: str, tokenizer, tie: bool, extra_rows: int = 0, rope: dict | None = None) -> Path:
    """A random 2-layer GQA model of `arch` whose vocabulary is the tokenizer's (+ unused rows, as
    real checkpoints pad their embeddings)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
           "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = cls[0](vocab_size=len(tokenizer) + extra_rows, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                    rope_parameters=rope or {"rope_type": "default",
                                             "rope_theta": 500000.0 if arch == "llama" else 10000.0})
    torch.manual_seed(0)
    model = cls[1](config)
    with torch.no_grad():
        for layer in model.model.layers:
            # At the usual init (std 0.02) attention is nearly uniform and a wrong RoPE layout goes
            # unnoticed; larger Q/K make each head attend sharply, so position handling must be right.
            layer.self_attn.q_proj.weight.normal_(0, 0.15)
            layer.self_attn.k_proj.weight.normal_(0, 0.15)
            if arch == "qwen2":  # Qwen2's q/k/v biases start at zero; make them matter
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


CASES = {
    "llama-untied-builtin": ("llama", False, "builtin"),
    "mistral-untied-llama3bpe-linearrope": ("mistral", False, "llama3", LINEAR_ROPE),
    "qwen2-tied-qwen2bpe": ("qwen2", True, "qwen2"),
    "llama-tied-llama3bpe-llama3rope": ("llama", True, "llama3", LLAMA3_ROPE),
    "mistral-tied-sentencepiece": ("mistral", True, "sentencepiece"),
}


class Exported:
    """One trained run, its merged HF model, and llama.cpp loaded on its f16 / q8_0 / q4_0 exports."""

    def __init__(self, root: Path, arch: str, tie: bool, tokenizer_kind: str, rope: dict | None = None):
        from maximus.data.tiny_tokenizer import build_tiny_tokenizer
        from maximus.export import load_tuned

        tok = (build_tiny_tokenizer(vocab_size=300) if tokenizer_kind == "builtin"
               else _sentencepiece_bpe() if tokenizer_kind == "sentencepiece" else _byte_bpe(tokenizer_kind))
        base = _model_dir(root / "base", arch, tok, tie, extra_rows=0 if tokenizer_kind == "builtin" else 13, rope=rope)
        self.run = train_tiny_run(base, root / "run", steps=3)
        self.model, self.tokenizer = load_tuned(self.run, merge=True)
        self.files, self.llms = {}, {}
        for quant in ("f16", "q8_0", "q4_0", "q4_k_m"):
            self.files[quant] = root / f"model-{quant}.gguf"
            assert main(["export", str(self.run), "--format", "gguf", "--quant", quant,
                         "--out", str(self.files[quant])]) == 0
            self.llms[quant] = llama_cpp.Llama(str(self.files[quant]), n_ctx=512, n_threads=1, logits_all=True,
                                               verbose=False, seed=0)

    def hf_logits(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.model(input_ids=torch.tensor([ids])).logits[0].double().numpy()

    def llama_logits(self, quant: str, ids: list[int]) -> np.ndarray:
        llm = self.llms[quant]
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)

    def close(self) -> None:
        for llm in self.llms.values():
            llm.close()


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    case = Exported(tmp_path_factory.mktemp(request.param), *CASES[request.param])
    yield case
    case.close()


def test_tokenization_of_held_out_strings_is_equal(exported):
    for text in HELD_OUT:
        hf = exported.tokenizer(text)["input_ids"]
        ours = exported.llms["f16"].tokenize(text.encode("utf-8"), add_bos=True, special=True)
        assert ours == hf, text


def test_greedy_continuation_is_equal_for_f16(exported):
    llm = exported.llms["f16"]
    for prompt in PROMPTS:
        ids = exported.tokenizer(prompt)["input_ids"]
        hf_ids = list(ids)
        for _ in range(32):
            hf_ids.append(int(exported.hf_logits(hf_ids)[-1].argmax()))
        llm.reset()
        llm.eval(ids)
        ours = list(ids)
        for _ in range(32):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            ours.append(token)
            llm.eval([token])
        assert ours == hf_ids, prompt


def test_f16_logits_within_1e_2_relative(exported):
    ids = exported.tokenizer(HELD_OUT_TEXT)["input_ids"]
    hf, ours = exported.hf_logits(ids), exported.llama_logits("f16", ids)
    assert ours.shape == hf.shape
    # relative to each position's largest logit magnitude
    rel = np.abs(ours - hf).max(axis=-1) / np.abs(hf).max(axis=-1)
    assert rel.max() < 1e-2, rel.max()


def _top1_agreement(exported, quant: str) -> float:
    ids = exported.tokenizer(HELD_OUT_TEXT)["input_ids"]
    return float((exported.llama_logits(quant, ids).argmax(-1) == exported.hf_logits(ids).argmax(-1)).mean())


def test_q8_0_top1_agreement_at_least_95_percent(exported):
    assert _top1_agreement(exported, "q8_0") >= 0.95


@pytest.mark.parametrize("quant", ["q4_0", "q4_k_m"])
def test_4bit_top1_agreement_reported(exported, quant, request):
    import gguf

    agreement = _top1_agreement(exported, quant)
    sizes = {q: exported.files[q].stat().st_size for q in exported.files}
    print(f"\n{request.node.callspec.id}: {quant} top-1 agreement {agreement:.1%}, file bytes {json.dumps(sizes)}")
    assert agreement > 0.5  # chance is 1/vocab; a broken 4-bit layout lands near it
    marker = gguf.GGUFReader(str(exported.files[quant])).fields["maximus.export"]
    assert json.loads(bytes(marker.parts[-1]).decode())["quant"] == quant  # llama.cpp's quantiser kept our marker


def test_file_metadata_as_llama_cpp_reads_it(exported):
    llm = exported.llms["f16"]
    meta = llm.metadata
    config = exported.model.config
    arch = "qwen2" if config.model_type == "qwen2" else "llama"
    assert meta["general.architecture"] == arch
    assert int(meta[f"{arch}.context_length"]) == config.max_position_embeddings
    assert int(meta[f"{arch}.attention.head_count_kv"]) == config.num_key_value_heads
    assert float(meta[f"{arch}.rope.freq_base"]) == config.rope_parameters["rope_theta"]
    assert float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]) == pytest.approx(config.rms_norm_eps)
    assert llm.n_vocab() == exported.model.get_input_embeddings().num_embeddings
    assert llm.token_eos() == exported.tokenizer.eos_token_id
    if exported.tokenizer.bos_token_id is not None:
        assert llm.token_bos() == exported.tokenizer.bos_token_id
    if exported.tokenizer.chat_template:
        assert meta["tokenizer.chat_template"] == exported.tokenizer.chat_template
