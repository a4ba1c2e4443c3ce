"""Device facts: what a device is, which dtype it computes in, how much memory it has and has free.

The floor below `maximus.models` and `maximus.memory`: both ask these questions, and only here
are they answered (torch and psutil are the only sources). Nothing here reads a `Config`.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["bf16_supported", "device_capacity_bytes", "device_type", "dtype_name", "free_memory_bytes",
           "host_available_bytes", "resolve_dtype"]


def device_type(device: Any) -> str:
    """``cuda``, ``cpu`` or ``mps`` for a torch.device or its name (``cuda:1`` -> ``cuda``)."""
    return str(getattr(device, "type", device)).split(":")[0]


def bf16_supported(device) -> bool:
    """Whether `device` runs bf16 matmuls natively."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        # bf16 matmuls are fast only with native support (AVX512-BF16 / AMX); elsewhere they are emulated.
        try:
            return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except Exception:  # pragma: no cover - older builds
            return False
    return device.type == "mps"


def resolve_dtype(name: str, device):
    """Compute dtype (a torch.dtype): `auto` = bf16 where supported, else fp32 (fp16 only on request)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def dtype_name(name: str, device_type_: str) -> str:
    """`training.dtype` resolved for a device type (``auto``: `resolve_dtype`), as the estimator
    names it. A CUDA plan made on a machine without a GPU (`maximus plan`) assumes bf16."""
    import torch

    if name != "auto":
        return name
    if device_type_ == "cuda" and not torch.cuda.is_available():
        return "bf16"
    dtype = resolve_dtype(name, torch.device(device_type_))
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def free_memory_bytes(device: Any) -> int:
    """The memory free on `device` now: `torch.cuda.mem_get_info` on CUDA, MPS's recommended
    maximum less what it holds, else the host's available RAM."""
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "mps" and hasattr(torch, "mps") and hasattr(torch.mps, "recommended_max_memory"):
        return int(torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory())
    return host_available_bytes()


def host_available_bytes() -> int:
    """The host's available RAM (bytes)."""
    import psutil

    return int(psutil.virtual_memory().available)


def device_capacity_bytes(device: Any, budget_bytes: int | None = None) -> int | None:
    """Bytes one process may use: `target_vram` when set, else the GPU's memory, else the host's
    memory split between the processes of this node; None for a GPU this machine does not have
    (`maximus plan` planning for CUDA on a laptop)."""
    if budget_bytes:
        return int(budget_bytes)
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(dev).total_memory)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platforms without sysconf
        return 1 << 62
    return host // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
