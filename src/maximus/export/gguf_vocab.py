"""A Hugging Face tokenizer as llama.cpp's GGUF vocabulary: tokens, token types, merges, special
tokens, add-bos/eos and the chat template.

llama.cpp does not run the tokenizer.json pipeline; it picks a tokenizer by name (`tokenizer.ggml.model`)
and a pre-tokenizer regex by name (`tokenizer.ggml.pre`). So the tokenizer is classified here by
its structure, and anything that does not match a pipeline llama.cpp implements exactly is refused:

| tokenizer.json | GGUF model / pre |
|---|---|
| byte-level BPE, `ByteLevel(use_regex=True)` (GPT-2 regex) | `gpt2` / `gpt-2` |
| byte-level BPE, Llama-3 split regex, `ignore_merges` | `gpt2` / `llama-bpe` |
| byte-level BPE, Qwen2 split regex (single digits) | `gpt2` / `qwen2` |
| SentencePiece-style BPE with byte fallback (Llama 2, Mistral) | `llama` (scores from merge ranks) |

Merges, special-token ids and the chat template are read by the `gguf` package's own `SpecialVocab`
(llama.cpp's converter code), from the tokenizer and config saved to a scratch directory.
"""
from __future__ import annotations

import json
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from maximus.errors import ExportError

# The split patterns of Llama 3 and Qwen2 tokenizers, as their tokenizer.json files carry them.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_TOKENIZERS = "byte-level BPE (GPT-2, Llama-3 or Qwen2 pre-tokenizer) and SentencePiece-style BPE with byte fallback"


@dataclass
class GGUFVocab:
    model: str                  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None             # tokenizer.ggml.pre (BPE only)
    tokens: list[str]
    token_types: list[int]      # gguf.TokenType values
    scores: list[float] | None  # SentencePiece only
    add_bos: bool
    add_eos: bool


def _pre_tokenizer_name(tj: dict) -> str | None:
    """The llama.cpp pre-tokenizer matching a byte-level BPE tokenizer.json, or None."""
    pre = tj.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False):
        return "gpt-2"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    if (byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True) or split.get("type") != "Split"
            or split.get("behavior") != "Isolated" or split.get("invert")):
        return None
    pattern = (split.get("pattern") or {}).get("Regex")
    if pattern == LLAMA3_SPLIT and tj["model"].get("ignore_merges"):
        return "llama-bpe"
    if pattern == QWEN2_SPLIT and not tj["model"].get("ignore_merges"):
        return "qwen2"
    return None


def _normalizer_ok(tj: dict, pre: str) -> bool:
    norm = tj.get("normalizer")
    # Qwen2 tokenizers apply NFC; llama.cpp does not, so only text that is already NFC (nearly all)
    # tokenizes the same. Any other normalizer changes text llama.cpp would leave as it is.
    return norm is None or (pre == "qwen2" and norm.get("type") == "NFC")


def _is_sentencepiece_bpe(tj: dict) -> bool:
    model, norm, dec = tj["model"], tj.get("normalizer") or {}, tj.get("decoder") or {}
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    replaces_space = any(s.get("type") == "Replace" and s.get("content") == "\u2581" for s in steps)
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and replaces_space and dec.get("type") == "Sequence"


def _adds_special(tokenizer) -> tuple[bool, bool]:
    with_special = tokenizer("a b", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a b", add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    add_bos = bos is not None and len(with_special) > len(plain) and with_special[0] == bos
    add_eos = eos is not None and len(with_special) > len(plain) and with_special[-1] == eos
    return add_bos, add_eos


def build_vocab(tokenizer, vocab_rows: int) -> GGUFVocab:
    """The GGUF vocabulary of `tokenizer` for a model with `vocab_rows` embedding rows (extra rows
    become unused padding tokens, as llama.cpp needs one token per row).

    Raises ExportError for a slow tokenizer, a pipeline llama.cpp does not implement, or more tokens
    than embedding rows."""
    import gguf

    if not getattr(tokenizer, "is_fast", False):
        raise ExportError(f"the tokenizer ({type(tokenizer).__name__}) has no tokenizer.json",
                          f"GGUF export supports {SUPPORTED_TOKENIZERS} from a fast tokenizer")
    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = _pre_tokenizer_name(tj) if tj["model"].get("type") == "BPE" and not tj["model"].get("byte_fallback") else None
    if pre is not None and not _normalizer_ok(tj, pre):
        pre = None
    sentencepiece = pre is None and _is_sentencepiece_bpe(tj)
    if pre is None and not sentencepiece:
        kind = tj["model"].get("type")
        pre_kind = (tj.get("pre_tokenizer") or {}).get("type")
        raise ExportError(f"the tokenizer ({kind} model, {pre_kind} pre-tokenizer) has no exact llama.cpp equivalent",
                          f"GGUF export supports {SUPPORTED_TOKENIZERS}")
    vocab = tokenizer.get_vocab()
    if len(vocab) > vocab_rows:
        raise ExportError(f"the tokenizer has {len(vocab)} tokens but the model only {vocab_rows} embedding rows",
                          "export the tokenizer the model was trained with")
    by_id = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    merge_rank: dict[str, int] = {}
    if sentencepiece:
        for rank, merge in enumerate(tj["model"].get("merges", [])):
            a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
            merge_rank.setdefault(a + b, rank)
    tokens, types, scores = [], [], []
    for i in range(vocab_rows):
        token = by_id.get(i)
        score = 0.0
        if token is None:
            token, kind = f"[PAD{i}]", gguf.TokenType.UNUSED
        elif i in added:
            kind = gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED
        elif sentencepiece and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            kind = gguf.TokenType.BYTE
        else:
            kind = gguf.TokenType.NORMAL
            if sentencepiece:  # llama.cpp's SentencePiece merges the highest score first: the earliest merge
                score = -float(merge_rank.get(token, len(merge_rank) + i)) if len(token) > 1 else 0.0
        tokens.append(token)
        types.append(int(kind))
        scores.append(score)
    if sentencepiece and tj["model"].get("unk_token") in vocab:
        types[vocab[tj["model"]["unk_token"]]] = int(gguf.TokenType.UNKNOWN)
    add_bos, add_eos = _adds_special(tokenizer)
    return GGUFVocab(model="llama" if sentencepiece else "gpt2", pre=pre, tokens=tokens, token_types=types,
                     scores=scores if sentencepiece else None, add_bos=add_bos, add_eos=add_eos)


def write_vocab(writer, tokenizer, model_config, vocab_rows: int) -> GGUFVocab:
    """Add the tokenizer's keys to a `gguf.GGUFWriter`; returns what was written."""
    import gguf

    vocab = build_vocab(tokenizer, vocab_rows)
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    with tempfile.TemporaryDirectory(prefix="maximus-gguf-vocab-") as scratch:
        tokenizer.save_pretrained(scratch)
        model_config.to_json_file(str(Path(scratch) / "config.json"))
        # Its warnings concern pair templates (two-sequence inputs), which a causal LM export never uses.
        vocab_log = logging.getLogger("gguf.vocab")
        level = vocab_log.level
        vocab_log.setLevel(logging.ERROR)
        try:
            special = gguf.SpecialVocab(scratch, load_merges=vocab.model == "gpt2", n_vocab=vocab_rows)
        finally:
            vocab_log.setLevel(level)
    if tokenizer.bos_token_id is None:
        special.special_token_ids.pop("bos", None)
    special.add_special_token = {"bos": vocab.add_bos, "eos": vocab.add_eos}
    if isinstance(tokenizer.chat_template, str):
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(writer, quiet=True)
    return vocab
