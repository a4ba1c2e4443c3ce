"""What the trainer hands its helpers instead of itself: one narrow, typed view per helper.

- `LivePlan`: the plan in force, its one owner. The trainer, its objective, re-planning and the
  run's outputs all read `LivePlan.current`; only re-planning replaces it (between steps), and
  records why in `replans`.
- `RunView`: what an objective reads (`prepare`, `evaluate`, `step_batches`, `sample_step`,
  `after_backward`): the model, tokenizer, data, device, dtype and the step's rows.
- `ReplanView`: what re-planning reads and writes (`maximus.train.replanning`).
- `OutputsView`: what the run's outputs read (`maximus.train.outputs`): plan.json, the header,
  the final weights, run.json.

A view is built by the trainer; a helper that needs a new field gets one here, where the type
says so, rather than a reference to the trainer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from maximus.memory.plan import Plan


@dataclass
class LivePlan:
    """The plan in force (None before the trainer's setup plans the run), the re-plans made so
    far (run.json's and plan.json's `replans`), and the recompute modes applied to the model
    for it (`maximus.memory.checkpointing.apply_checkpointing`'s report)."""

    current: Plan | None = None
    replans: list[dict] = field(default_factory=list)
    checkpointing: Any = None


@dataclass(frozen=True)
class RunView:
    """What an objective reads from the run. `rows_for_step(step)`: this rank's rows of optimizer
    step `step` (1-based); `dist`: the rank's `maximus.train.distributed.DistEnv`; `tasks`: the
    task evaluation (`eval.metrics` / `eval.few_shot`) or None; `meter`: the run's
    `maximus.memory.meter.MemoryMeter` (GRPO's decode loop reports what it holds to it), or None."""

    model: torch.nn.Module
    tokenizer: Any
    data: Any
    device: torch.device
    dtype: torch.dtype
    method: str
    run_dir: Path
    total_steps: int
    dist: Any
    tasks: Any
    rows_for_step: Callable[[int], list[dict]]
    meter: Any = None


@dataclass(frozen=True)
class ReplanView:
    """What re-planning reads and writes. It replaces `live.current` (and `live.checkpointing`,
    appends to `live.replans`); `max_row_tokens` is `training.seq_len` (the longest row, which
    the recompute policy is measured at; `Plan.seq_len` is the estimate's tokens per row, a
    different number); `train_step(step)` runs one optimizer step; `publish()` rewrites plan.json."""

    live: LivePlan
    lengths: Any
    model: torch.nn.Module
    optimizer: Any
    device: torch.device
    meter: Any
    max_row_tokens: int
    train_step: Callable[[int], dict]
    publish: Callable[[], None]


@dataclass(frozen=True)
class OutputsView:
    """What the run's outputs read: the config (resolved, and as written: run.json records
    `builtin:` names as names), the run's parts, and `gathered`, the whole weights the last
    checkpoint gathered under FSDP2 (None otherwise). `streamer`: the frozen-weight streamer or
    None; saving a whole model removes it."""

    cfg: Any
    cfg_as_written: Any
    run_dir: Path
    dist: Any
    live: LivePlan
    model: torch.nn.Module
    tokenizer: Any
    method: str
    device: torch.device
    dtype: torch.dtype
    total_steps: int
    data: Any
    data_report: Any
    kernels: Any
    meter: Any
    optimizer: Any
    streamer: Any
    gathered: Any

    @property
    def plan(self) -> Plan:
        return self.live.current
