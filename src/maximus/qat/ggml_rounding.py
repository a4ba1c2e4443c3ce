"""llama.cpp's reference quantizers, as fake quantization in torch: quantize, then dequantize.

`fake_quantize(weight, ggml_type)` returns the float32 weight that llama.cpp loads from a GGUF
tensor of that type: the same block size, scale (and minimum) layout and rounding rule as the
reference C quantizers in ggml-quants.c (`quantize_row_*_ref`, which `llama_model_quantize` runs
when no importance matrix is given) and the `gguf` package's numpy twins of the legacy types:

- ``q8_0``: blocks of 32, d = amax / 127 stored as fp16, q = roundf(x / d) (half away from zero);
- ``q4_0`` / ``q5_0``: blocks of 32, d = (the value of largest magnitude) / -8 (-16), fp16,
  q = min(15 (31), trunc(x / d + 8.5 (16.5))), value (q - 8 (16)) * d;
- ``q5_1``: blocks of 32, d = (max - min) / 31 and the minimum, both fp16, q = trunc((x - min) / d + 0.5);
- ``q4_k`` / ``q5_k``: super-blocks of 256 = 8 sub-blocks of 32, each with a 6-bit scale and a
  6-bit minimum found by llama.cpp's weighted least-squares search (`make_qkx2_quants`: 21 / 16
  trial scales), the super-block's scale and minimum scale fp16, value d * sc * q - dmin * m;
- ``q6_k``: super-blocks of 256 = 16 sub-blocks of 16 with signed 8-bit scales from
  `make_qx_quants` (19 trial scales, weights x^2), value d * sc * (q - 32);
- ``f16``: the fp16 rounding (what a tensor llama.cpp leaves unquantized in a K-quant file holds).

Bit-for-bit equality needs llama.cpp's order of operations: every sum runs element by element in
float32, as the C loops do (libggml-base is compiled without fused multiply-add), and every
rounding is the C one (`nearest_int` rounds half to even, `roundf` half away from zero, a cast
truncates). Rows are processed in chunks so the sub-block vectors stay in cache.

Reference: ggml/src/ggml-quants.c (llama.cpp, as vendored by llama-cpp-python 0.3.36);
tests/qat/test_ggml_rounding.py compares with llama.cpp's own C functions and with GGUF files.
"""
from __future__ import annotations

import torch

#: ggml type name -> elements per block (the weight's row length must be a multiple).
BLOCK_SIZES = {"f16": 1, "q8_0": 32, "q4_0": 32, "q5_0": 32, "q5_1": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256}
_CHUNK_ROWS = 1 << 13  # values / 32 per chunk: a K-quant search over 8,192 x 32 values stays in cache (1 MiB)


