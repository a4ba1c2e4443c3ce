"""`maximus.MemoryCallback`: Maximus's memory meter inside a `transformers.Trainer` (or TRL) run.

Each training log gains ``memory_bytes`` (live tensors after the step), ``peak_memory_bytes``
(the highest level since the previous log) and, with a budget, ``budget_bytes``; they go into
``trainer.state.log_history`` and the printed logs. With a budget, the first step whose measured
peak exceeds it stops the run (``control.should_training_stop``) with one line on stderr.

The meter is `maximus.memory.meter.MemoryMeter`: the CUDA allocator's counters on a GPU (free),
a tracker of live tensor storages elsewhere (it sees every op, so a CPU step runs somewhat
slower while it is on). Report-to integrations (TensorBoard, W&B) that run before this callback
in the trainer's list do not see the keys; put it first (``trainer.callback_handler.callbacks.insert(0, cb)``)
for them to.
"""
from __future__ import annotations

import sys
from typing import Any

from transformers import TrainerCallback

from maximus.config import format_bytes


class MemoryCallback(TrainerCallback):
    """Log current / peak / budget memory per step; stop the run when the peak passes ``budget``.

    budget: a size (``"16GB"``), bytes, a card name, ``auto`` or None (log only);
    see `maximus.memory.planner.resolve_budget`."""

    def __init__(self, budget: Any = None):
        self.budget = budget
        self.budget_bytes: int | None = None
        self.meter = None
        self.stopped_message: str | None = None
        self._tracking = None
        self._peak_since_log = 0

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from maximus.memory.meter import MemoryMeter
        from maximus.memory.planner import resolve_budget

        from maximus.structure import compute_device

        device = compute_device(model) if model is not None else args.device
        self.budget_bytes = resolve_budget(self.budget, device.type) if self.budget is not None else None
        self.meter = MemoryMeter(device, budget_bytes=self.budget_bytes)
        self._objects = tuple(o for o in (model, optimizer) if o is not None)

    def on_step_begin(self, args, state, control, **kwargs):
        self.meter.reset_peak()
        self._tracking = self.meter.track(*self._objects)
        self._tracking.__enter__()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self._tracking is not None:
            self._tracking.__exit__(None, None, None)
            self._tracking = None
        if optimizer is not None and optimizer not in self._objects:
            self._objects += (optimizer,)
        peak = self.meter.peak_bytes()
        self._peak_since_log = max(self._peak_since_log, peak)
        over = self.meter.over_budget_bytes()
        if over:
            self.stopped_message = (f"maximus.MemoryCallback: step {state.global_step} peaked at {format_bytes(peak)}, "
                                    f"over the budget of {format_bytes(self.budget_bytes)}; stopping the run")
            print(self.stopped_message, file=sys.stderr)
            control.should_training_stop = True
            control.should_log = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._tracking is not None:  # a step that raised
            self._tracking.__exit__(None, None, None)
            self._tracking = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.meter is None or "loss" not in logs:
            return
        values = {"memory_bytes": self.meter.current_bytes(), "peak_memory_bytes": self._peak_since_log}
        if self.budget_bytes:
            values["budget_bytes"] = self.budget_bytes
        self._peak_since_log = 0
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)
