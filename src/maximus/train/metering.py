"""Which optimizer steps run under the CPU memory meter (`training.memory_meter`).

On CUDA the meter reads the caching allocator's counters, which cost nothing, so every step is
metered. On the CPU the meter is a `TorchDispatchMode` that sees every aten op: on a small
model, whose ops are tiny, it nearly doubles the step time (the built-in quickstart: 1.4-1.9x).
`sampled` (the CPU's default under `auto`) meters only the steps that can set a new peak:

- the first two steps this process runs (the optimizer state appears on the first);
- a step whose rows are longer, or hold more tokens, than every metered step's so far (with the
  same plan, a step's peak grows with its micro-batches' tokens);
- the first step after a re-plan, and every `EVERY`-th step and the last, as a check.

An objective that samples its own rows (GRPO) samples them first, always metered (the decode
loop reports what it holds instead of being tracked op by op), and the rest of the step (the
log-prob passes, backward, optimizer) is decided on the sampled rows like any other step's; a
generation's peak counts toward the run's peak either way.

The other steps run without the meter: their metrics rows carry no `memory_bytes` /
`peak_memory_bytes`, and the run's peak is the highest metered one. Before each metered step
the model and optimizer are adopted again, so state that an unmetered step re-allocated (a new
GaLore projection, say) is counted.
"""
from __future__ import annotations

#: Under `sampled`, every EVERY-th step is metered whatever its size.
EVERY = 25
#: Under `sampled`, the first FIRST steps a process runs are metered.
FIRST = 2


def meter_mode(setting: str, device_type: str) -> str:
    """`every_step` or `sampled` for `training.memory_meter` (`auto`: every step on CUDA, where
    metering is free; sampled elsewhere)."""
    if setting != "auto":
        return setting
    return "every_step" if device_type == "cuda" else "sampled"


class MeterPolicy:
    """Decides, before each optimizer step, whether it runs under the memory meter."""

    def __init__(self, mode: str, total_steps: int):
        self.mode = mode
        self.total_steps = total_steps
        self.run = 0  # steps decided so far in this process
        self.longest = -1  # the longest row of any metered step
        self.most = -1  # the most tokens of any metered step
        self.plan = None  # the plan of the last metered step

    def decide(self, step: int, plan, lengths: list[int] | None) -> bool:
        """Whether step `step` (1-based) is metered; `lengths` are its rows' token counts (None:
        not known, so metered)."""
        self.run += 1
        if self.mode == "every_step" or lengths is None:
            return True
        longest, most = max(lengths, default=0), sum(lengths)
        metered = (self.run <= FIRST or longest > self.longest or most > self.most or plan is not self.plan
                   or step % EVERY == 0 or step == self.total_steps)
        if metered:
            self.longest, self.most, self.plan = max(self.longest, longest), max(self.most, most), plan
        return metered
