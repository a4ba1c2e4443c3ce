"""Triton kernels for CUDA training: RMSNorm, RoPE, SwiGLU, NF4 dequantisation and QLoRA projections.

Each kernel lives in its own module as a ``torch.autograd.Function`` with a hand-derived backward,
next to a pure-PyTorch ``*_reference`` of the same math (the oracle in tests). ``install_triton_kernels``
swaps them into a Transformers model. Importing this package needs no Triton; the kernel modules do.
On a machine without CUDA, set ``TRITON_INTERPRET=1`` before importing the kernel modules to run
them on CPU tensors (slowly; that is how the tests run). See docs/kernels.md.
"""
from __future__ import annotations

from maximus.kernels.triton.install import install_triton_kernels, summarize, uninstall_triton_kernels
from maximus.kernels.triton.runtime import TritonKernelsUnavailable

_KERNELS = {
    "rms_norm": "maximus.kernels.triton.rms_norm",
    "apply_rotary": "maximus.kernels.triton.rope",
    "swiglu": "maximus.kernels.triton.swiglu",
    "dequantize_nf4": "maximus.kernels.triton.nf4",
    "lora_linear_4bit": "maximus.kernels.triton.lora_4bit",
}

__all__ = ["TritonKernelsUnavailable", "install_triton_kernels", "uninstall_triton_kernels", "summarize", *_KERNELS]


def __getattr__(name: str):
    # Kernel functions load on first use: importing them imports triton and builds the jit kernels.
    if name in _KERNELS:
        import importlib

        return getattr(importlib.import_module(_KERNELS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
