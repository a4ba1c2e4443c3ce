"""SDPA attention with sinks (`maximus.attention.sink_attention`) against Transformers' eager gpt-oss
attention (the oracle), float32, on a tiny random GptOssForCausalLM: logits, loss and every
gradient (the sinks' included), with full-length and shorter sliding windows, right padding,
packed documents and decoding with a cache."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from maximus.attention.sink_attention import IMPLEMENTATION
from maximus.families import attention_implementation
from tiny import build_family_model_dir, one_thread  # noqa: F401  (one_thread: a fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=[64, 8], ids=["window-reaches-all", "window-8"])
def pair(request, tmp_path_factory):
    path = build_family_model_dir(tmp_path_factory.mktemp("gpt_oss") / "m", "gpt_oss", sliding_window=request.param,
                                  prepare=lambda m: [layer.self_attn.sinks.normal_(0, 2) for layer in m.model.layers])
    eager = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32)
    implementation, notice = attention_implementation(eager.config)
    assert (implementation, notice) == (IMPLEMENTATION, None)
    sinks = copy.deepcopy(eager)
    sinks.set_attn_implementation(implementation)
    assert sinks.config._attn_implementation == IMPLEMENTATION
    return eager, sinks


def _ids(vocab: int, rows: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(0))


def _logits_loss_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_equal(got, expected):
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == expected[2].keys() and any("sinks" in n for n in got[2])
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _batches(vocab: int) -> dict:
    ids = _ids(vocab)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    positions = torch.cat([torch.arange(n) for n in (9, 10, 5)])[None].expand(2, -1)  # three packed documents
    return {"plain": dict(input_ids=ids, labels=ids),
            "padded": dict(input_ids=ids, attention_mask=mask, labels=labels),
            "packed": dict(input_ids=ids, position_ids=positions, labels=ids)}


@pytest.mark.parametrize("kind", ["plain", "padded", "packed"])
def test_logits_loss_and_every_gradient_equal_eager(pair, kind):
    eager, sinks = pair
    batch = _batches(eager.config.vocab_size)[kind]
    _assert_equal(_logits_loss_grads(sinks, **batch), _logits_loss_grads(eager, **batch))


def test_decoding_with_a_cache_equals_eager(pair):
    eager, sinks = pair
    ids = _ids(eager.config.vocab_size, rows=1, length=12)
    with torch.no_grad():
        expected = eager.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        got = sinks.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=1e-5, atol=1e-5)
