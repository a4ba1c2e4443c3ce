"""What the data check needs to know of each record the pipeline read: where it is, its texts,
how its document fits `seq_len`, and where it went (train, eval, or why nowhere).

The pipeline (`maximus.data.pipeline.build_datasets`) fills one `RecordInfo` per record it
interprets, in the order it reads them, and `maximus.data.check` reads them; nothing here changes
what trains.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from maximus.data.chat import text_of
from maximus.data.encoding import IGNORE_INDEX, Document
from maximus.data.formats import ChatExample, PairExample, PreferenceExample, PromptCompletion, TextExample
from maximus.data.packing import fitted_loss_tokens
from maximus.data.preference import PreferencePair, fit_pair
from maximus.data.prompts import PromptExample

#: Where a record went: a split, or why it trains nowhere.
TRAIN, EVAL = "train", "eval"
EMPTY = "empty"  # nothing to learn (blank text, empty answer, a template that masks everything)
SKIPPED = "skipped"  # a DataError under `on_error: skip` (malformed, a template that refuses it)
DEDUPED = "deduped"  # dropped by data.dedupe
UNTRAINABLE = "untrainable"  # dropped by data.drop_untrainable (trained part cut away by seq_len)

KNOWN_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class RecordInfo:
    """One record as the check sees it. Token counts are of the longer side for a pair."""

    where: str  # "data.jsonl:12" (file and 1-based line) or "data.parquet: row 3"
    source: int  # index of its dataset entry
    position: int  # index of the record in its source, in file order
    prompt: str = ""  # what the model reads before the trained text ("" for plain text)
    answer: str | None = None  # the trained text: completion, assistant turns, chosen answer (None: no answer in this format)
    rejected: str | None = None  # preference pairs: the rejected answer
    texts: list[str] = field(default_factory=list)  # every text of the record (for broken text)
    roles: tuple[str, ...] | None = None  # chat: the roles in order
    dropped_turns: tuple[int, ...] = ()  # chat: messages the template left out of the text
    problem: str | None = None  # why a skipped record could not be used
    tokens: int = 0
    lost_tokens: int = 0  # tokens cut away to fit seq_len
    loss_tokens: int = 0  # trained tokens before the cut
    kept_loss_tokens: int = 0  # trained tokens after the cut
    split: str = EMPTY

    @property
    def file(self) -> str:
        return location(self.where)[0]

    @property
    def line(self) -> int:
        return location(self.where)[1]

    @property
    def content(self) -> str:
        """The text duplicates and leakage are judged on (system turns and templates left out)."""
        return "\n".join(t for t in (self.prompt, self.answer, self.rejected) if t)


def location(where: str) -> tuple[str, int]:
    """(file, 1-based line or row) of a `where` string ("a.jsonl:12", "a.parquet: row 3")."""
    head, _, tail = where.rpartition(":")
    number = tail.strip().removeprefix("row").strip()
    return (head, int(number)) if head and number.isdigit() else (where, 0)


def describe(example, where: str, source: int, position: int, fields: dict | None = None) -> RecordInfo:
    """The texts of an interpreted record. `fields`: the raw record, for alpaca (whose prompt
    text carries the shared Alpaca template, which would make all short records look alike)."""
    info = RecordInfo(where, source, position)
    if isinstance(example, TextExample):
        info.texts = [example.text]
        info.prompt = example.text
    elif isinstance(example, PromptCompletion):
        if fields is not None and "instruction" in fields:
            parts = [fields.get("instruction"), fields.get("input")]
            info.prompt = "\n".join(str(p) for p in parts if p)
        else:
            info.prompt = example.prompt
        info.answer = example.completion
        info.texts = [example.prompt, example.completion]
    elif isinstance(example, ChatExample):
        _chat_texts(info, example.messages)
    elif isinstance(example, PreferenceExample):
        prompt = example.prompt
        info.prompt = _joined(prompt) if isinstance(prompt, list) else (prompt or "")
        info.answer = _joined(example.chosen, answers=True)
        info.rejected = _joined(example.rejected, answers=True)
        info.texts = [t for t in (info.prompt, info.answer, info.rejected) if t]
        if isinstance(example.chosen, list):
            info.roles = tuple(m["role"] for m in (prompt if isinstance(prompt, list) else []) + example.chosen)
    elif isinstance(example, PairExample):
        info.prompt = f"{example.query}\n{example.positive}"
        info.texts = [example.query, example.positive]
    elif isinstance(example, PromptExample):
        if isinstance(example.prompt, list):
            _chat_texts(info, example.prompt)
        else:
            info.prompt, info.texts = example.prompt, [example.prompt]
    return info


def measure(info: RecordInfo, document, seq_len: int, packing: bool) -> None:
    """Fill the token counts of `info` from its document as the pipeline fits it to seq_len."""
    if isinstance(document, Document):
        info.tokens = len(document.input_ids)
        info.loss_tokens = sum(label != IGNORE_INDEX for label in document.labels[1:])
        info.lost_tokens, info.kept_loss_tokens = fitted_loss_tokens(document, seq_len, packing)
        info.dropped_turns = document.dropped_turns
    elif isinstance(document, PreferencePair):
        sides = (document.chosen, document.rejected)
        info.tokens = max(len(d.input_ids) for d in sides)
        info.loss_tokens = min(sum(label != IGNORE_INDEX for label in d.labels) for d in sides)
        fitted, _ = fit_pair(document, seq_len)
        info.lost_tokens = sum(len(d.input_ids) for d in sides) - sum(len(d.input_ids) for d in (fitted.chosen, fitted.rejected))
        info.kept_loss_tokens = min(sum(label != IGNORE_INDEX for label in d.labels) for d in (fitted.chosen, fitted.rejected))
        info.dropped_turns = tuple(sorted(set(document.chosen.dropped_turns) | set(document.rejected.dropped_turns)))
    elif isinstance(document, dict):  # a contrastive pair row or a GRPO prompt row: nothing is trained on labels
        lengths = [len(v) for k, v in document.items() if k.endswith("_ids")]
        info.tokens = max(lengths, default=0)
        info.lost_tokens = sum(max(0, n - seq_len) for n in lengths)
        info.loss_tokens = info.kept_loss_tokens = info.tokens


def _chat_texts(info: RecordInfo, messages: list) -> None:
    info.roles = tuple(m["role"] for m in messages)
    info.texts = [text_of(m["content"]) for m in messages]
    info.prompt = "\n".join(text_of(m["content"]) for m in messages if m["role"] not in ("system", "assistant"))
    info.answer = "\n".join(text_of(m["content"]) for m in messages if m["role"] == "assistant")


def _joined(value, answers: bool = False) -> str:
    if not isinstance(value, list):
        return value or ""
    return "\n".join(text_of(m["content"]) for m in value
                     if m["role"] != "system" and (m["role"] == "assistant") == answers)
