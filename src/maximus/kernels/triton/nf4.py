"""Dequantise a bitsandbytes NF4 weight into bf16 / fp16 / fp32 in one kernel.

bitsandbytes' layout (``quantize_4bit(..., quant_type="nf4")``): the weight, flattened row-major, is cut
into blocks of ``blocksize`` (64) values; each value is a 4-bit index into the 16-entry NF4 ``code``,
two per byte (first value in the high nibble). Block ``i`` is scaled by ``absmax[i]``. With double
quantisation (``compress_statistics=True``, QLoRA's default) ``absmax`` is itself uint8-quantised:
``absmax[i] = state2.code[absmax_u8[i]] * state2.absmax[i // state2.blocksize] + offset``.

So ``w[j] = code[nibble(j)] * absmax[j // blocksize]``, computed in fp32 and rounded once, exactly
as ``bitsandbytes.functional.dequantize_4bit`` does; the nested absmax is decoded in the same
kernel instead of in a separate pass. The offset is read from its tensor (no host sync).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from maximus.kernels.triton.runtime import require_launchable

_BLOCK_BYTES = 512  # packed bytes per program (1024 output values)


@triton.jit
def _dequantize_nf4_kernel(PACKED, CODE, ABSMAX, CODE2, ABSMAX2, OFFSET, OUT, n_bytes, blocksize, blocksize2,
                           BLOCK: tl.constexpr, NESTED: tl.constexpr):
    byte_idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = byte_idx < n_bytes
    packed = tl.load(PACKED + byte_idx, mask=mask, other=0).to(tl.int32)
    high = tl.load(CODE + (packed >> 4), mask=mask, other=0.0)
    low = tl.load(CODE + (packed & 15), mask=mask, other=0.0)
    block = (byte_idx * 2) // blocksize  # both values of a byte share a block (blocksize is even)
    if NESTED:
        absmax_u8 = tl.load(ABSMAX + block, mask=mask, other=0).to(tl.int32)
        absmax = tl.load(CODE2 + absmax_u8, mask=mask, other=0.0) * tl.load(ABSMAX2 + block // blocksize2, mask=mask,
                                                                          other=0.0) + tl.load(OFFSET)
    else:
        absmax = tl.load(ABSMAX + block, mask=mask, other=0.0)
    tl.store(OUT + byte_idx * 2, (high * absmax).to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + byte_idx * 2 + 1, (low * absmax).to(OUT.dtype.element_ty), mask=mask)


def nf4_supported(quant_state) -> bool:
    """True for an NF4 QuantState this kernel decodes (plain or double-quantised, CUDA-layout packing)."""
    if quant_state is None or getattr(quant_state, "quant_type", None) != "nf4":
        return False
    if getattr(quant_state, "packing_format_for_cpu", False):  # bnb's AVX512 CPU repack: another layout
        return False
    if quant_state.blocksize % 2 or quant_state.absmax.dtype not in (torch.float32, torch.uint8):
        return False
    return (quant_state.state2 is None) == (quant_state.absmax.dtype == torch.float32)


def dequantize_nf4(packed: torch.Tensor, quant_state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full-precision weight (quant_state.shape, `dtype` or quant_state.dtype) of a packed NF4 tensor.

    `packed` is the Params4bit data (uint8, or another quant_storage dtype viewed as bytes).
    Raises ValueError for a QuantState this kernel does not decode (FP4, CPU-repacked).
    """
    if not nf4_supported(quant_state):
        raise ValueError("dequantize_nf4: only bitsandbytes NF4 weights in the standard packing are supported")
    require_launchable(_dequantize_nf4_kernel, packed, "dequantize_nf4")
    data = packed.reshape(-1)
    if data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    out = torch.empty(quant_state.shape, dtype=dtype or quant_state.dtype, device=packed.device)
    n_bytes = out.numel() // 2
    if data.numel() < n_bytes:
        raise ValueError(f"dequantize_nf4: {data.numel()} packed bytes for {out.numel()} values")
    nested = quant_state.state2 is not None
    absmax = quant_state.absmax
    if nested:
        code2, absmax2, blocksize2 = quant_state.state2.code, quant_state.state2.absmax, quant_state.state2.blocksize
        offset = quant_state.offset
        if not torch.is_tensor(offset):
            offset = torch.tensor(float(offset), dtype=torch.float32, device=packed.device)
    else:  # unused pointers: pass a valid tensor, NESTED=False never reads them
        code2 = absmax2 = offset = absmax
        blocksize2 = 1
    _dequantize_nf4_kernel[(triton.cdiv(n_bytes, _BLOCK_BYTES),)](
        data, quant_state.code, absmax, code2, absmax2, offset, out, n_bytes, quant_state.blocksize, blocksize2,
        BLOCK=_BLOCK_BYTES, NESTED=nested)
    return out


def dequantize_nf4_reference(packed: torch.Tensor, quant_state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same decode in eager PyTorch (the oracle beside bitsandbytes' `dequantize_4bit`)."""
    data = packed.reshape(-1)
    data = data if data.dtype == torch.uint8 else data.view(torch.uint8)
    n = quant_state.shape.numel() if hasattr(quant_state.shape, "numel") else int(torch.Size(quant_state.shape).numel())
    index = torch.stack([data >> 4, data & 15], dim=-1).reshape(-1)[:n].long()
    absmax = quant_state.absmax
    if quant_state.state2 is not None:
        s2 = quant_state.state2
        absmax = s2.code[absmax.long()] * s2.absmax.repeat_interleave(s2.blocksize)[: absmax.numel()] + quant_state.offset
    values = quant_state.code[index] * absmax.repeat_interleave(quant_state.blocksize)[:n]
    return values.reshape(quant_state.shape).to(dtype or quant_state.dtype)
