"""Contrastive (InfoNCE) Matryoshka loss: parity with a direct F.cross_entropy formula in float64,
an exact closed-form value, the prefix-combination rule, and the nested-prefix identity with
`maximus.embed`."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from maximus.embed import nested_prefix
from maximus.errors import ConfigError
from maximus.losses.matryoshka import info_nce, matryoshka_info_nce, normalized_prefix


def direct_info_nce(q, d, temperature):
    """The textbook formula: cosine-similarity logits over the batch, positive on the diagonal."""
    logits = (q / q.norm(dim=-1, keepdim=True)) @ (d / d.norm(dim=-1, keepdim=True)).T / temperature
    return F.cross_entropy(logits, torch.arange(q.shape[0]), reduction="sum")


def _pair(n=6, h=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, generator=g, requires_grad=True)
    d = (q.detach() + 0.8 * torch.randn(n, h, generator=g)).requires_grad_()
    return q, d


def test_matryoshka_info_nce_value_and_grads_match_direct_float64_formula():
    q, d = _pair()
    ours = matryoshka_info_nce(q, d, dims=[8, 16, 48, 64], weight=0.7, temperature=0.1)
    ours.backward()
    q64, d64 = q.detach().double().requires_grad_(), d.detach().double().requires_grad_()
    # 48 and 64 are >= the width 48: skipped (the full width is the main term).
    ref = direct_info_nce(q64, d64, 0.1) + 0.7 * (direct_info_nce(q64[:, :8], d64[:, :8], 0.1)
                                                  + direct_info_nce(q64[:, :16], d64[:, :16], 0.1)) / 2
    ref.backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(d.grad.double(), d64.grad, rtol=1e-4, atol=1e-6)


def test_info_nce_closed_form_for_orthonormal_pairs():
    # q_i = d_i = e_i: cosine 1 on the diagonal, 0 elsewhere -> each term is log(1 + (N-1) e^(-1/t)).
    n, t = 5, 0.5  # 0.05 would round the exact value (1e-8) to 0 in float32
    q = torch.eye(n, 8) * 3.0  # scale does not matter: inputs are normalised
    expected = n * math.log(1 + (n - 1) * math.exp(-1 / t))
    assert info_nce(q, q.clone(), t).item() == pytest.approx(expected, rel=1e-6)
    assert info_nce(q, q.clone(), t, reduction="mean").item() == pytest.approx(expected / n, rel=1e-6)
    assert info_nce(q, q.clone(), t, reduction="none").shape == (n,)


def test_weight_zero_or_no_active_dim_is_plain_info_nce_and_unit_weights_are_a_plain_sum():
    q, d = _pair()
    plain = info_nce(q, d, 0.05)
    assert torch.equal(matryoshka_info_nce(q, d, dims=[8, 16], weight=0.0), plain)
    assert torch.equal(matryoshka_info_nce(q, d, dims=[64, 128], weight=1.0), plain)
    assert torch.equal(matryoshka_info_nce(q, d, dims=[], weight=1.0), plain)
    # weight = number of dims: sentence-transformers' MatryoshkaLoss with unit weights.
    st = plain + info_nce(q[:, :8], d[:, :8], 0.05) + info_nce(q[:, :16], d[:, :16], 0.05)
    torch.testing.assert_close(matryoshka_info_nce(q, d, dims=[16, 8], weight=2.0), st)


def test_normalised_prefix_is_what_embed_returns_and_bad_dims_raise():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(4, 32, generator=g)
    assert torch.equal(normalized_prefix(v, 8), nested_prefix(v, 8))
    assert torch.equal(normalized_prefix(v), nested_prefix(v, None))
    assert torch.equal(normalized_prefix(v, 8), F.normalize(v[:, :8], dim=-1))
    with pytest.raises(ConfigError) as err:
        matryoshka_info_nce(v, v, dims=[0, 8])
    assert str(err.value) == ("matryoshka dims must be positive integers, got [0, 8] "
                              "(hint: e.g. optimization.matryoshka.dims: [64, 128, 256])")
