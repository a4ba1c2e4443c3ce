"""Exact recovery: within the detail budget Kronecker Sketching attention *is* causal attention.

Oracles: torch SDPA (one layer) and the stock Transformers model with attn_implementation="sdpa"
(Llama, Mistral, Qwen2; padding masks, packed documents, Mistral's sliding window).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from maximus.attention import KroneckerSketch, install_kronecker
from maximus.config import KroneckerConfig

SMALL = KroneckerConfig(detail_tokens=64, sketch_slots=16, block=16)


@pytest.mark.parametrize("n", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_layer_equals_sdpa_causal_within_budget(n, heads, kv_heads):
    torch.manual_seed(n)
    q = torch.randn(2, heads, n, 8)
    k, v = torch.randn(2, kv_heads, n, 8), torch.randn(2, kv_heads, n, 8)
    out = KroneckerSketch(8, SMALL)(q, k, v, scaling=8 ** -0.5)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_layer_equals_sdpa_for_the_new_tokens_of_a_cache():
    # Queries are the last 5 of 50 positions (decoding with a cache).
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    mask = torch.arange(50)[None] <= torch.arange(45, 50)[:, None]
    out = KroneckerSketch(8, SMALL)(q, k, v, scaling=8 ** -0.5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_budget_is_whole_blocks_and_beyond_it_the_layer_approximates():
    sk = KroneckerSketch(8, KroneckerConfig(detail_tokens=70, sketch_slots=16, block=16))
    assert (sk.detail_tokens, sk.local_blocks, sk.select_blocks, sk.slots) == (64, 2, 2, 16)
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 200, 8), torch.randn(1, 2, 200, 8), torch.randn(1, 2, 200, 8)
    out = sk(q, k, v, scaling=8 ** -0.5)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[:, :, :64], ref[:, :, :64], atol=2e-6, rtol=1e-5)
    assert (out[:, :, 64:] - ref[:, :, 64:]).abs().max() > 1e-3


def _tiny(kind, **extra):
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, attn_implementation="sdpa")
    common.update(extra)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=None, **common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common)).eval()


def _pair(kind, **extra):
    stock = _tiny(kind, **extra)
    ours = install_kronecker(copy.deepcopy(stock), SMALL)
    assert ours.config._attn_implementation == "maximus_kronecker"
    assert stock.config._attn_implementation == "sdpa"
    return stock, ours


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_model_logits_equal_stock_sdpa_within_budget(kind):
    stock, ours = _pair(kind)
    ids = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, stock(ids).logits, atol=2e-5, rtol=1e-5)
        # Left padding: logits of real tokens match.
        mask = torch.ones(2, 64, dtype=torch.long)
        mask[1, :9] = 0
        a, b = ours(ids, attention_mask=mask).logits, stock(ids, attention_mask=mask).logits
        torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=2e-5, rtol=1e-5)


def test_model_packed_documents_match_stock_packing():
    stock, ours = _pair("llama")
    ids = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(6))
    position_ids = torch.cat([torch.arange(25), torch.arange(20), torch.arange(15)])[None]
    with torch.no_grad():
        a = ours(ids, position_ids=position_ids, use_cache=False).logits
        b = stock(ids, position_ids=position_ids, use_cache=False).logits
        alone = stock(ids[:, 25:45], use_cache=False).logits
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(a[:, 25:45], alone, atol=2e-5, rtol=1e-5)


def test_mistral_sliding_window_matches_stock():
    stock, ours = _pair("mistral")
    for m in (stock, ours):
        m.config.sliding_window = 24
    ids = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a, b = ours(ids, use_cache=False).logits, stock(ids, use_cache=False).logits
        stock.config.sliding_window = None
        no_window = stock(ids, use_cache=False).logits
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert (b - no_window).abs().max() > 1e-4  # the window really changes the answer


def test_bf16_model_stays_close_to_stock():
    stock, ours = _pair("llama")
    stock, ours = stock.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        a, b = ours(ids).logits.float(), stock(ids).logits.float()
    assert (a - b).abs().max() < 0.05 * b.abs().max()
