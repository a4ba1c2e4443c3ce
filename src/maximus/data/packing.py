"""Cut documents into training rows of at most seq_len tokens.

Packing (`pack_documents`): whole documents are placed into rows of at most seq_len tokens by
best-fit decreasing (longest document first, into the row whose free space fits it most tightly),
then the rows are shuffled with the seed. Rows are typically > 95% full; `collate` pads the rest.
Documents are not cut at row boundaries: a cut prompt/completion document would put an answer in
a row without its question, teaching answers out of context (torchtune and TRL avoid this by
default for the same reason). A document longer than seq_len is split into independent seq_len
pieces when every token of it is in the loss (plain text: each piece is a valid text sample), and
truncated to its first seq_len tokens otherwise (it has a prompt; counted in `truncated`).

`position_ids` restart at 0 at every document (piece) start, which is how Transformers (>= 5)
recognises packed rows: with `attention_mask=None`, no cache, and position ids given,
`masking_utils.find_packed_sequence_indices` starts a new sequence wherever the position does not
grow by one, and attention never crosses that boundary (SDPA, eager and flash-attention alike).

Without packing (`truncate_documents`): one document per row, in order, cut to its first seq_len
tokens.

In both, the label of the first token of every document (or piece) is -100: after the trainer's
shift it would be the target of the previous document's last token, which cannot see it. Hence
the loss of a packed row is exactly the sum of the losses of its documents alone. Rows left with
no token in the loss are dropped.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from maximus.data.encoding import IGNORE_INDEX, Document


@dataclass
class RowStats:
    """What cutting did: rows made, documents split or truncated, rows dropped."""

    rows: int = 0
    tokens: int = 0  # tokens in the kept rows
    loss_tokens: int = 0  # tokens with a label in the kept rows
    split: int = 0  # documents longer than seq_len split into pieces (packing, text only)
    truncated: int = 0  # documents cut to seq_len, the rest dropped
    dropped_rows: int = 0  # rows without any token in the loss


def pack_documents(documents: list[Document], seq_len: int, seed: int = 0) -> tuple[list[dict], RowStats]:
    """Rows `{"input_ids", "labels", "position_ids"}` of at most seq_len tokens, whole documents each."""
    stats = RowStats()
    pieces = []  # (ids, labels) of at most seq_len tokens
    for doc in documents:
        if len(doc.input_ids) <= seq_len:
            pieces.append(doc)
        elif splits_into_pieces(doc):
            stats.split += 1
            pieces.extend(Document(doc.input_ids[i:i + seq_len], doc.labels[i:i + seq_len])
                          for i in range(0, len(doc.input_ids), seq_len))
        else:
            stats.truncated += 1
            pieces.append(Document(doc.input_ids[:seq_len], doc.labels[:seq_len]))

    # Best-fit decreasing; `free` holds (free tokens, row index), sorted, for rows that can take more.
    order = sorted(range(len(pieces)), key=lambda i: (-len(pieces[i].input_ids), i))
    rows: list[dict] = []
    free: list[tuple[int, int]] = []
    for i in order:
        piece = pieces[i]
        length = len(piece.input_ids)
        at = bisect.bisect_left(free, (length, -1))
        if at < len(free):
            space, row_index = free.pop(at)
        else:
            space, row_index = seq_len, len(rows)
            rows.append(_empty_row())
        _append_piece(rows[row_index], piece, 0, length)
        if space - length > 0:
            bisect.insort(free, (space - length, row_index))
    random.Random(seed).shuffle(rows)
    kept: list[dict] = []
    for row in rows:
        _emit(row, kept, stats)
    return kept, stats


def splits_into_pieces(doc: Document) -> bool:
    """Whether packing splits an over-long document into pieces (every token after the first is
    in the loss: plain text) rather than truncating it to its first seq_len tokens."""
    return all(label != IGNORE_INDEX for label in doc.labels[1:])


def fitted_loss_tokens(doc: Document, seq_len: int, packing: bool) -> tuple[int, int]:
    """(tokens cut away, trained tokens left) when `doc` is fitted into rows of `seq_len` tokens
    the way `pack_documents` (packing) or `truncate_documents` does it."""
    if len(doc.input_ids) <= seq_len or (packing and splits_into_pieces(doc)):
        return 0, sum(label != IGNORE_INDEX for label in doc.labels[1:])
    return len(doc.input_ids) - seq_len, sum(label != IGNORE_INDEX for label in doc.labels[1:seq_len])


def truncate_documents(documents: list[Document], seq_len: int) -> tuple[list[dict], RowStats]:
    """One row per document, in order, cut to seq_len tokens."""
    stats = RowStats()
    rows: list[dict] = []
    for doc in documents:
        row = _empty_row()
        take = min(seq_len, len(doc.input_ids))
        stats.truncated += take < len(doc.input_ids)
        _append_piece(row, doc, 0, take)
        _emit(row, rows, stats)
    return rows, stats


def _empty_row() -> dict:
    return {"input_ids": [], "labels": [], "position_ids": []}


def _append_piece(row: dict, doc: Document, offset: int, length: int) -> None:
    row["input_ids"].extend(doc.input_ids[offset:offset + length])
    labels = doc.labels[offset:offset + length]
    labels[0] = IGNORE_INDEX  # nothing in this row predicts a piece's first token
    row["labels"].extend(labels)
    row["position_ids"].extend(range(length))


def _emit(row: dict, rows: list[dict], stats: RowStats) -> None:
    loss_tokens = sum(label != IGNORE_INDEX for label in row["labels"])
    if loss_tokens == 0:
        stats.dropped_rows += 1
        return
    rows.append(row)
    stats.rows += 1
    stats.tokens += len(row["input_ids"])
    stats.loss_tokens += loss_tokens
