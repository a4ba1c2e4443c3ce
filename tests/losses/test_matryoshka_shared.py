"""The shared nested pass of the Matryoshka auxiliary loss against the separate-pass reference
(`linear_cross_entropy` for the main loss + one chunked CE per prefix), and the token sampling of
`token_fraction` against F.cross_entropy on the sampled rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maximus.errors import ConfigError
from maximus.losses.linear_cross_entropy import linear_cross_entropy
from maximus.losses.matryoshka import (
    SAMPLE_GROUP_TOKENS,
    cross_entropy_with_matryoshka,
    matryoshka_loss_sum,
    sampled_tokens,
    separate_matryoshka_loss_sum,
)

DIMS = [8, 16, 32]


def _inputs(hidden_size=48, vocab=37, num_tokens=150, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=g, dtype=dtype)
    weight = 0.3 * torch.randn(vocab, hidden_size, generator=g, dtype=dtype)
    bias = 0.1 * torch.randn(vocab, generator=g, dtype=dtype)
    target = torch.randint(0, vocab, (num_tokens,), generator=g)
    target[:40] = -100  # a masked prompt
    target[100:110] = -100
    return hidden, weight, bias, target


def _value_and_grads(loss_fn, *tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = loss_fn(*leaves)
    out.backward()
    return [out.detach()] + [leaf.grad for leaf in leaves]


def _separate(h, w, b, t, softcap=None, weight=0.2):
    return (linear_cross_entropy(h, w, t, reduction="sum", bias=b, softcap=softcap)
            + separate_matryoshka_loss_sum(h, w, t, dims=DIMS, weight=weight))


@pytest.mark.parametrize("chunk_size", [32, None])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_shared_pass_equals_separate_passes_float64(chunk_size, softcap):
    hidden, weight, bias, target = _inputs()
    ours = _value_and_grads(lambda h, w, b: cross_entropy_with_matryoshka(
        h, w, target, dims=DIMS, weight=0.2, chunk_size=chunk_size, bias=b, softcap=softcap), hidden, weight, bias)
    ref = _value_and_grads(lambda h, w, b: _separate(h, w, b, target, softcap), hidden, weight, bias)
    assert ours[0].dtype == torch.float64
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [16, None])
def test_aux_only_nested_pass_equals_separate_float64(chunk_size):
    hidden, weight, _, target = _inputs()
    ours = _value_and_grads(lambda h, w: matryoshka_loss_sum(h, w, target, dims=DIMS + [48, 96], weight=0.3,
                                                             chunk_size=chunk_size), hidden, weight)
    ref = _value_and_grads(lambda h, w: separate_matryoshka_loss_sum(h, w, target, dims=DIMS, weight=0.3), hidden, weight)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    assert torch.count_nonzero(ours[1][:, 32:]) == 0  # columns past the widest prefix get no gradient


def test_lora_head_gradient_reaches_the_adapter():
    """A non-leaf head weight (base + B @ A, as a LoRA head's effective weight): the shared pass
    sends the same gradient to A and B as the separate passes, and none to the frozen base."""
    hidden, weight, _, target = _inputs()
    g = torch.Generator().manual_seed(1)
    lora_a = 0.1 * torch.randn(4, 48, generator=g, dtype=torch.float64)
    lora_b = 0.1 * torch.randn(37, 4, generator=g, dtype=torch.float64)
    ours = _value_and_grads(lambda h, a, b: cross_entropy_with_matryoshka(h, weight + b @ a, target, dims=DIMS),
                            hidden, lora_a, lora_b)
    ref = _value_and_grads(lambda h, a, b: _separate(h, weight + b @ a, None, target), hidden, lora_a, lora_b)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_bf16_shared_pass_as_close_to_float64_as_separate_passes():
    hidden, weight, bias, target = _inputs(hidden_size=128, vocab=500, num_tokens=200)
    weight = weight * 0.2
    dims = [16, 32, 64]
    exact = _value_and_grads(lambda h, w: linear_cross_entropy(h, w, target, reduction="sum") + separate_matryoshka_loss_sum(
        h, w, target, dims=dims), hidden, weight)
    errors = {}
    for name, fn in {"shared": lambda h, w: cross_entropy_with_matryoshka(h, w, target, dims=dims, chunk_size=64),
                     "separate": lambda h, w: linear_cross_entropy(h, w, target, reduction="sum", chunk_size=64)
                     + separate_matryoshka_loss_sum(h, w, target, dims=dims, chunk_size=64)}.items():
        got = _value_and_grads(fn, hidden.bfloat16(), weight.bfloat16())
        assert got[1].dtype == got[2].dtype == torch.bfloat16
        errors[name] = [((a.double() - r).abs().max() / r.abs().max()).item() for a, r in zip(got, exact)]
    for shared, separate in zip(errors["shared"], errors["separate"]):
        assert shared < max(2 * separate, 1e-4) and shared < 2e-2, errors


def test_no_grad_value_equals_training_value():
    hidden, weight, bias, target = _inputs()
    with torch.no_grad():
        evaluated = cross_entropy_with_matryoshka(hidden, weight, target, dims=DIMS, bias=bias)
    trained = cross_entropy_with_matryoshka(hidden.requires_grad_(), weight, target, dims=DIMS, bias=bias)
    torch.testing.assert_close(evaluated, trained.detach(), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ token sampling
def test_sampled_tokens_per_group_counts_and_factors():
    _, _, _, target = _inputs(num_tokens=150)  # groups of 64, 64 and 22 tokens
    rows, factor = sampled_tokens(target, 0.25)
    assert rows.numel() == 16 + 16 + 6  # ceil(0.25 x group size)
    assert torch.equal(rows, rows.sort().values) and rows.unique().numel() == rows.numel()
    assert torch.equal(rows, sampled_tokens(target, 0.25)[0])  # deterministic
    assert not torch.equal(rows, sampled_tokens(target, 0.25, seed=1)[0])
    valid = target != -100
    assert bool(valid[rows].all())  # ignored tokens are only taken when a group lacks valid ones
    for start in range(0, 150, SAMPLE_GROUP_TOKENS):
        in_group = (rows >= start) & (rows < start + SAMPLE_GROUP_TOKENS)
        n_valid = int(valid[start:start + SAMPLE_GROUP_TOKENS].sum())
        # each sampled token stands for n / m tokens: the factors add up to the group's valid count
        torch.testing.assert_close(factor[in_group].sum().item(), float(n_valid))
    rows_all, factor_all = sampled_tokens(target, 1.0)
    assert torch.equal(rows_all, torch.arange(150)) and torch.equal(factor_all, valid.float())


def test_group_with_fewer_valid_tokens_than_samples_weights_them_one():
    target = torch.full((64,), -100)
    target[[3, 50]] = 7
    rows, factor = sampled_tokens(target, 0.25)
    assert rows.numel() == 16 and set(rows[factor > 0].tolist()) == {3, 50}
    assert torch.equal(factor[factor > 0], torch.ones(2))


def test_sampled_loss_equals_cross_entropy_on_the_sampled_rows():
    """Value and gradients: the oracle is F.cross_entropy on the sampled rows times their factors,
    the same whatever the chunk size, in the aux-only pass and added to the exact main loss."""
    hidden, weight, bias, target = _inputs(num_tokens=300)
    rows, factor = sampled_tokens(target, 0.125, seed=3)

    def oracle(h, w, b, with_main):
        aux = sum((F.cross_entropy(h[rows, :d] @ w[:, :d].T, target[rows].clamp(min=0), reduction="none") * factor).sum()
                  for d in DIMS) * (0.2 / len(DIMS))
        return aux + F.cross_entropy(h @ w.T + b, target, reduction="sum") if with_main else aux

    for chunk_size in (8, None):
        ours = _value_and_grads(lambda h, w: matryoshka_loss_sum(h, w, target, dims=DIMS, token_fraction=0.125, seed=3,
                                                                 chunk_size=chunk_size), hidden, weight)
        ref = _value_and_grads(lambda h, w: oracle(h, w, None, False), hidden, weight)
        for a, r in zip(ours, ref):
            torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    ours = _value_and_grads(lambda h, w, b: cross_entropy_with_matryoshka(h, w, target, dims=DIMS, token_fraction=0.125,
                                                                          seed=3, bias=b), hidden, weight, bias)
    ref = _value_and_grads(lambda h, w, b: oracle(h, w, b, True), hidden, weight, bias)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_sampled_loss_is_unbiased_over_seeds():
    """The mean over 300 samples (seeds) is within 3 standard errors of the all-token loss."""
    hidden, weight, _, target = _inputs(num_tokens=256)
    full = separate_matryoshka_loss_sum(hidden, weight, target, dims=DIMS).item()
    with torch.no_grad():
        draws = torch.stack([matryoshka_loss_sum(hidden, weight, target, dims=DIMS, token_fraction=0.25, seed=s)
                             for s in range(300)])
    stderr = draws.std().item() / 300 ** 0.5
    assert abs(draws.mean().item() - full) < 3 * stderr
    assert draws.std().item() > 0.01 * full  # the samples really differ


def test_bad_token_fraction_raises_config_error():
    hidden, weight, _, target = _inputs()
    for fraction in (0.0, 1.5):
        with pytest.raises(ConfigError) as err:
            cross_entropy_with_matryoshka(hidden, weight, target, dims=DIMS, token_fraction=fraction)
        assert str(err.value) == (f"matryoshka token_fraction must be in (0, 1], got {fraction!r} "
                                  "(hint: e.g. optimization.matryoshka.token_fraction: 0.25 (1 = every target token))")
