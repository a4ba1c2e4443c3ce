"""Parity of the chunked linear cross-entropy with F.cross_entropy on full logits (the oracle)."""
import pytest
import torch
import torch.nn.functional as F

from maximus.errors import ConfigError
from tiny import OpRecorder

from maximus.losses import (
    chunk_size_for_budget,
    linear_cross_entropy,
    naive_cross_entropy,
    token_log_probs,
)
from maximus.losses.linear_cross_entropy import DEFAULT_CHUNK_LOGITS_BYTES, DEFAULT_CHUNK_TOKENS, default_chunk_size



def make_case(n=2, t=23, h=12, v=37, dtype=torch.float64, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, h, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, v, (n, t), generator=g)
    if ignore:
        labels[0, :5] = -100
        labels[-1, -3:] = -100
    return hidden, weight, labels


def oracle(hidden, weight, labels, bias=None, z_loss=0.0, softcap=None, reduction="mean"):
    """Independent formula: F.cross_entropy on full logits, plus z-loss / soft cap written out."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = labels.reshape(-1)
    valid = flat != -100
    per_token = F.cross_entropy(logits, flat, reduction="none")  # 0 at ignore_index
    per_token = per_token + z_loss * torch.logsumexp(logits, dim=-1).square() * valid
    if reduction == "none":
        return per_token.reshape(labels.shape)
    return per_token.sum() / valid.sum() if reduction == "mean" else per_token.sum()


def grads(loss, inputs, seed=1):
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=loss.dtype)
    return torch.autograd.grad(loss, inputs, upstream)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_float64_parity_value_and_both_gradients(reduction, chunk_size):
    hidden, weight, labels = make_case()
    bias = torch.randn(weight.shape[0], dtype=torch.float64, requires_grad=True)
    ours = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, reduction=reduction, bias=bias)
    ref = oracle(hidden, weight, labels, bias=bias, reduction=reduction)
    assert ours.shape == ref.shape and ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads(ours, [hidden, weight, bias]), grads(ref, [hidden, weight, bias])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_extreme_logits_float32_loss_and_gradient_match_float64():
    """Logit gaps of hundreds: wrong targets' probabilities underflow float32 (loss > 104), right
    ones round to 1. The log-sum-exp must not come from a target probability."""
    hidden, weight, labels = make_case(dtype=torch.float64, ignore=False)
    with torch.no_grad():
        hidden.mul_(25.0)
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    ref_tokens = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
    assert ref_tokens.max() > 110 and ref_tokens.min() < 1e-6  # both extremes are in the case
    h32 = hidden.detach().float().requires_grad_()
    ours = linear_cross_entropy(h32, weight.detach().float(), labels, chunk_size=7, reduction="none")
    torch.testing.assert_close(ours.double().reshape(-1), ref_tokens, rtol=1e-5, atol=1e-4)
    (g_ours,) = torch.autograd.grad(ours.sum(), h32)
    (g_ref,) = torch.autograd.grad(ref_tokens.sum(), hidden)
    torch.testing.assert_close(g_ours.double(), g_ref, rtol=1e-4, atol=1e-3)


def test_softmax_cross_entropy_in_place_on_contiguous_and_strided_buffers():
    """The in-place softmax kernel is used on contiguous buffers only; a strided one (a transposed
    view) takes the copy path. Both give F.cross_entropy's loss and softmax - onehot."""
    from maximus.losses.linear_cross_entropy import softmax_cross_entropy_

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 50, generator=g) * 4
    labels = torch.randint(0, 50, (8,), generator=g)
    expected_grad = torch.softmax(logits, dim=1) - F.one_hot(labels, 50)
    strided = torch.empty(50, 8).t()
    for buf in (logits.clone(), strided.copy_(logits)):
        loss, lse, grad = softmax_cross_entropy_(buf, labels, torch.ones(8), 0.0, True, scaled=False)
        torch.testing.assert_close(loss, F.cross_entropy(logits, labels, reduction="none"))
        torch.testing.assert_close(lse, torch.logsumexp(logits, dim=1))
        torch.testing.assert_close(grad, expected_grad)


