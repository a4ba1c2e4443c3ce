"""What a dataset build returns (`DataSplits`) and how many documents it holds out: shared by the
text pipeline (`maximus.data.pipeline`) and the image + text one (`maximus.data.vision`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataSplits:
    """Rows for training and held-out evaluation, and what building them did.

    `stats` keys: records (read), skipped (bad records skipped under on_error: skip), empty
    (records with nothing to learn, e.g. blank text, dropped), documents (kept), train_documents,
    eval_documents, rows / eval_rows, tokens / eval_tokens (tokens in the rows), loss_tokens /
    eval_loss_tokens (tokens with a label), split (text documents longer than seq_len split into pieces),
    truncated (documents or pairs cut to seq_len), dropped_rows (rows without loss tokens), fill
    (train tokens / (train rows x seq_len): how full rows are; padding makes up the rest),
    chat_template_fallback (the fallback chat template was installed on the tokenizer), sources
    (per spec: path, format, records, skipped, documents), eval_sources (the same for `eval.dataset`).

    `train_where` / `eval_where`: the record (`data.jsonl:12`) of each training / held-out
    document, in split order (SFT data; empty for the other objectives), so that evaluation can
    go back to the records (`maximus.evaluate.tasks`).

    `records`: one `maximus.data.records.RecordInfo` per record read, in reading order, with the
    split it went to (what `maximus.data.check` examines; empty for image + text data).
    `preview`: the first training documents (`maximus.data.encoding.Document`, SFT data), for the
    template preview."""

    train: list[dict]
    eval: list[dict]
    stats: dict = field(default_factory=dict)
    train_where: list[str] = field(default_factory=list)
    eval_where: list[str] = field(default_factory=list)
    records: list = field(default_factory=list)
    preview: list = field(default_factory=list)


def eval_count(n_documents: int, eval_split: float) -> int:
    """Held-out documents for `eval_split` of `n_documents`: at least one, never all."""
    if eval_split <= 0 or n_documents < 2:
        return 0
    return min(n_documents - 1, max(1, round(eval_split * n_documents)))