def fake_quantize(weight: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """`weight` (any shape whose last dimension is a multiple of the type's block) rounded as
    llama.cpp stores it in a `ggml_type` tensor and read back, as float32. No gradient flows
    (wrap with a straight-through estimator to train through it)."""
    if ggml_type not in BLOCK_SIZES:
        raise ValueError(f"no fake quantizer for ggml type {ggml_type!r}")
    with torch.no_grad():
        x = weight.detach().to(torch.float32)
        if ggml_type == "f16":
            return x.to(torch.float16).to(torch.float32)
        block = BLOCK_SIZES[ggml_type]
        if x.shape[-1] % block:
            raise ValueError(f"rows of {x.shape[-1]} values do not divide into {ggml_type} blocks of {block}")
        blocks = x.reshape(-1, block)
        out = torch.empty_like(blocks)
        fn = _QUANTIZERS[ggml_type]
        rows = max(1, _CHUNK_ROWS * 32 // block)
        for start in range(0, blocks.shape[0], rows):
            out[start:start + rows] = fn(blocks[start:start + rows])
        return out.reshape(x.shape)


# ------------------------------------------------------------------------------------- helpers
def _fp16(v: torch.Tensor) -> torch.Tensor:
    """GGML_FP32_TO_FP16 then back: round to nearest even in half precision."""
    return v.to(torch.float16).to(torch.float32)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), exactly: floor(|v|) + floor(2 (|v| - floor(|v|)))."""
    a = v.abs()
    floored = a.floor()
    return torch.copysign(floored + (2 * (a - floored)).floor(), v)


def _nearest_int(v: torch.Tensor) -> torch.Tensor:
    """llama.cpp's nearest_int (adds 1.5 * 2^23 in float32): round half to even."""
    return torch.round(v)


def _reciprocal_or_zero(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The first value of largest magnitude in each row (the C loop keeps the first on ties)."""
    return x.gather(1, x.abs().argmax(dim=1, keepdim=True))


def _sequential_sum(terms: torch.Tensor) -> torch.Tensor:
    """Column sums of `terms` [n, rows] accumulated top to bottom in float32: the C loop's order
    (not a pairwise tree). Element-major layout, so each step adds one contiguous row."""
    total = terms[0].clone()
    for i in range(1, terms.shape[0]):
        total += terms[i]
    return total


# ------------------------------------------------------------------------------------- legacy types
def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1, keepdim=True) / 127
    q = _roundf(x * _reciprocal_or_zero(d))
    return q * _fp16(d)


def _symmetric(levels: int):
    def quantize(x: torch.Tensor) -> torch.Tensor:
        d = _signed_absmax(x) / -levels
        q = torch.clamp(torch.trunc(x * _reciprocal_or_zero(d) + (levels + 0.5)), max=2 * levels - 1)
        return (q - levels) * _fp16(d)

    return quantize


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    d = (hi - lo) / 31
    q = torch.trunc((x - lo) * _reciprocal_or_zero(d) + 0.5)
    return q * _fp16(d) + _fp16(lo)


# ------------------------------------------------------------------------------------- K-quants
def _make_qkx2_quants(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                      nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, the_min) per column of `x` [n, groups] (element-major), as llama.cpp's
    make_qkx2_quants (use_mad false) finds them: trial scales from the best minimum so far."""
    lo = torch.clamp(x.amin(dim=0), max=0.0)
    hi = x.amax(dim=0)
    sum_w = _sequential_sum(weights)
    sum_x = _sequential_sum(weights * x)
    flat = hi == lo
    ones = torch.ones_like(lo)

    def error(scale, minimum, levels):
        diff = scale * levels + minimum - x
        return _sequential_sum(weights * (diff * diff))

    iscale = nmax / torch.where(flat, ones, hi - lo)
    scale = 1 / iscale
    levels = torch.clamp(_nearest_int(iscale * (x - lo)), 0, nmax)
    best = error(scale, lo, levels)
    minimum = lo.clone()
    for step in range(nstep + 1):
        # the C loop measures from the best minimum found so far (it updates `min` in place)
        numerator = torch.tensor(rmin, dtype=torch.float32) + torch.tensor(rdelta, dtype=torch.float32) * step + nmax
        iscale = numerator / torch.where(flat, ones, hi - minimum)
        levels = torch.clamp(_nearest_int(iscale * (x - minimum)), 0, nmax)
        wl = weights * levels
        sum_l = _sequential_sum(wl)
        sum_l2 = _sequential_sum(wl * levels)
        sum_xl = _sequential_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, ones)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 == 0, ones, sum_l2), this_scale)
        current = error(this_scale, this_min, levels)
        better = ok & (current < best) & ~flat
        best = torch.where(better, current, best)
        scale = torch.where(better, this_scale, scale)
        minimum = torch.where(better, this_min, minimum)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    minimum = torch.where(flat, lo, minimum)
    return scale, -minimum


