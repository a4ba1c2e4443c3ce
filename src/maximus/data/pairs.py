"""(query, positive) pairs for contrastive embedding training (`objective: contrastive`).

Each side is tokenized exactly as `maximus.embed` tokenizes a text at inference time
(`embedding_ids`: the tokenizer's own special tokens, e.g. BOS for Llama, no EOS; cut from the
right to the token limit), so a trained model is used on the token sequences it was trained on.
A row is `{"query_input_ids": [...], "positive_input_ids": [...]}`: no labels (nothing is
predicted); `maximus.data.collate` pads both sides to one length so the trainer runs them as one
forward.
"""
from __future__ import annotations

from collections.abc import Sequence

from maximus.data.formats import PairExample

SIDES = ("query", "positive")


def embedding_ids(tokenizer, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids of each text as an embedding input: special tokens added, then cut to the first
    `max_length` tokens (None: all). The one tokenization of training pairs and `maximus.embed`."""
    ids = tokenizer(list(texts), add_special_tokens=True, verbose=False)["input_ids"]
    return [list(x[:max_length]) if max_length is not None else list(x) for x in ids]


def encode_pair(tokenizer, example: PairExample) -> dict | None:
    """The uncut row of a pair, or None when a side is blank (nothing to embed)."""
    if not example.query.strip() or not example.positive.strip():
        return None
    query, positive = embedding_ids(tokenizer, [example.query, example.positive])
    if not query or not positive:
        return None
    return {"query_input_ids": query, "positive_input_ids": positive}


def fit_pair_row(row: dict, seq_len: int) -> tuple[dict, bool]:
    """Each side cut to its first `seq_len` tokens (as `embedding_ids` cuts); (row, was_truncated)."""
    truncated = any(len(row[f"{side}_input_ids"]) > seq_len for side in SIDES)
    return {f"{side}_input_ids": row[f"{side}_input_ids"][:seq_len] for side in SIDES}, truncated
