"""Batch rows into padded tensors.

Why there is no attention_mask: rows are padded on the right, and the padding gets its own
position ids starting at 0, so Transformers sees it as one more packed "document" (see
`maximus.data.packing`). With causal attention, real tokens never attend to padding that comes
after them, and the padding "document" cannot attend to real tokens before it because the
position reset starts a new sequence; padding labels are -100, so it never enters the loss.
Passing `attention_mask=None` is also what lets Transformers detect packed rows at all (it only
derives the packed mask from position ids when no attention mask is given). Pass
`use_cache=False` in training: a cache also disables the packed-sequence detection.
"""
from __future__ import annotations

import torch

from maximus.data.encoding import IGNORE_INDEX

PREFERENCE_SIDES = ("chosen", "rejected")
PAIR_SIDES = ("query", "positive")  # contrastive rows (maximus.data.pairs): ids only, no labels


def collate(rows: list[dict], pad_token_id: int | None = 0, pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Pad rows on the right to the longest one and stack them into `torch.long` tensors.

    SFT rows (`input_ids`, `labels`, `position_ids`) give `input_ids`, `labels`, `position_ids`,
    each of shape (batch, length). Preference rows (`chosen_input_ids`, `chosen_labels`,
    `rejected_input_ids`, `rejected_labels`) give `chosen_input_ids`, `chosen_labels`,
    `chosen_position_ids` and the same three for `rejected`, all padded to one common length so
    the trainer may concatenate chosen and rejected into one forward pass. Contrastive rows
    (`query_input_ids`, `positive_input_ids`) give `query_input_ids`, `query_position_ids` and the
    same two for `positive` (no labels), padded to one common length the same way.

    Args:
        rows: the rows from `build_datasets` (all of one kind).
        pad_token_id: id written in padding; any id works since padding is never attended to nor
            in the loss (None means 0).
        pad_to_multiple_of: round the padded length up to a multiple of this (tensor-core friendly).
    """
    if not rows:
        raise ValueError("collate() needs at least one row")
    pad = 0 if pad_token_id is None else int(pad_token_id)
    if "images" in rows[0]:  # vision-language rows: attention mask and image tensors
        from maximus.data.vision import collate_vision

        return collate_vision(rows, pad, pad_to_multiple_of)
    sides = PREFERENCE_SIDES if "chosen_input_ids" in rows[0] else PAIR_SIDES if "query_input_ids" in rows[0] else None
    if sides is not None:
        keys = [f"{side}_input_ids" for side in sides]
        length = _padded_length(max(len(row[k]) for row in rows for k in keys), pad_to_multiple_of)
        batch: dict[str, torch.Tensor] = {}
        for side in sides:
            side_rows = [{"input_ids": row[f"{side}_input_ids"],
                          "labels": row.get(f"{side}_labels", [IGNORE_INDEX] * len(row[f"{side}_input_ids"]))}
                         for row in rows]
            for name, tensor in _pad(side_rows, pad, length).items():
                if name != "labels" or sides is PREFERENCE_SIDES:
                    batch[f"{side}_{name}"] = tensor
        return batch
    length = _padded_length(max(len(row["input_ids"]) for row in rows), pad_to_multiple_of)
    return _pad(rows, pad, length)


def flatten(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Padding-free micro-batch: the SFT rows' tokens end to end in one row of shape (1, total).

    Every row starts a document at position 0 (`maximus.data.packing`), so the result is one more
    packed row: with padding-free attention (`maximus.attention.varlen`) each document still
    attends only to itself, the first label of every document is already -100, and the loss
    equals that of the padded batch, while no padding token is embedded, projected or scored.
    Preference and contrastive rows keep `collate` (their sides are paired row by row)."""
    if not rows:
        raise ValueError("flatten() needs at least one row")
    if "input_ids" not in rows[0]:
        raise ValueError("flatten() takes SFT rows (input_ids, labels, position_ids)")
    ids, labels, positions = [], [], []
    for row in rows:
        ids.extend(row["input_ids"])
        labels.extend(row["labels"])
        positions.extend(row.get("position_ids") or range(len(row["input_ids"])))
    as_row = lambda values: torch.tensor(values, dtype=torch.long).unsqueeze(0)  # noqa: E731
    return {"input_ids": as_row(ids), "labels": as_row(labels), "position_ids": as_row(positions)}


def _padded_length(longest: int, multiple: int | None) -> int:
    if multiple and multiple > 1:
        return -(-longest // multiple) * multiple
    return longest


def _pad(rows: list[dict], pad: int, length: int) -> dict[str, torch.Tensor]:
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.tensor(row["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.tensor(row["labels"], dtype=torch.long)
        positions = row.get("position_ids")
        position_ids[i, :n] = torch.tensor(positions, dtype=torch.long) if positions is not None else torch.arange(n)
        position_ids[i, n:] = torch.arange(length - n)  # padding: a fresh "document" from position 0
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
