"""Padding-free attention over packed documents against Transformers' own SDPA path (oracle)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import maximus.attention.varlen as varlen
from maximus.attention.varlen import IMPLEMENTATION, document_spans, use_varlen_attention
from tiny import ARCHS, build_tiny_model_dir


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    path = build_tiny_model_dir(tmp_path_factory.mktemp(request.param) / "m", request.param)
    sdpa = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", dtype=torch.float32).eval()
    varlen = copy.deepcopy(sdpa)
    assert use_varlen_attention(varlen)
    assert varlen.config._attn_implementation == IMPLEMENTATION
    return sdpa, varlen


def packed_batch(vocab: int, lengths_per_row: list[list[int]]):
    g = torch.Generator().manual_seed(0)
    length = sum(lengths_per_row[0])
    ids = torch.randint(0, vocab, (len(lengths_per_row), length), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])
    return ids, pos


def test_document_spans_follow_position_resets():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert document_spans(pos) == [[(0, 3), (3, 5), (5, 6)], [(0, 6)]]
    assert document_spans(torch.arange(6)[None]) is None


@pytest.mark.parametrize("min_mean", [1, 64], ids=["per-document", "masked"])
def test_packed_logits_and_grads_equal_sdpa_with_its_mask(pair, min_mean, monkeypatch):
    monkeypatch.setattr(varlen, "MIN_MEAN_DOCUMENT_TOKENS", min_mean)  # these documents: 5-20 tokens
    monkeypatch.setattr(varlen, "MAX_SHORT_DOCUMENTS", 0)
    sdpa, varlen_model = pair
    ids, pos = packed_batch(sdpa.config.vocab_size, [[7, 12, 5, 8], [20, 12]])
    out = {}
    for name, model in (("sdpa", sdpa), ("varlen", varlen_model)):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        logits.float().logsumexp(-1).sum().backward()
        out[name] = (logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(out["varlen"][0], out["sdpa"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["varlen"][1], out["sdpa"][1], rtol=1e-4, atol=1e-5)


def test_each_document_equals_the_document_alone(pair, monkeypatch):
    monkeypatch.setattr(varlen, "MIN_MEAN_DOCUMENT_TOKENS", 1)
    _, model = pair
    ids, pos = packed_batch(model.config.vocab_size, [[9, 14, 9]])
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    alone = model(input_ids=ids[:, 9:23], use_cache=False).logits
    torch.testing.assert_close(packed[:, 9:23], alone, rtol=1e-5, atol=1e-5)


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.__name__:
            kwargs = kwargs or {}
            self.calls.append((func.__name__, tuple(args[0].shape), kwargs.get("attn_mask")))
        return func(*args, **(kwargs or {}))


def test_no_square_mask_and_per_document_causal_calls(pair, monkeypatch):
    monkeypatch.setattr(varlen, "MIN_MEAN_DOCUMENT_TOKENS", 1)
    _, model = pair
    ids, pos = packed_batch(model.config.vocab_size, [[7, 12, 5, 8]])
    with torch.no_grad(), _OpNames() as rec:
        model(input_ids=ids, position_ids=pos, use_cache=False)
    per_layer = len(rec.calls) // model.config.num_hidden_layers
    assert per_layer == 4  # one SDPA call per document
    assert sorted({c[1][2] for c in rec.calls}) == [5, 7, 8, 12]  # query lengths = document lengths
    assert all(mask is None for _, _, mask in rec.calls)  # causal flag, never a mask tensor


def test_short_documents_take_one_masked_call(pair, monkeypatch):
    monkeypatch.setattr(varlen, "MAX_SHORT_DOCUMENTS", 3)  # 4 documents of 5-12 tokens: masked
    _, model = pair
    ids, pos = packed_batch(model.config.vocab_size, [[7, 12, 5, 8]])  # mean 8 tokens < 64
    with torch.no_grad(), _OpNames() as rec:
        model(input_ids=ids, position_ids=pos, use_cache=False)
    assert len(rec.calls) == model.config.num_hidden_layers
    mask = rec.calls[0][2]
    assert mask is not None and tuple(mask.shape[-2:]) == (32, 32)
    allowed = mask if mask.dtype == torch.bool else mask == 0  # SDPA may get it as an additive mask
    assert not allowed[..., 7, 6].any() and allowed[..., 6, 0].all() and not allowed[..., 0, 1].any()


def test_padding_mask_and_generation_fall_back_to_sdpa(pair):
    sdpa, varlen = pair
    ids = torch.randint(0, sdpa.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    a = sdpa(input_ids=ids, attention_mask=mask).logits
    b = varlen(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(b, a)
    gen_a = sdpa.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    gen_b = varlen.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(gen_a, gen_b)


def test_only_sdpa_models_are_switched(tmp_path):
    path = build_tiny_model_dir(tmp_path / "m")
    eager = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager")
    assert use_varlen_attention(eager) is False
    assert eager.config._attn_implementation == "eager"
