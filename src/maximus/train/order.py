"""Which rows each optimizer step trains on, and how long they are, before the model loads.

The trainer's sampler: the global row stream is the concatenation of per-epoch permutations
(seeded by ``training.seed`` and the epoch), ``batch_size`` rows per optimizer step, so a step's
rows depend on the step number alone (resume needs nothing else). Under torchrun each rank takes
its contiguous slice of a step's rows (`maximus.train.distributed.DistEnv.shard`).

`run_lengths` walks that order for every step of the run and gives the planner
(`maximus.memory.plan_run`) the length of every row each rank will see
(`maximus.memory.lengths.RowLengths`): the planner then plans for the largest micro-batch the
loader really forms, not for rows of ``training.seq_len`` tokens.
"""
from __future__ import annotations

import math

import torch

from maximus.memory.lengths import RowLengths
from maximus.structure import documents_in

__all__ = ["RowOrder", "row_length", "run_lengths", "run_steps", "read_lengths"]


class RowOrder:
    """Row indices of each optimizer step: ``step(s)`` (1-based) for ``n_rows`` rows, ``batch_size``
    rows per step, seeded by ``seed`` (one permutation per epoch, the latest one cached)."""

    def __init__(self, n_rows: int, batch_size: int, seed: int):
        self.n_rows, self.batch_size, self.seed = n_rows, batch_size, seed
        self._epoch: tuple[int, torch.Tensor] | None = None

    def epoch(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(self.n_rows, generator=g))
        return self._epoch[1]

    def step(self, step: int) -> list[int]:
        b, n = self.batch_size, self.n_rows
        out = []
        for pos in range((step - 1) * b, step * b):
            epoch, idx = divmod(pos, n)
            out.append(int(self.epoch(epoch)[idx]))
        return out


def run_steps(cfg, n_rows: int) -> int:
    """Optimizer steps of the run `cfg` over `n_rows` training rows: ``max_steps``, else the epochs'
    steps (GRPO: each generation of ``batch_size`` prompts serves ``steps_per_generation x
    updates_per_generation`` steps)."""
    t = cfg.training
    if t.max_steps:
        return t.max_steps
    g = cfg.grpo
    updates = g.updates_per_generation * g.steps_per_generation if cfg.objective == "grpo" else 1
    return max(1, math.ceil(t.epochs * n_rows / t.batch_size)) * updates


def read_lengths(cfg, *, world_size: int = 1) -> RowLengths:
    """`run_lengths` of the run `cfg`, read from its data as the trainer reads it (the tokenizer
    and the data files; no weights): for `maximus plan --config` and benchmarks.

    Raises DataError / ModelError as `maximus-train` would (no data, no tokenizer)."""
    from maximus.data import build_run_datasets
    from maximus.model_source import resolve_source
    from maximus.models import load_tokenizer

    # The model's own tokenizer needs its source (resolved once, for the data too); a separate
    # `tokenizer:` lets a model that is not on this machine be planned from its known shape.
    source = None if cfg.tokenizer else resolve_source(cfg)
    rows = build_run_datasets(cfg, load_tokenizer(cfg, source), source=source).train
    return run_lengths(cfg, rows, steps=run_steps(cfg, len(rows)), world_size=world_size)


def row_length(row: dict) -> int:
    """Tokens of one training row as a micro-batch pads it: an SFT row's ids; the longer side of a
    preference or contrastive pair (both sides are padded to one length); a GRPO prompt's ids."""
    for keys in (("input_ids",), ("chosen_input_ids", "rejected_input_ids"), ("query_input_ids", "positive_input_ids"),
                 ("prompt_ids",)):
        if keys[0] in row:
            return max(len(row[k]) for k in keys)
    raise ValueError(f"not a training row: keys {sorted(row)}")


def run_lengths(cfg, rows: list[dict], *, steps: int, world_size: int = 1) -> RowLengths:
    """The row lengths of every optimizer step of the run `cfg` over the training `rows`, per rank
    (`RowLengths`). GRPO: each prompt of a generation becomes ``group_size`` rollout rows of the
    prompt plus ``max_completion_tokens`` (the longest completion the sampler may draw), one
    generation per ``steps_per_generation x updates_per_generation`` steps, each of its
    ``steps_per_generation`` shares one step's rows. Unpacked SFT rows go in unpadded when the
    trainer would flatten them (padding-free attention, which Kronecker Sketching replaces)."""
    t = cfg.training
    order = RowOrder(len(rows), t.batch_size, t.seed)
    lengths = [row_length(r) for r in rows]
    docs = [documents_in(r.get("position_ids")) for r in rows] if cfg.objective == "sft" else None
    images = max((len(r["images"].paths) for r in rows if "images" in r), default=1)  # vision-language rows
    extra, repeat, every, shares = 0, 1, 1, 1
    if cfg.objective == "grpo":
        g = cfg.grpo
        extra, repeat, shares = g.max_completion_tokens, g.group_size, g.steps_per_generation
        every = g.updates_per_generation * shares
    per = -(-t.batch_size // world_size)
    out = []
    for step in range(1, steps + 1, every):
        step_lengths = [lengths[i] + extra for i in order.step((step - 1) // every + 1)]
        for rank in range(world_size):
            rows = tuple(n for n in step_lengths[rank * per:(rank + 1) * per] for _ in range(repeat))
            share = len(rows) // shares  # GRPO's steps_per_generation: each step trains on its share
            out.extend(rows[k * share:(k + 1) * share] for k in range(shares))
    flatten = by_document = documents = None
    if cfg.objective == "sft" and cfg.optimization.kronecker is None:
        from maximus.attention.varlen import per_document

        flatten = None if t.packing else per_document
        by_document = per_document  # padding-free attention's rule (else one masked call per row)
        documents = tuple(tuple(docs[i] for i in order.step(step)[rank * per:(rank + 1) * per])
                          for step in range(1, steps + 1) for rank in range(world_size))
    cap = t.seq_len
    notes = ()
    if lengths and min(lengths) >= cap:
        notes = (f"every training row reached training.seq_len ({cap:,} tokens) and was cut to it: the plan "
                 f"assumes rows of {cap:,} tokens",)
    return RowLengths(steps=tuple(out), cap=cap, flatten=flatten, notes=notes, images_per_row=max(1, images),
                      documents=documents, per_document=by_document)
