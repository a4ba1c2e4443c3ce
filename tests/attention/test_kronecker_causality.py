"""Causality of Kronecker Sketching attention, proven by perturbation on one attention layer.

For every length the layer runs well past its detail budget (selection and sketch slots active).
Changing queries, keys and values after position t must leave outputs at <= t bit-identical, and
the gradient of the output at t with respect to anything after t must be exactly zero.
"""
import pytest
import torch
import torch.nn.functional as F

from maximus.attention import KroneckerSketch
from maximus.structure import document_starts, documents_in
from maximus.config import KroneckerConfig

HEADS, KV_HEADS, DIM = 2, 1, 8
SETTINGS = KroneckerConfig(detail_tokens=256, sketch_slots=16, block=64)


def _sketch(seed=0):
    torch.manual_seed(seed)
    sk = KroneckerSketch(DIM, SETTINGS)
    with torch.no_grad():  # move off the identity / zero start so every parameter matters
        for p in sk.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return sk.eval()


def _qkv(n, seed=1, batch=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, HEADS, n, DIM, generator=g), torch.randn(batch, KV_HEADS, n, DIM, generator=g),
            torch.randn(batch, KV_HEADS, n, DIM, generator=g))


def _perturb_after(t, *tensors, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for x in tensors:
        y = x.clone()
        y[:, :, t + 1:] = 5 * torch.randn(y[:, :, t + 1:].shape, generator=g)
        out.append(y)
    return out


def _run(sk, q, k, v, **kw):
    return sk(q, k, v, scaling=DIM ** -0.5, **kw)


@pytest.mark.parametrize("n, t", [(1024, 511), (1024, 700), (4096, 2047), (4096, 3001), (16384, 9000)])
def test_outputs_up_to_t_are_bit_identical_when_the_future_changes(n, t):
    sk = _sketch()
    q, k, v = _qkv(n)
    with torch.no_grad():
        base = _run(sk, q, k, v)
        changed = _run(sk, *_perturb_after(t, q, k, v))
        exact = F.scaled_dot_product_attention(q, k.expand(-1, HEADS, -1, -1), v.expand(-1, HEADS, -1, -1), is_causal=True)
    assert torch.equal(base[:, :, :t + 1], changed[:, :, :t + 1])
    assert (base[:, :, t + 1:] - changed[:, :, t + 1:]).abs().max() > 0.1  # the perturbation is seen later
    # Within the detail budget (256 tokens) the layer is exact; past it, it approximates and is not
    # silently running exact attention.
    budget = SETTINGS.detail_tokens
    torch.testing.assert_close(base[:, :, :budget], exact[:, :, :budget], rtol=1e-5, atol=1e-5)
    assert (base[:, :, 2 * budget:] - exact[:, :, 2 * budget:]).abs().max() > 1e-3


@pytest.mark.parametrize("n, t", [(1024, 600), (4096, 3100)])
def test_gradient_of_output_at_t_wrt_the_future_is_exactly_zero(n, t):
    sk = _sketch().train()
    q, k, v = (x.requires_grad_(True) for x in _qkv(n))
    out = _run(sk, q, k, v)
    weight = torch.randn(out.shape[1], out.shape[-1], generator=torch.Generator().manual_seed(3))
    (out[:, :, t] * weight).sum().backward()
    for x in (q, k, v):
        assert torch.count_nonzero(x.grad[:, :, t + 1:]) == 0
    assert torch.count_nonzero(k.grad[:, :, : t - 300]) > 0  # far past keys do receive gradient
    # The importance scorer is trained through the straight-through term (selection is active).
    assert sk.score_query.grad.abs().sum() > 0 and sk.sub_slot_logits.grad.abs().sum() > 0


def test_queries_in_the_same_block_do_not_see_each_others_future():
    # t in the middle of a block: the block-level choices (selection, slots) must not use block j.
    sk = _sketch()
    q, k, v = _qkv(2048)
    for t in (1024, 1025, 1087, 1088):
        with torch.no_grad():
            a = _run(sk, q, k, v)
            b = _run(sk, *_perturb_after(t, q, k, v, seed=t))
        assert torch.equal(a[:, :, :t + 1], b[:, :, :t + 1]), t


def test_packed_documents_do_not_see_each_other():
    # Three documents of 900, 1300 and 1896 tokens, boundaries inside blocks.
    lengths = [900, 1300, 1896]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    doc_start = document_starts(position_ids)
    sk = _sketch()
    q, k, v = _qkv(sum(lengths))
    lo, hi = 900, 2200  # the middle document
    g = torch.Generator().manual_seed(4)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):  # change the first and the last document, keep the middle one
        x[:, :, :lo] = torch.randn(x[:, :, :lo].shape, generator=g)
        x[:, :, hi:] = torch.randn(x[:, :, hi:].shape, generator=g)
    with torch.no_grad():
        a = _run(sk, q, k, v, doc_start=doc_start)
        b = _run(sk, q2, k2, v2, doc_start=doc_start)
        alone = _run(sk, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi])
    assert torch.equal(a[:, :, lo:hi], b[:, :, lo:hi])
    # Packed mid-block, the document still gets the same answer as on its own up to the detail
    # budget (exact there); beyond it block boundaries differ, so only closeness is expected.
    assert torch.allclose(a[:, :, lo:lo + 192], alone[:, :, :192], atol=1e-5)


def test_padding_keys_are_invisible_and_padding_queries_are_zero():
    sk = _sketch()
    q, k, v = _qkv(1500, batch=2)
    valid = torch.ones(2, 1500, dtype=torch.bool)
    valid[0, :300] = False  # left padding on the first row
    k2, v2 = k.clone(), v.clone()
    k2[0, :, :300] = 100.0
    v2[0, :, :300] = -100.0
    with torch.no_grad():
        a = _run(sk, q, k, v, key_valid=valid)
        b = _run(sk, q, k2, v2, key_valid=valid)
    assert torch.equal(a, b)
    assert torch.count_nonzero(a[0, :, :300]) == 0


def test_document_starts_follows_transformers_packing_rule():
    from transformers.masking_utils import find_packed_sequence_indices

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_starts(pos).tolist() == [[0, 0, 0, 3, 3, 5, 5, 5, 5], [0] * 9]
    seq = find_packed_sequence_indices(pos)
    starts = document_starts(pos)
    same_doc = seq[:, :, None] == seq[:, None, :]
    assert torch.equal(same_doc, starts[:, :, None] == starts[:, None, :])
    assert document_starts(torch.arange(7)[None]) is None
    # the same rule counts a row's documents, on the lists the data pipeline writes
    assert [documents_in(row) for row in pos.tolist()] == [3, 1] == (seq.amax(-1) + 1).tolist()
    assert documents_in([0, 1, 0, 0, 5]) == 4 and documents_in([]) == 1 and documents_in(None) == 1