def _k_quant(nmax: int, rmin: float, rdelta: float, nstep: int):
    def quantize(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        sub = x.reshape(n * 8, 32).T.contiguous()
        sum_x2 = _sequential_sum(sub * sub)
        av_x = torch.sqrt((sum_x2 / 32).double()).float()  # correctly rounded, as sqrtss (torch's float32 sqrt may not be)
        weights = av_x + sub.abs()
        scales, mins = _make_qkx2_quants(sub, weights, nmax, rmin, rdelta, nstep)
        scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
        max_scale = torch.clamp(scales.amax(dim=1, keepdim=True), min=0.0)
        max_min = torch.clamp(mins.amax(dim=1, keepdim=True), min=0.0)
        inv_scale = torch.where(max_scale > 0, 63.0 / torch.where(max_scale > 0, max_scale, torch.ones_like(max_scale)),
                                torch.zeros_like(max_scale))
        inv_min = torch.where(max_min > 0, 63.0 / torch.where(max_min > 0, max_min, torch.ones_like(max_min)),
                              torch.zeros_like(max_min))
        # nearest_int lands in a uint8 (the C code's cast), then min(63, .)
        ls = torch.clamp(torch.remainder(_nearest_int(inv_scale * scales), 256), max=63)
        lm = torch.clamp(torch.remainder(_nearest_int(inv_min * mins), 256), max=63)
        d = _fp16(max_scale / 63) * ls
        dm = _fp16(max_min / 63) * lm
        safe = torch.where(d == 0, torch.ones_like(d), d)
        q = torch.clamp(_nearest_int((x.reshape(n, 8, 32) + dm[..., None]) / safe[..., None]), 0, nmax)
        # a sub-block whose scale is 0 keeps its search levels in C; they are multiplied by 0 anyway
        return (d[..., None] * q - dm[..., None]).reshape(n, 256)

    return quantize


def _make_qx_quants(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """The scale per column of `x` [n, groups] (element-major) as llama.cpp's make_qx_quants finds
    it (rmse_type 1: weights x^2, 19 trial scales)."""
    peak = x.gather(0, x.abs().argmax(dim=0, keepdim=True))[0]  # the first value of largest magnitude
    zero = x.abs().amax(dim=0) < 1e-15
    safe_peak = torch.where(zero, torch.ones_like(peak), peak)
    weights = x * x

    def sums(iscale):
        levels = torch.clamp(_nearest_int(iscale * x), -nmax, nmax - 1)
        return _sequential_sum(weights * x * levels), _sequential_sum(weights * levels * levels)

    sumlx, suml2 = sums(-nmax / safe_peak)
    scale = torch.where(suml2 != 0, sumlx / torch.where(suml2 != 0, suml2, torch.ones_like(suml2)), torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2 = sums(-(nmax + torch.tensor(0.1, dtype=torch.float32) * step) / safe_peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        this_scale = sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2))
        scale = torch.where(better, this_scale, scale)
        best = torch.where(better, this_scale * sumlx, best)
    return torch.where(zero, torch.zeros_like(scale), scale)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    scales = _make_qx_quants(x.reshape(n * 16, 16).T.contiguous(), 32).reshape(n, 16)
    index = scales.abs().argmax(dim=1, keepdim=True)  # first of the largest magnitude
    max_scale = scales.gather(1, index)
    empty = scales.abs().gather(1, index) < 1e-15
    iscale = -128.0 / torch.where(empty, torch.ones_like(max_scale), max_scale)
    d = _fp16(1 / iscale)
    sc = torch.clamp(_nearest_int(iscale * scales), max=127)  # stored as int8
    sc = torch.remainder(sc + 128, 256) - 128
    dl = d * sc
    safe = torch.where(dl == 0, torch.ones_like(dl), dl)
    q = torch.clamp(_nearest_int(x.reshape(n, 16, 16) / safe[..., None]), -32, 31)
    out = dl[..., None] * q
    return torch.where(empty[..., None], torch.zeros_like(out), out).reshape(n, 256)


_QUANTIZERS = {"q8_0": _q8_0, "q4_0": _symmetric(8), "q5_0": _symmetric(16), "q5_1": _q5_1,
               "q4_k": _k_quant(15, -1.0, 0.1, 20), "q5_k": _k_quant(31, -0.5, 0.1, 15), "q6_k": _q6_k}
