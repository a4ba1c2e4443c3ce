"""The data pipeline: files or hub datasets -> records -> token rows for the trainer.

    from maximus.data import build_datasets, collate, DataSplits
    splits = build_datasets(cfg.datasets, tokenizer, seq_len=2048, packing=True, seed=0, eval_split=0.05)
    batch = collate(splits.train[:8], tokenizer.pad_token_id)

Modules, in the order data flows: `sources` (read records), `formats` (record shapes), `templates`
(Alpaca and fallback chat templates), `chat` (assistant-token masks), `encoding` (ids + labels),
`preference` (DPO pairs), `packing` (rows), `collate` (tensors), `pipeline` (build_datasets).
User documentation: docs/data.md.
"""
from __future__ import annotations

from maximus.data.collate import collate, flatten
from maximus.data.encoding import IGNORE_INDEX
from maximus.data.chat import chat_prompt_ids
from maximus.data.pipeline import build_datasets, build_run_datasets, trains_on_chat
from maximus.data.splits import DataSplits
from maximus.data.templates import CHATML_TEMPLATE, FALLBACK_CHAT_TEMPLATE, ensure_chat_template
from maximus.data.tiny_tokenizer import build_tiny_tokenizer

__all__ = ["CHATML_TEMPLATE", "DataSplits", "FALLBACK_CHAT_TEMPLATE", "IGNORE_INDEX", "build_datasets",
           "build_run_datasets", "build_tiny_tokenizer", "chat_prompt_ids", "collate", "ensure_chat_template",
           "flatten", "trains_on_chat"]
