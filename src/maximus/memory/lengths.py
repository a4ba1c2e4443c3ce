"""The token lengths of the rows a run really trains on, for the planner.

Tokenization happens before planning, so the planner need not assume that every row is
``training.seq_len`` tokens long (``seq_len`` is the cap that truncates, rarely the length of
unpacked rows). `RowLengths` holds, per optimizer step and rank, the lengths of the rows in the
order the loader serves them (the trainer's seeded sampler: `maximus.train.order`), and answers
the one question the planner asks: how large is the largest micro-batch the loader will really
form with ``rows`` rows per micro-batch (`largest_micro_batch`)?

A micro-batch is either padded to its longest row (``rows x longest`` tokens: `collate`) or, for
unpacked SFT rows under padding-free attention, laid end to end unpadded (the sum of its rows:
`maximus.data.flatten`); `flattened(rows, tokens)` says which, with the trainer's own rule.
A padded SFT micro-batch whose rows hold several documents (packed rows, or padding, which
restarts the positions) is attended either one SDPA call per document or, when the documents
are many and short, with one masked call per row (`maximus.attention.varlen.per_document`); the
masked call keeps more for backward, so `MicroBatch.masked` says whether any micro-batch of the
run takes it.
A preference pair (DPO) or a contrastive pair counts as one row of its longer side (both sides
are padded to one length); a GRPO rollout row is its prompt plus ``max_completion_tokens``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

__all__ = ["RowLengths", "MicroBatch", "TokenSplit", "split_by_tokens"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the loader forms it: ``rows`` rows, the ``longest`` of them (tokens),
    and ``tokens``, the tokens the forward pass really holds (padding included). ``masked``: its
    attention is one SDPA call per row with a ``[rows, 1, longest, longest]`` document mask; for
    the largest micro-batch of a run (`RowLengths.largest_micro_batch`), whether any is."""

    rows: int
    longest: int
    tokens: int
    masked: bool = False

    @property
    def row_tokens(self) -> int:
        """Tokens per row the estimator is given for it (``tokens / rows``, rounded up): memory grows
        with the micro-batch's tokens, so a padded or a flattened micro-batch is planned as that."""
        return math.ceil(self.tokens / self.rows)


def split_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of one step's rows in micro-batches of at most ``budget`` padded tokens: the rows
    longest first (ties: loader order), each micro-batch taking rows while ``rows x its longest
    row`` fits (a row longer than the budget alone). The step's loss is a sum over its rows
    divided by the step's units, so any split gives the same loss and gradients."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(frozen=True)
class TokenSplit:
    """What splitting every step by a token budget gives over the run: the micro-batch with the
    most tokens (``largest``), the most rows one micro-batch holds, the most micro-batches one
    step has."""

    largest: MicroBatch
    rows: int
    micro_batches: int


@dataclass(frozen=True)
class RowLengths:
    """Row lengths (tokens) per optimizer step and rank, in the loader's order.

    ``steps``: one tuple of row lengths per (optimizer step, rank), as the loader splits it into
    micro-batches. ``cap``: ``training.seq_len``. ``flatten``: the trainer's rule ``(rows, tokens)
    -> bool`` for a micro-batch going in unpadded (None: always padded). ``notes``: what the plan
    should say about the data (rows cut to the cap). ``images_per_row``: the most images a row has.
    ``documents``: per step and row, the documents packed in it (None: one each). ``per_document``:
    the attention's rule ``(documents, tokens) -> bool`` for a padded micro-batch whose rows hold
    several documents: True, one SDPA call per document; False, one masked call per row (None:
    attention never takes a mask)."""

    steps: tuple[tuple[int, ...], ...]
    cap: int
    flatten: Callable[[int, int], bool] | None = None
    notes: tuple[str, ...] = ()
    #: The most images one row holds (vision-language rows; 1 for text): the tower's load per row.
    images_per_row: int = 1
    documents: tuple[tuple[int, ...], ...] | None = None
    per_document: Callable[[int, int], bool] | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def longest(self) -> int:
        """The longest row of the run (tokens)."""
        return max((max(s) for s in self.steps if s), default=0)

    @property
    def uneven(self) -> bool:
        """Whether rows differ in length (a padded micro-batch then needs an attention mask)."""
        return len({n for s in self.steps for n in s}) > 1

    def micro_batch_of(self, lengths: Sequence[int], documents: Sequence[int] | None = None) -> MicroBatch:
        """The micro-batch of these rows (holding `documents` each; None: one) as the loader forms
        it: padded, or flattened when the rule says so; attended with a mask when that rule says so."""
        longest, total = max(lengths), sum(lengths)
        flat = self.flatten is not None and self.flatten(len(lengths), total)
        masked = False
        if not flat and self.per_document is not None:
            # Padding restarts the positions: one more document in every row shorter than the longest.
            docs = sum(documents or [1] * len(lengths)) + sum(1 for n in lengths if n < longest)
            masked = docs > len(lengths) and not self.per_document(docs, len(lengths) * longest)
        return MicroBatch(len(lengths), longest, total if flat else len(lengths) * longest, masked)

    def _documents(self, step: int, indices: Sequence[int]) -> list[int] | None:
        return None if self.documents is None else [self.documents[step][i] for i in indices]

    def largest_micro_batch(self, rows: int) -> MicroBatch:
        """The micro-batch with the most tokens over the whole run when each step's rows are cut
        into micro-batches of ``rows`` rows in loader order (the trainer's split)."""
        if rows not in self._cache:
            worst, masked = MicroBatch(rows, 1, rows), False
            for s, step in enumerate(self.steps):
                for i in range(0, len(step), rows):
                    mb = self.micro_batch_of(step[i:i + rows], self._documents(s, range(i, min(i + rows, len(step)))))
                    masked = masked or mb.masked
                    if mb.tokens > worst.tokens or (mb.tokens == worst.tokens and mb.longest > worst.longest):
                        worst = mb
            self._cache[rows] = replace(worst, masked=masked)
        return self._cache[rows]

    def token_split(self, budget: int) -> TokenSplit:
        """`TokenSplit` of the run when each step's rows are split by `split_by_tokens(budget)`."""
        key = ("tokens", budget)
        if key not in self._cache:
            worst, rows, count, masked = MicroBatch(1, 1, 1), 1, 1, False
            for s, step in enumerate(self.steps):
                groups = split_by_tokens(step, budget)
                count = max(count, len(groups))
                for g in groups:
                    mb = self.micro_batch_of([step[i] for i in g], self._documents(s, g))
                    rows, masked = max(rows, mb.rows), masked or mb.masked
                    if mb.tokens > worst.tokens or (mb.tokens == worst.tokens and mb.longest > worst.longest):
                        worst = mb
            self._cache[key] = TokenSplit(replace(worst, masked=masked), rows, count)
        return self._cache[key]
