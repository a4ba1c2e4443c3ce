"""Fused RoPE (Triton, CPU interpreter) vs Transformers' apply_rotary_pos_emb with real rotary tables."""
import pytest
import torch

from maximus.kernels.triton.runtime import interpreter_env

pytest.importorskip("triton")
with interpreter_env():  # triton.jit builds CPU-interpreted kernels only if set when they are defined
    from maximus.kernels.triton.rope import apply_rotary, apply_rotary_reference, rope_supported

B, T, HQ, HK, D = 2, 7, 4, 2, 16


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tables(dtype, positions):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HK,
                                              max_position_embeddings=64))
    return rotary(torch.zeros(1, dtype=dtype), positions)


def _qk(dtype, seed=0):
    # The layout attention produces: (B, T, H, D) projections viewed as (B, H, T, D), non-contiguous
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, T, HK, D, generator=g).to(dtype).transpose(1, 2)
    return q.requires_grad_(), k.requires_grad_()


def _run(fn, q, k, cos, sin, dq_out, dk_out, **kw):
    q = q.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    qo, ko = fn(q, k, cos, sin, **kw)
    torch.autograd.backward([qo, ko], [dq_out, dk_out])
    return qo.detach(), ko.detach(), q.grad, k.grad


# Row 0 is two packed sequences (positions restart at 0), row 1 is one sequence
PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6]])


def test_matches_transformers_fp32_with_packed_positions():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = _tables(torch.float32, PACKED)
    q, k = _qk(torch.float32)
    dq, dk = torch.randn(B, HQ, T, D), torch.randn(B, HK, T, D)
    ours = _run(apply_rotary, q, k, cos, sin, dq, dk)
    ref = _run(apply_rotary_pos_emb, q, k, cos, sin, dq, dk)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # packed restart: the token at position 0 of the second packed sequence is not rotated at all
    torch.testing.assert_close(ours[0][0, :, 4], q[0, :, 4].detach(), atol=1e-6, rtol=0)


def test_backward_is_rotation_by_minus_theta():
    cos, sin = _tables(torch.float32, PACKED)
    q, k = _qk(torch.float32, seed=1)
    dq, dk = torch.randn(B, HQ, T, D), torch.randn(B, HK, T, D)
    _, _, gq, gk = _run(apply_rotary, q, k, cos, sin, dq, dk)
    inv_q, inv_k = apply_rotary_reference(dq, dk, cos, -sin)
    torch.testing.assert_close(gq, inv_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gk, inv_k, atol=1e-6, rtol=1e-6)


def test_bthd_layout_and_broadcast_tables():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = _tables(torch.float32, torch.arange(T)[None])  # (1, T, D): shared by the batch
    q = torch.randn(B, T, HQ, D)
    k = torch.randn(B, T, HK, D)
    ours = apply_rotary(q, k, cos, sin, unsqueeze_dim=2)
    ref = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_bf16_within_one_rounding():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = _tables(torch.bfloat16, PACKED)
    q, k = _qk(torch.bfloat16, seed=2)
    dq, dk = torch.randn(B, HQ, T, D).bfloat16(), torch.randn(B, HK, T, D).bfloat16()
    ours = _run(apply_rotary, q, k, cos, sin, dq, dk)
    ref = _run(apply_rotary_pos_emb, q, k, cos, sin, dq, dk)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=2 ** -6, rtol=2 ** -6)


def test_supported_shapes():
    cos, sin = _tables(torch.float32, PACKED)
    q, k = _qk(torch.float32)
    assert rope_supported(q, k, cos, sin)
    assert not rope_supported(q, k, cos[..., : D // 2], sin[..., : D // 2])  # partial rotary: eager handles it
    assert not rope_supported(q[..., :T - 1, :], k, cos, sin)  # sequence lengths disagree
