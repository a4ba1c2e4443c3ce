"""Where the Triton kernels may run, and the error that says why they cannot.

Triton compiles for CUDA. With ``TRITON_INTERPRET=1`` set *before* the kernel modules are imported,
``triton.jit`` builds interpreted kernels instead, which run (slowly, in NumPy) on CPU tensors: that is
how the parity tests run on a machine without a GPU. A kernel object remembers which of the two it
is, so the launch check asks the kernel, not the environment.
"""
from __future__ import annotations

import contextlib
import os

import torch

from maximus.errors import MaximusError

TRITON_HINT = "use optimization.kernels: compile or eager (the Triton kernels need CUDA and `pip install triton`)"


class TritonKernelsUnavailable(MaximusError):
    """The Triton kernels cannot run here (no triton, or tensors not on CUDA without the interpreter)."""


def triton_import_error() -> str | None:
    """None when `import triton` works, else the reason in one line."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return None


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks triton.jit for CPU-interpreted kernels (read live)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@contextlib.contextmanager
def interpreter_env():
    """TRITON_INTERPRET=1 inside the block, the previous value after: kernel modules first imported
    inside build CPU-interpreted kernels, and code after the block still sees the real environment."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def is_interpreted(kernel) -> bool:
    """True when `kernel` was built by triton.jit under TRITON_INTERPRET (runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def can_launch(kernel, tensor: torch.Tensor) -> bool:
    """True when `kernel` can run on `tensor`'s device: CUDA for compiled kernels, CPU for interpreted."""
    if tensor.device.type == "cuda":
        return True
    return tensor.device.type == "cpu" and is_interpreted(kernel)


def require_launchable(kernel, tensor: torch.Tensor, what: str) -> None:
    """Raise TritonKernelsUnavailable naming `what` when `kernel` cannot run on `tensor`'s device."""
    if can_launch(kernel, tensor):
        return
    if tensor.device.type == "cpu" and interpreting():
        raise TritonKernelsUnavailable(
            f"{what}: the Triton kernels were compiled for CUDA when first imported, before TRITON_INTERPRET=1 was set",
            "set TRITON_INTERPRET=1 before importing maximus.kernels.triton kernels")
    raise TritonKernelsUnavailable(f"{what}: Triton kernels need CUDA tensors, got {tensor.device.type}", TRITON_HINT)


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """`x` as a 2-D (rows, last dim) tensor with a unit stride along the last dim (copies only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def program_count(device: torch.device, rows: int) -> int:
    """How many programs share `rows` rows in a reduction kernel: a few per SM on CUDA, a handful on CPU."""
    if device.type == "cuda":
        slots = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        slots = 4  # the interpreter runs programs one after another; fewer means fewer partial rows
    return max(1, min(rows, slots))
