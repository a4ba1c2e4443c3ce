"""`optimization.kernels: auto | triton | compile | eager`: how the training step runs.

`apply_kernels(model, mode, device)` is called once by the trainer, after the adapter and
gradient checkpointing are in place and before DDP / FSDP2 wrap the model:

- every mode first switches SDPA attention to padding-free attention over packed documents
  (`maximus.attention.varlen`: exact, plain PyTorch, no ``T x T`` mask, only ``sum(L_i^2)``
  attention FLOPs), when the model uses SDPA through Transformers' registry;
- ``triton``: the fused Triton kernels of `maximus.kernels.triton` (RMSNorm, RoPE, SwiGLU, the
  QLoRA projection with fused NF4 dequantisation) on CUDA; where they cannot run (no CUDA, no
  triton) a one-line notice says so and the step stays eager;
- ``compile``: regional ``torch.compile`` (Inductor) of each decoder layer, so one compiled
  graph serves every layer; needs a C++ compiler on CPU (a notice and eager otherwise);
- ``eager``: plain PyTorch modules;
- ``auto``: ``triton`` on CUDA when Triton is importable, else eager. Compilation is not the CPU
  default because it did not pay off there: regional compilation of the reference model's layers
  (QLoRA, seq 2,048, 1 thread) cost ~100 s once and made a step ~4 % faster, since the step is
  matmuls, SDPA and the loss, none of which Inductor speeds up (docs/benchmarks/speed.md).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field

import torch

MODES = ("auto", "triton", "compile", "eager")


@dataclass
class KernelReport:
    """What `apply_kernels` did: recorded in run.json under ``"kernels"``."""

    requested: str
    used: str = "eager"
    attention: str = "unchanged"
    patched: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"requested": self.requested, "used": self.used, "attention": self.attention,
                "patched": len(self.patched), "notices": list(self.notices)}


def apply_kernels(model, mode: str, device: torch.device) -> KernelReport:
    """Make ``model``'s training step run as ``mode`` asks (see the module docstring).

    Never raises for an unsupported combination: the step falls back to eager PyTorch and
    ``report.notices`` says why (the trainer prints them once).
    """
    from maximus.attention.varlen import use_varlen_attention

    report = KernelReport(requested=mode)
    if use_varlen_attention(model):
        report.attention = "padding-free (per-document SDPA)"
    if mode == "auto":
        mode = "triton" if device.type == "cuda" and _triton_problem(device) is None else "eager"
    if mode == "triton":
        problem = _triton_problem(device)
        if problem is not None:
            report.notices.append(f"notice: optimization.kernels=triton is not available here ({problem}); running eager PyTorch")
            return report
        from maximus.kernels.triton import TritonKernelsUnavailable, install_triton_kernels

        try:
            report.patched = install_triton_kernels(model)
        except TritonKernelsUnavailable as exc:
            report.notices.append(f"notice: optimization.kernels=triton is not available here ({exc.message}); running eager PyTorch")
            return report
        report.used = "triton"
    elif mode == "compile":
        problem = _compile_problem(device)
        if problem is not None:
            report.notices.append(f"notice: optimization.kernels=compile is not available here ({problem}); running eager PyTorch")
            return report
        report.patched = compile_decoder_layers(model)
        report.used = "compile"
    return report


def compile_decoder_layers(model) -> list[str]:
    """``torch.compile`` each decoder layer in place (regional compilation); returns their names."""
    from maximus.models import causal_lm_of

    decoder = causal_lm_of(model).get_decoder()
    layers = getattr(decoder, "layers", None) or []
    names = []
    for i, layer in enumerate(layers):
        layer.compile(dynamic=False)
        names.append(f"layers.{i}")
    return names


def _triton_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None when they can)."""
    if device.type != "cuda":
        return f"Triton kernels need a CUDA GPU, training runs on {device.type}"
    from maximus.kernels.triton.runtime import triton_import_error

    return triton_import_error()


def _compile_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot build kernels for ``device`` (None when it can)."""
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "Inductor needs a C++ compiler (g++ or clang++) on CPU"
    return None
