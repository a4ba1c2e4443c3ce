"""Packing and collation: whole documents per row, per-document positions, and the proof that
Transformers then keeps packed documents apart (same logits and loss as each document alone)."""
from __future__ import annotations

import random

import pytest
import torch

from maximus.data import IGNORE_INDEX, collate
from maximus.data.encoding import Document
from maximus.data.packing import pack_documents, truncate_documents


def doc(n: int, start: int = 10, prompt: int = 0) -> Document:
    ids = list(range(start, start + n))
    return Document(ids, [IGNORE_INDEX] * prompt + ids[prompt:])


def docs_in_row(row: dict) -> list[list[int]]:
    out: list[list[int]] = []
    for token, pos in zip(row["input_ids"], row["position_ids"]):
        if pos == 0:
            out.append([])
        out[-1].append(token)
    return out


def test_pack_keeps_documents_whole_and_restarts_positions():
    documents = [doc(5, 100), doc(3, 200), doc(4, 300, prompt=2), doc(7, 400), doc(2, 500)]
    rows, stats = pack_documents(documents, seq_len=8, seed=0)
    assert all(len(r["input_ids"]) <= 8 for r in rows)
    placed = sorted(d for r in rows for d in docs_in_row(r))
    assert placed == sorted(d.input_ids for d in documents)  # each document exactly once, whole
    for row in rows:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        assert all(row["labels"][i] == IGNORE_INDEX for i in starts)  # first token of a document: no loss
        for i, (token, label) in enumerate(zip(row["input_ids"], row["labels"])):
            if i not in starts and 300 <= token < 302:
                assert label == IGNORE_INDEX  # the prompt of the 300 document
            elif i not in starts:
                assert label == token
    assert stats.rows == len(rows) == 3 and stats.tokens == 21 and stats.split == 0 and stats.truncated == 0
    assert pack_documents(documents, 8, seed=0)[0] == rows  # deterministic
    assert pack_documents(documents, 8, seed=1)[0] != rows or len(rows) < 2


def test_long_text_documents_are_split_and_prompted_ones_truncated():
    rows, stats = pack_documents([doc(10, 100)], seq_len=4)
    assert sorted(r["input_ids"] for r in rows) == [[100, 101, 102, 103], [104, 105, 106, 107], [108, 109]]
    assert all(r["position_ids"] == list(range(len(r["input_ids"]))) for r in rows)
    assert stats.split == 1
    rows, stats = pack_documents([doc(10, 100, prompt=3)], seq_len=4)
    assert rows == [{"input_ids": [100, 101, 102, 103], "labels": [IGNORE_INDEX] * 3 + [103],
                     "position_ids": [0, 1, 2, 3]}]
    assert stats.truncated == 1


def test_best_fit_fills_rows():
    rng = random.Random(0)
    documents = [doc(rng.randint(20, 300)) for _ in range(400)]
    rows, stats = pack_documents(documents, seq_len=512)
    fill = stats.tokens / (stats.rows * 512)
    assert fill > 0.97, fill


def test_truncate_without_packing_and_rows_without_loss_are_dropped():
    rows, stats = truncate_documents([doc(6, 100), doc(3, 200), doc(4, 300, prompt=4)], seq_len=4)
    assert rows == [{"input_ids": [100, 101, 102, 103], "labels": [IGNORE_INDEX, 101, 102, 103], "position_ids": [0, 1, 2, 3]},
                    {"input_ids": [200, 201, 202], "labels": [IGNORE_INDEX, 201, 202], "position_ids": [0, 1, 2]}]
    assert stats.truncated == 1 and stats.dropped_rows == 1 and stats.loss_tokens == 5


def test_collate_pads_right_with_fresh_positions():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 0]},
            {"input_ids": [8], "labels": [-100], "position_ids": [0]}]
    batch = collate(rows, pad_token_id=1)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 0], [0, 0, 1]]
    assert all(t.dtype == torch.long for t in batch.values())
    assert collate(rows, pad_token_id=None, pad_to_multiple_of=4)["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]

    from transformers.masking_utils import find_packed_sequence_indices

    # Transformers' own reading of these positions: row 0 = two documents, row 1 = token + padding.
    assert find_packed_sequence_indices(batch["position_ids"]).tolist() == [[0, 0, 1], [0, 1, 1]]


def test_collate_preference_rows_share_one_length():
    rows = [{"chosen_input_ids": [1, 2, 3], "chosen_labels": [-100, 2, 3], "rejected_input_ids": [1, 4],
             "rejected_labels": [-100, 4]}]
    batch = collate(rows, pad_token_id=9)
    assert batch["chosen_input_ids"].tolist() == [[1, 2, 3]]
    assert batch["rejected_input_ids"].tolist() == [[1, 4, 9]]
    assert batch["rejected_labels"].tolist() == [[-100, 4, -100]]
    assert batch["rejected_position_ids"].tolist() == [[0, 1, 0]]
    assert batch["chosen_position_ids"].tolist() == [[0, 1, 2]]
    assert set(batch) == {f"{s}_{k}" for s in ("chosen", "rejected") for k in ("input_ids", "labels", "position_ids")}


# ------------------------------------------------------------------------------ model parity

def tiny_model(kind: str, attn: str, vocab: int):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "mistral": transformers.MistralConfig}[kind](**common)
    config._attn_implementation = attn
    model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
             "mistral": transformers.MistralForCausalLM}[kind](config)
    return model.eval()


@pytest.fixture
def packed_batch():
    rng = random.Random(1)
    documents = []
    for n in (9, 5, 12, 3, 7, 11, 4):
        ids = [rng.randrange(4, 100) for _ in range(n)]
        documents.append(Document(ids, [IGNORE_INDEX] * 2 + ids[2:]))
    rows, _ = pack_documents(documents, seq_len=20)
    assert len(rows) >= 2 and any(len(docs_in_row(r)) > 1 for r in rows)
    return rows, collate(rows, pad_token_id=1)


@pytest.mark.parametrize("kind, attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("mistral", "eager")])
def test_packed_logits_equal_each_document_alone(kind, attn, packed_batch):
    rows, batch = packed_batch
    model = tiny_model(kind, attn, vocab=100)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        unpacked = model(input_ids=batch["input_ids"], use_cache=False).logits  # negative control: no position reset
    compared, differs = 0, False
    for r, row in enumerate(rows):
        start = 0
        for ids in docs_in_row(row):
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[r, start:start + len(ids)], alone, atol=2e-5, rtol=1e-4)
            differs |= start > 0 and not torch.allclose(unpacked[r, start:start + len(ids)], alone, atol=1e-3)
            start, compared = start + len(ids), compared + 1
    assert compared == 7 and differs  # every document checked; without the reset they would leak


def test_packed_loss_equals_token_weighted_loss_of_documents_alone(packed_batch):
    rows, batch = packed_batch
    model = tiny_model("llama", "sdpa", vocab=100)
    with torch.no_grad():
        packed_loss = model(**batch, use_cache=False).loss  # Transformers shifts the labels itself
        total, count = 0.0, 0
        for row in rows:
            start = 0
            for ids in docs_in_row(row):
                labels = torch.tensor([row["labels"][start:start + len(ids)]])
                n = int((labels[0, 1:] != IGNORE_INDEX).sum())
                total += model(input_ids=torch.tensor([ids]), labels=labels, use_cache=False).loss.item() * n
                count += n
                start += len(ids)
    assert count == int((batch["labels"] != IGNORE_INDEX).sum())
    assert packed_loss.item() == pytest.approx(total / count, rel=1e-5)
