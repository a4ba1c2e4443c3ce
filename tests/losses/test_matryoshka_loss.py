"""Matryoshka auxiliary loss: parity with the naive float64 formula (value and gradients), the
rule that skips prefixes as wide as the hidden state, its use inside the SFT objective, and the
config's weight default per objective. (The shared pass against the separate one:
test_matryoshka_shared.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maximus.errors import ConfigError
from maximus.losses.matryoshka import active_dims, matryoshka_loss_sum


def naive_matryoshka(hidden, weight, target, dims, factor):
    """The published formula with full float64 logits per prefix and F.cross_entropy."""
    h = hidden.double().reshape(-1, hidden.shape[-1])
    w = weight.double()
    t = target.reshape(-1)
    terms = [F.cross_entropy(h[:, :d] @ w[:, :d].T, t, ignore_index=-100, reduction="sum") for d in dims]
    return factor * torch.stack(terms).mean()


def _inputs(hidden_size=48, vocab=37, shape=(3, 11), seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, hidden_size, generator=g)).requires_grad_()
    target = torch.randint(0, vocab, shape, generator=g)
    target[0, :4] = -100
    target[2, -1] = -100
    return hidden, weight, target


def test_value_and_grads_match_naive_float64():
    hidden, weight, target = _inputs()
    ours = matryoshka_loss_sum(hidden, weight, target, dims=[8, 16, 32], weight=0.2, chunk_size=5)
    ours.backward()
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = naive_matryoshka(h64, w64, target, [8, 16, 32], 0.2)
    ref.backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    # Dimensions past the widest prefix never enter the auxiliary loss.
    assert torch.count_nonzero(hidden.grad[..., 32:]) == 0
    assert torch.count_nonzero(weight.grad[:, 32:]) == 0
    assert torch.count_nonzero(hidden.grad[0, :4]) == 0  # ignored targets give no gradient


def test_dims_at_or_above_hidden_size_are_skipped():
    hidden, weight, target = _inputs(hidden_size=32)
    assert active_dims([64, 8, 32, 16, 8], 32) == [8, 16]
    ours = matryoshka_loss_sum(hidden, weight, target, dims=[64, 8, 32, 16], weight=0.5)
    ref = naive_matryoshka(hidden.detach(), weight.detach(), target, [8, 16], 0.5)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


def test_no_active_dim_or_zero_weight_gives_exact_zero():
    hidden, weight, target = _inputs(hidden_size=32)
    for kwargs in (dict(dims=[32, 64, 128]), dict(dims=[8], weight=0.0)):
        out = matryoshka_loss_sum(hidden, weight, target, **kwargs)
        assert out.dtype == torch.float32 and out.item() == 0.0


def test_bf16_hidden_close_to_float64():
    hidden, weight, target = _inputs(hidden_size=64, vocab=50)
    ours = matryoshka_loss_sum(hidden.detach().bfloat16(), weight.detach().bfloat16(), target, dims=[16, 32])
    ref = naive_matryoshka(hidden.detach().bfloat16(), weight.detach().bfloat16(), target, [16, 32], 0.2)
    torch.testing.assert_close(ours.double(), ref, rtol=2e-3, atol=2e-3)


def test_bad_dims_raise_config_error():
    hidden, weight, target = _inputs()
    with pytest.raises(ConfigError) as err:
        matryoshka_loss_sum(hidden, weight, target, dims=[0, 16])
    assert str(err.value) == ("matryoshka dims must be positive integers, got [0, 16] "
                              "(hint: e.g. optimization.matryoshka.dims: [64, 128, 256])")


def test_objective_adds_matryoshka_to_the_exact_loss():
    """The trainer's objective: main loss + auxiliary loss equals the two oracles added."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.config import MatryoshkaConfig
    from maximus.forward import sft_loss_sum

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    input_ids = torch.randint(0, 61, (2, 9))
    labels = input_ids.clone()
    labels[0, :3] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    mcfg = MatryoshkaConfig(dims=[8, 16, 64], weight=0.3, token_fraction=1.0)
    with torch.no_grad():
        total, count = sft_loss_sum(model, batch, mode="exact", matryoshka=mcfg)
        hidden = model.model(input_ids=input_ids).last_hidden_state
        target = torch.full_like(labels, -100)
        target[:, :-1] = labels[:, 1:]
        main = model(input_ids=input_ids, labels=labels).loss * count  # Transformers' mean -> sum
        aux = naive_matryoshka(hidden, model.lm_head.weight, target, [8, 16], 0.3)
    assert count == (target != -100).sum()
    torch.testing.assert_close(total.double(), main.double() + aux, rtol=1e-5, atol=1e-4)


def test_objective_samples_tokens_for_the_ghost_and_exact_main_loss():
    """With token_fraction < 1 the objective adds the sampled prefix loss (oracle: F.cross_entropy on
    the sampled rows times their factors) to the exact main loss and to the ghost main loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.config import MatryoshkaConfig
    from maximus.losses.ghost_logit import ghost_logit_loss
    from maximus.losses.matryoshka import sampled_tokens
    from maximus.forward import sft_loss_sum

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    input_ids = torch.randint(0, 61, (2, 70))
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}
    mcfg = MatryoshkaConfig(dims=[8, 16], weight=0.4, token_fraction=0.25)
    ghost = {"num_candidates": 8, "prefix_dims": 8}
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids).last_hidden_state.reshape(-1, 32)
        target = torch.full_like(input_ids, -100)
        target[:, :-1] = input_ids[:, 1:]
        target = target.reshape(-1)
        rows, factor = sampled_tokens(target, 0.25)
        w = model.lm_head.weight
        aux = 0.4 * sum((F.cross_entropy(hidden[rows, :d] @ w[:, :d].T, target[rows].clamp(min=0), reduction="none")
                         * factor).sum() for d in (8, 16)) / 2
        exact, _ = sft_loss_sum(model, batch, mode="exact", matryoshka=mcfg)
        main = F.cross_entropy(hidden @ w.T, target, reduction="sum")
        ghost_total, _ = sft_loss_sum(model, batch, mode="ghost", ghost=ghost, matryoshka=mcfg)
        ghost_main = ghost_logit_loss(hidden, w, target, **ghost, reduction="sum")
    assert rows.numel() == 16 + 16 + 3  # 140 tokens = groups of 64, 64 and 12: ceil(0.25 x size) each
    torch.testing.assert_close(exact, main + aux, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ghost_total, ghost_main + aux, rtol=1e-5, atol=1e-4)


def test_config_weight_defaults_per_objective():
    from maximus.config import MatryoshkaConfig

    assert MatryoshkaConfig().weight is None
    assert MatryoshkaConfig().weight_for("sft") == 0.2
    assert MatryoshkaConfig().weight_for("contrastive") == 1.0
    assert MatryoshkaConfig(weight=0.5).weight_for("contrastive") == 0.5
    assert MatryoshkaConfig(weight=0.0).weight_for("sft") == 0.0