def test_matches_torch_cross_entropy_mean_directly():
    hidden, weight, labels = make_case()
    ref = F.cross_entropy(hidden.reshape(-1, 12) @ weight.t(), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, labels, chunk_size=5), ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("z_loss,softcap", [(1e-3, None), (0.0, 2.5), (1e-2, 4.0)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_z_loss_and_softcap_parity(z_loss, softcap, reduction):
    hidden, weight, labels = make_case(seed=3)
    ours = linear_cross_entropy(hidden, weight, labels, chunk_size=9, z_loss=z_loss, softcap=softcap,
                                reduction=reduction)
    ref = oracle(hidden, weight, labels, z_loss=z_loss, softcap=softcap, reduction=reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads(ours, [hidden, weight]), grads(ref, [hidden, weight])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # naive_cross_entropy (the `loss: naive` mode) implements the same formula.
    torch.testing.assert_close(naive_cross_entropy(hidden, weight, labels, z_loss=z_loss, softcap=softcap,
                                                   reduction=reduction), ref, rtol=1e-12, atol=1e-12)


def test_bfloat16_close_to_float64_and_no_worse_than_naive_bfloat16():
    hidden, weight, labels = make_case(n=4, t=64, h=64, v=300, dtype=torch.float32, seed=5)
    h16 = (hidden.detach() * 0.5).bfloat16().requires_grad_()
    w16 = (weight.detach() * 0.1).bfloat16().requires_grad_()
    h64 = h16.detach().double().requires_grad_()
    w64 = w16.detach().double().requires_grad_()
    ref = oracle(h64, w64, labels)
    ref_grads = torch.autograd.grad(ref, [h64, w64])
    ours = linear_cross_entropy(h16, w16, labels, chunk_size=32)
    naive = naive_cross_entropy(h16, w16, labels)
    assert ours.dtype == torch.float32
    our_grads = torch.autograd.grad(ours, [h16, w16])
    naive_grads = torch.autograd.grad(naive, [h16, w16])
    assert our_grads[0].dtype == torch.bfloat16 and our_grads[1].dtype == torch.bfloat16
    assert abs(ours.item() - ref.item()) < 2e-2
    for mine, theirs, exact in zip(our_grads, naive_grads, ref_grads):
        err = (mine.double() - exact).abs().max().item()
        naive_err = (theirs.double() - exact).abs().max().item()
        assert err <= 2 * naive_err + 1e-6, (err, naive_err)


def test_lora_like_non_leaf_weight_gradients_flow_to_adapter():
    hidden, base, labels = make_case(seed=7)
    base = base.detach()  # frozen head
    g = torch.Generator().manual_seed(8)
    lora_a = torch.randn(4, base.shape[1], generator=g, dtype=torch.float64, requires_grad=True)
    lora_b = torch.randn(base.shape[0], 4, generator=g, dtype=torch.float64, requires_grad=True)
    ours = linear_cross_entropy(hidden, base + lora_b @ lora_a, labels, chunk_size=10)
    ref = oracle(hidden, base + lora_b @ lora_a, labels)
    for a, b in zip(torch.autograd.grad(ours, [hidden, lora_a, lora_b]),
                    torch.autograd.grad(ref, [hidden, lora_a, lora_b])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    hidden, weight, labels = make_case()
    weight = weight.detach()
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    loss.backward()
    ref_hidden = hidden.grad.clone()
    hidden.grad = None
    oracle(hidden, weight, labels).backward()
    torch.testing.assert_close(ref_hidden, hidden.grad, rtol=1e-10, atol=1e-12)
    assert weight.grad is None


def test_tied_input_and_output_embedding():
    g = torch.Generator().manual_seed(11)
    embed = torch.nn.Embedding(31, 8, dtype=torch.float64)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(31, 8, generator=g, dtype=torch.float64))
    tokens = torch.randint(0, 31, (3, 10), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100

    def step(loss_fn):
        embed.zero_grad()
        hidden = torch.tanh(embed(tokens))
        loss_fn(hidden, embed.weight, labels).backward()
        return embed.weight.grad.clone()

    ours = step(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=4))
    ref = step(oracle)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_token_log_probs_matches_log_softmax_gather():
    hidden, weight, labels = make_case(seed=13)
    ours = token_log_probs(hidden, weight, labels, chunk_size=6)
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)
    ref = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels != -100)
    assert ours.shape == labels.shape
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    assert (ours[0, :5] == 0).all()
    # DPO-style sequence sums, differentiated.
    for a, b in zip(grads(ours.sum(-1), [hidden, weight]), grads(ref.sum(-1), [hidden, weight])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_all_ignored_gives_zero_loss_and_zero_gradients_not_nan():
    hidden, weight, labels = make_case()
    labels = torch.full_like(labels, -100)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    assert naive_cross_entropy(hidden, weight, labels).item() == 0.0


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_never_allocates_tokens_by_vocab(reduction):
    n, v, chunk = 256, 400, 32
    hidden, weight, labels = make_case(n=1, t=n, h=16, v=v, dtype=torch.float32)
    with OpRecorder() as rec:
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, reduction=reduction)
        loss.sum().backward()
    assert rec.largest == max(chunk * v, v * 16), rec.largest  # one chunk of logits, or the weight gradient
    assert "aten._local_scalar_dense.default" not in rec.ops  # no .item(): no host sync
    with OpRecorder() as rec:
        naive_cross_entropy(hidden, weight, labels).backward()
    assert rec.largest == n * v  # the oracle does hold the full logits


def test_chunk_sizes_from_budget():
    # float32: 4 bytes of logits per vocabulary entry + 4 bytes per hidden value.
    assert chunk_size_for_budget(8192, 128256, 4096, 4, 256 * 2**20) == 256 * 2**20 // (128256 * 4 + 4096 * 4)
    # bf16 also keeps a 2-byte copy of the chunk's logits.
    assert chunk_size_for_budget(8192, 128256, 4096, 2, 2**30) == 2**30 // (128256 * 6 + 4096 * 4)
    assert chunk_size_for_budget(100, 32000, 512, 4, 2**40) == 100
    assert chunk_size_for_budget(100, 32000, 512, 4, 1) == 1
    assert default_chunk_size(8192, 32000, 2) == DEFAULT_CHUNK_TOKENS[2] == 256
    assert default_chunk_size(8192, 32000, 4) == DEFAULT_CHUNK_TOKENS[4] == 512  # fp32 wants larger blocks
    assert default_chunk_size(8192, 128256, 2) == 256  # 197 MB: under the byte cap
    assert default_chunk_size(8192, 128256, 4) == 512  # 263 MB: under fp32's 256 MiB cap
    assert default_chunk_size(8192, 262144, 2) == DEFAULT_CHUNK_LOGITS_BYTES[2] // (262144 * 6) == 128  # byte cap
    assert default_chunk_size(8192, 262144, 4) == DEFAULT_CHUNK_LOGITS_BYTES[4] // (262144 * 4) == 256
    assert default_chunk_size(8192, 128256, 8) == 512  # float64 takes fp32's rule
    assert default_chunk_size(8192, 1 << 20, 2) == 64  # never below MIN_CHUNK_TOKENS
    assert default_chunk_size(10, 32000, 4) == 10
    assert default_chunk_size(8192, 128256, 2, trainable_head=True) == 512  # amortise the V x H pass


def test_user_errors_are_one_line_config_errors():
    hidden, weight, labels = make_case()
    with pytest.raises(ConfigError) as err:
        linear_cross_entropy(hidden, weight[:, :5], labels)
    assert str(err.value) == ("hidden size 12 does not match the output weight (37, 5) (hint: pass the head's "
                              "weight of shape [vocab, hidden] and hidden states [..., hidden])")
    with pytest.raises(ConfigError) as err:
        linear_cross_entropy(hidden, weight, labels[:, :4])
    assert str(err.value) == ("labels of shape (2, 4) do not match hidden states (2, 23, 12) (hint: labels must "
                              "have the hidden states' leading dimensions (shift them before the call))")
    with pytest.raises(ConfigError) as err:
        linear_cross_entropy(hidden, weight, labels, reduction="avg")
    assert str(err.value) == "unknown reduction 'avg' (hint: use 'mean', 'sum' or 'none')"
