"""`optimization.kernels: auto | triton | compile | eager`: how the training step runs.

`apply_kernels(model, mode, device)` is called once by the trainer, after the adapter and
gradient checkpointing are in place and before DDP / FSDP2 wrap the model:

- every mode first switches SDPA attention to padding-free attention over packed documents
  (`maximus.attention.varlen`: exact, plain PyTorch, no ``T x T`` mask, only ``sum(L_i^2)``
  attention FLOPs), when the model uses SDPA through Transformers' registry;
- a model with attention sinks (gpt-oss) loaded with Transformers' eager attention switches to
  the exact SDPA path with a sink key (`maximus.attention.sink_attention`; `load_model` chooses it already);
- ``triton``: the fused Triton kernels of `maximus.kernels.triton` (RMSNorm, RoPE, SwiGLU, the
  QLoRA projection with fused NF4 dequantisation) on CUDA; where they cannot run (no CUDA, no
  triton) a one-line notice says so and the step stays eager;
- ``compile``: regional ``torch.compile`` (Inductor) of each decoder layer, so one compiled
  graph serves every layer; needs a C++ compiler on CPU (a notice and eager otherwise);
- ``eager``: plain PyTorch modules;
- lean LoRA projections (`maximus.kernels.lean_lora`, ``optimization.lean_lora``, on by default):
  in every mode but ``compile``, the PEFT LoRA linears the Triton kernel did not take run as one
  autograd node that keeps the layer input once, in the compute dtype;
- lean RMSNorm (`maximus.kernels.lean_norm`, ``optimization.lean_norm``, on by default): in every
  mode but ``compile``, the Transformers RMSNorms the Triton kernel did not take keep their input
  once and work in float32 one block of tokens at a time (Transformers' norm keeps a float32 copy
  and five float32 ``tokens x hidden`` temporaries in backward);
- grouped experts (`maximus.kernels.grouped_experts`, ``optimization.grouped_experts``, on by
  default): on CPU, in every mode but ``compile``, Transformers' fused mixture-of-experts layers
  (Mixtral, Qwen3-MoE, gpt-oss) run one grouped matmul per projection over every expert's routed
  rows with the expert LoRA kept factored (no merged expert weights, no weight-sized gradients;
  2.1-35x Transformers' eager experts forward and backward, docs/benchmarks/moe.md); on CUDA
  Transformers' grouped_mm stays;
- on CPU, `cpu_threads` picks the intra-op thread count before anything runs (see there);
- ``auto``: ``triton`` on CUDA when Triton is importable, else eager. Compilation is not the CPU
  default because it pays off only slowly there: regional compilation of the reference model's
  layers (QLoRA, seq 2,048) cost 38-100 s once and made a step 4-8 % faster, since the step is
  matmuls, SDPA and the loss, none of which Inductor speeds up (docs/benchmarks/speed.md,
  `benchmarks/speed_parts.py compile`).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from maximus.kernels.choices import KernelChoices


@dataclass
class KernelReport:
    """What `apply_kernels` did: recorded in run.json under ``"kernels"``."""

    requested: str
    used: str = "eager"
    attention: str = "unchanged"
    patched: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    threads: int | None = None
    lean_lora: int = 0  # PEFT LoRA linears routed through maximus.kernels.lean_lora
    lean_norm: int = 0  # Transformers RMSNorms routed through maximus.kernels.lean_norm
    grouped_experts: int = 0  # mixture-of-experts layers routed through maximus.kernels.grouped_experts

    @property
    def padding_free(self) -> bool:
        """Attention keeps packed documents apart by their positions alone, so a micro-batch can
        be one unpadded row (`maximus.data.flatten`)."""
        return self.attention.startswith("padding-free")

    def to_dict(self) -> dict:
        return {"requested": self.requested, "used": self.used, "attention": self.attention,
                "patched": len(self.patched), "notices": list(self.notices), "cpu_threads": self.threads,
                "lean_lora": self.lean_lora, "lean_norm": self.lean_norm, "grouped_experts": self.grouped_experts}


def cpu_threads(device: torch.device, processes_per_node: int = 1, *, busy: int | None = None,
                cores: int | None = None) -> int | None:
    """Set and return torch's intra-op thread count for a CPU run (None on GPUs: untouched).

    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, when set (torchrun sets 1), win. Otherwise: the cores
    this process may run on, shared by the processes of this node, minus the cores other programs
    are busy on right now (`busy_cores`), at least 1. Why not torch's default (every core): OpenMP
    threads wait for each other at the end of every op, so one thread descheduled by another
    program stalls them all. Measured on this 2-core machine with two other busy processes: the
    quickstart's step took 8.05 s with 2 threads and 0.38 s with 1 (`speed_parts.py threads`).
    """
    if device.type != "cpu":
        return None
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var, "").strip().isdigit() and int(os.environ[var]) > 0:
            return torch.get_num_threads()
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if busy is None:
        busy = busy_cores()
    share = max(1, cores // max(1, processes_per_node))
    threads = max(1, min(share, cores - busy))
    torch.set_num_threads(threads)
    return threads


def busy_cores(samples: int = 5, interval_s: float = 0.01) -> int:
    """Threads of other programs runnable right now: the median over a few reads of the
    runnable count in /proc/loadavg, less this reader itself (0 where /proc is missing)."""
    import statistics
    import time

    counts = []
    for _ in range(samples):
        try:
            running = int(open("/proc/loadavg").read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        counts.append(max(0, running - 1))
        time.sleep(interval_s)
    return int(statistics.median(counts))


def apply_kernels(model, mode: str, device: torch.device, choices: "KernelChoices | None" = None) -> KernelReport:
    """Make ``model``'s training step run as ``mode`` asks (see the module docstring), with the
    kernels `choices` decided (`maximus.kernels.choices.KernelChoices`: the run's
    `RunSpec.kernels`; None: every kernel this mode and device take, `decide_kernels`): lean LoRA
    for the LoRA linears left to PEFT, the lean norm for the RMSNorms left to Transformers, the
    grouped forward for the fused experts. Nothing is decided here again.

    Never raises for an unsupported combination: the step falls back to eager PyTorch and
    ``report.notices`` says why (the trainer prints them once).
    """
    from maximus.kernels.choices import decide_kernels

    if choices is None:
        choices = decide_kernels(mode=mode, device_type=device.type, lean_lora=True, lean_norm=True,
                                 grouped_experts=True)
    report = _apply_mode(model, mode, device)
    if choices.lean_lora:
        from maximus.kernels.lean_lora import install_lean_lora

        report.lean_lora = len(install_lean_lora(model))
    if choices.lean_norm:
        from maximus.kernels.lean_norm import install_lean_norm

        report.lean_norm = len(install_lean_norm(model))
    if choices.grouped_experts:
        from maximus.kernels.grouped_experts import install_grouped_experts

        report.grouped_experts = len(install_grouped_experts(model))
    report.notices.extend(_lean_fallbacks(model, choices.lean_lora and not report.grouped_experts, choices.lean_norm))
    return report


def _lean_fallbacks(model, lean_lora: bool, lean_norm: bool) -> list[str]:
    """One notice per kind of module the lean kernels leave to the library, saying why."""
    from maximus.kernels.lean_norm import NORM_CLASSES

    notices = []
    kinds = {type(m).__name__ for m in model.modules()}
    if lean_norm:
        other = sorted(k for k in kinds if k.endswith("RMSNorm") and k not in NORM_CLASSES)
        if other:
            notices.append(f"notice: lean norm: {', '.join(other)} computes its norm in another order than the Llama "
                           "and Gemma norms; Transformers' norm is kept")
    if lean_lora and "ParamWrapper" in kinds:
        notices.append("notice: lean LoRA: the expert weights' adapters (PEFT target_parameters) run PEFT's own LoRA")
    return notices


def _apply_mode(model, mode: str, device: torch.device) -> KernelReport:
    from maximus.attention.sink_attention import use_sink_attention
    from maximus.attention.varlen import use_varlen_attention

    from maximus.attention import kronecker_module_names

    report = KernelReport(requested=mode)
    if kronecker_module_names(model):
        report.attention = "kronecker"  # detail + sketch attention (maximus.attention), installed by load_model
    elif use_varlen_attention(model):
        report.attention = "padding-free (per-document SDPA)"
    elif use_sink_attention(model):
        report.attention = "SDPA with attention sinks"
    else:
        from maximus.attention.varlen import sliding_window
        from maximus.structure import causal_lm_of

        window = sliding_window(causal_lm_of(model).config)
        if window is not None and getattr(causal_lm_of(model).config, "_attn_implementation", None) == "sdpa":
            report.notices.append(f"notice: padding-free attention: the model's sliding-window layers ({window} tokens) "
                                  "keep Transformers' SDPA with its window mask")
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
    from maximus.structure import causal_lm_of

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
