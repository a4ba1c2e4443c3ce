"""The fake quantizer against llama.cpp's own reference quantizers (its C code, through the
libggml-base that llama-cpp-python ships): quantize with llama.cpp, dequantize with llama.cpp,
compare with `fake_quantize`, value for value in float32."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch

from maximus.qat.ggml_rounding import fake_quantize
from tiny import llama_cpp_or_skip

llama_cpp = llama_cpp_or_skip()

pytestmark = [pytest.mark.llama_cpp]


def _libggml():
    return ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))


def _llama_cpp_roundtrip(x: np.ndarray, ggml_type: str) -> np.ndarray:
    """quantize_row_<type>_ref then dequantize_row_<type>, llama.cpp's C functions."""
    import gguf

    qtype = gguf.GGMLQuantizationType[ggml_type.upper()]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    c_name = ggml_type[:-1] + "K" if ggml_type.endswith("_k") else ggml_type
    lib = _libggml()
    x = np.ascontiguousarray(x, dtype=np.float32)
    buffer = (ctypes.c_uint8 * (x.size // block * size))()
    getattr(lib, f"quantize_row_{c_name}_ref")(x.ctypes.data_as(ctypes.c_void_p), buffer, ctypes.c_int64(x.size))
    out = np.empty(x.size, np.float32)
    getattr(lib, f"dequantize_row_{c_name}")(buffer, out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    return out.reshape(x.shape)


def _awkward_weights() -> torch.Tensor:
    """Rows at a weight's scale and at 1, an all-zero block, a lone tiny value, a huge row, ties."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 512, generator=g)
    x[:8] *= 0.02
    x[8, :256] = 0.0
    x[9, :256] = 0.0
    x[9, 7] = 1e-3
    x[10] *= 1e4
    x[11] = torch.round(x[11] * 4) / 4  # many exact ties
    x[12] = x[12].abs()  # all positive: the minimum clamps to 0
    return x


@pytest.mark.parametrize("ggml_type", ["q8_0", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_fake_quantizer_equals_llama_cpp_reference_quantizer(ggml_type):
    x = _awkward_weights()
    ours = fake_quantize(x, ggml_type).numpy()
    assert np.array_equal(ours, _llama_cpp_roundtrip(x.numpy(), ggml_type))


def test_rows_that_do_not_divide_into_blocks_are_refused():
    with pytest.raises(ValueError, match="rows of 300 values do not divide into q4_k blocks of 256"):
        fake_quantize(torch.zeros(2, 300), "q4_k")
