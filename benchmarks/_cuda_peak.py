"""The highest CUDA memory a whole run allocated, across the peak resets made inside it.

The trainer opens a new peak window every step (`MemoryMeter.reset_peak` calls
`torch.cuda.reset_peak_memory_stats`), so `torch.cuda.max_memory_allocated()` read after a run
is its last step's peak. Inside `RunPeak`, every reset first folds the window it closes into a
running maximum, so `peak_bytes` is the maximum over every window of the run (the allocator's
own counter: weights, optimizer state and every step included).

    with RunPeak() as run_peak:
        Trainer(cfg).train()
    run_peak.peak_bytes
"""
from __future__ import annotations


class RunPeak:
    """`torch.cuda.max_memory_allocated` over everything inside the ``with`` block, in bytes."""

    def __init__(self):
        self.peak_bytes = 0

    def __enter__(self) -> "RunPeak":
        import torch.cuda
        import torch.cuda.memory

        self._modules = (torch.cuda, torch.cuda.memory)
        self._reset = torch.cuda.memory.reset_peak_memory_stats
        self._reset()  # the window starts here (and the first CUDA use of a dry run stops here)

        def reset_peak_memory_stats(device=None) -> None:
            self.peak_bytes = max(self.peak_bytes, int(torch.cuda.max_memory_allocated(device)))
            self._reset(device)

        # torch.cuda re-exports the function and torch.cuda.memory's own helpers call it by its
        # module-level name: both names lead through the fold.
        for module in self._modules:
            module.reset_peak_memory_stats = reset_peak_memory_stats
        return self

    def __exit__(self, *exc) -> None:
        import torch

        for module in self._modules:
            module.reset_peak_memory_stats = self._reset
        self.peak_bytes = max(self.peak_bytes, int(torch.cuda.max_memory_allocated()))
