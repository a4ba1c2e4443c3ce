"""GRPO losses against the published objectives, written out token by token in float64.

Shao et al. 2024 (GRPO): J = 1/G sum_i 1/|o_i| sum_t [min(r A, clip(r, 1-e, 1+e) A) - beta KL];
Liu et al. 2025 (Dr. GRPO): the same sum over tokens divided by G * L_max;
Yu et al. 2025 (DAPO): divided by the total token count, with a separate upper clip e_high.
KL is the k3 estimator exp(ref - logp) - (ref - logp) - 1. The loss is -J.
"""
import math

import pytest
import torch

from maximus.errors import ConfigError
from maximus.losses.grpo import group_advantages, grpo_loss, grpo_loss_sum

EPS, EPS_HIGH, BETA, L_MAX = 0.2, 0.28, 0.04, 6

# 4 completions, up to 6 tokens; lengths 6, 3, 5, 1 (the rest is padding).
LENGTHS = [6, 3, 5, 1]
MASK = torch.tensor([[1.0 if t < n else 0.0 for t in range(L_MAX)] for n in LENGTHS], dtype=torch.float64)
ADV = torch.tensor([1.5, -0.7, 0.9, -1.2], dtype=torch.float64)


def fixed_logps():
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(4, L_MAX, generator=g, dtype=torch.float64) * 3 - 0.1
    ref = old + torch.randn(4, L_MAX, generator=g, dtype=torch.float64) * 0.2
    # log-ratios chosen so both clip edges are crossed: +0.4 (r=1.49 > 1.28) and -0.5 (r=0.61 < 0.8)
    shift = torch.tensor([[0.4, 0.05, -0.5, 0.1, 0.3, -0.02],
                          [-0.5, 0.4, 0.01, 9.0, 9.0, 9.0],
                          [0.2, -0.3, 0.4, 0.27, -0.19, 9.0],
                          [-0.6, 9.0, 9.0, 9.0, 9.0, 9.0]], dtype=torch.float64)  # 9.0: padding, ignored
    return old + shift, old, ref


def published_token_terms(logps, old, ref, beta, eps_low, eps_high, corrected=False):
    """[(i, t, -(min(rA, clip(r)A) - beta KL))] for every completion token, one at a time; with
    `corrected`, KL is weighted by r (DeepSeek-V3.2's unbiased estimate)."""
    terms = []
    for i, n in enumerate(LENGTHS):
        a = float(ADV[i])
        for t in range(n):
            r = math.exp(float(logps[i, t]) - float(old[i, t]))
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            d = float(ref[i, t]) - float(logps[i, t])
            kl = (math.exp(d) - d - 1) * (r if corrected else 1.0)
            terms.append((i, t, -(min(r * a, clipped * a) - beta * kl)))
    return terms


def published_loss(loss_type, logps, old, ref, beta, eps_low, eps_high, corrected=False):
    terms = published_token_terms(logps, old, ref, beta, eps_low, eps_high, corrected)
    if loss_type == "grpo":
        return sum(sum(v for j, _, v in terms if j == i) / n for i, n in enumerate(LENGTHS)) / len(LENGTHS)
    if loss_type == "dr_grpo":
        return sum(v for _, _, v in terms) / (len(LENGTHS) * L_MAX)
    return sum(v for _, _, v in terms) / sum(LENGTHS)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta,corrected", [(0.0, False), (BETA, False), (BETA, True)])
def test_each_loss_type_equals_the_published_objective(loss_type, beta, corrected):
    logps, old, ref = fixed_logps()
    got = grpo_loss(logps, MASK, ADV, old_logps=old, ref_logps=ref if beta else None, beta=beta, epsilon=EPS,
                    epsilon_high=EPS_HIGH, loss_type=loss_type, max_completion_tokens=L_MAX,
                    kl_ratio_correction=corrected)
    want = published_loss(loss_type, logps, old, ref, beta, EPS, EPS_HIGH, corrected)
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(want, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_gradient_equals_the_published_objective_and_clipped_tokens_get_none(loss_type):
    logps, old, ref = fixed_logps()
    x = logps.clone().requires_grad_(True)
    grpo_loss(x, MASK, ADV, old_logps=old, ref_logps=ref, beta=BETA, epsilon=EPS, epsilon_high=EPS_HIGH,
              loss_type=loss_type, max_completion_tokens=L_MAX, kl_ratio_correction=False).backward()
    # Central differences of the published formula, token by token.
    h = 1e-6
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            up, down = logps.clone(), logps.clone()
            up[i, t] += h
            down[i, t] -= h
            numeric = (published_loss(loss_type, up, old, ref, BETA, EPS, EPS_HIGH)
                       - published_loss(loss_type, down, old, ref, BETA, EPS, EPS_HIGH)) / (2 * h)
            assert float(x.grad[i, t]) == pytest.approx(numeric, rel=1e-6, abs=1e-9)
    assert torch.all(x.grad[MASK == 0] == 0)
    # Clipped tokens keep only the KL gradient: beta * d(kl)/d(logp) = beta * (1 - exp(ref - logp)).
    ratio = torch.exp(logps - old)
    a = ADV.unsqueeze(1).expand_as(ratio)
    clipped = (((ratio > 1 + EPS_HIGH) & (a > 0)) | ((ratio < 1 - EPS) & (a < 0))) & (MASK > 0)
    assert clipped.nonzero().tolist() == [[0, 0], [0, 4], [1, 0], [2, 2], [2, 3], [3, 0]]  # high: A > 0; low: A < 0
    scale = {"grpo": None, "dr_grpo": len(LENGTHS) * L_MAX, "dapo": sum(LENGTHS)}[loss_type]
    for i, t in clipped.nonzero().tolist():
        denominator = scale or len(LENGTHS) * LENGTHS[i]
        kl_grad = BETA * (1 - math.exp(float(ref[i, t] - logps[i, t]))) / denominator
        assert float(x.grad[i, t]) == pytest.approx(kl_grad, rel=1e-9)


def test_metric_sums_count_clipped_tokens_on_each_side_and_the_kl():
    logps, old, ref = fixed_logps()
    parts = grpo_loss_sum(logps, MASK, ADV, old_logps=old, ref_logps=ref, beta=BETA, epsilon=EPS,
                          epsilon_high=EPS_HIGH, loss_type="dapo", kl_ratio_correction=False)
    ratio = torch.exp(logps - old)
    high = [(i, t) for i, n in enumerate(LENGTHS) for t in range(n) if ratio[i, t] > 1 + EPS_HIGH and ADV[i] > 0]
    low = [(i, t) for i, n in enumerate(LENGTHS) for t in range(n) if ratio[i, t] < 1 - EPS and ADV[i] < 0]
    assert (float(parts.clipped_high_sum), float(parts.clipped_low_sum)) == (len(high), len(low))
    assert len(high) > 0 and len(low) > 0
    kl = sum(math.exp(float(ref[i, t] - logps[i, t])) - float(ref[i, t] - logps[i, t]) - 1
             for i, n in enumerate(LENGTHS) for t in range(n))
    assert float(parts.kl_sum) == pytest.approx(kl, rel=1e-12)
    assert float(parts.tokens) == sum(LENGTHS) == float(parts.units)


def test_micro_batch_sums_add_up_to_the_whole_batch_loss():
    logps, old, ref = fixed_logps()
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        kwargs = dict(old_logps=None, beta=BETA, epsilon=EPS, epsilon_high=EPS_HIGH, loss_type=loss_type,
                      max_completion_tokens=L_MAX)
        whole = grpo_loss(logps, MASK, ADV, ref_logps=ref, **kwargs)
        halves = [grpo_loss_sum(logps[s], MASK[s], ADV[s], ref_logps=ref[s], **kwargs) for s in (slice(0, 1), slice(1, 4))]
        combined = sum(p.loss_sum for p in halves) / sum(p.units for p in halves)
        assert float(combined) == pytest.approx(float(whole), rel=1e-12)


def test_on_policy_ratio_is_one_and_the_gradient_is_minus_the_advantage_per_token():
    logps, _, _ = fixed_logps()
    x = logps.clone().requires_grad_(True)
    loss = grpo_loss(x, MASK, ADV, loss_type="grpo")
    assert float(loss) == pytest.approx(-float((ADV * 1.0).mean()), rel=1e-12)
    loss.backward()
    want = -(ADV.unsqueeze(1) * MASK) / (torch.tensor(LENGTHS, dtype=torch.float64).unsqueeze(1) * len(LENGTHS))
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=0)


def test_group_advantages_follow_the_published_normalisation():
    rewards = torch.tensor([1.0, 0.0, 0.5, float("nan"), 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    g1 = [1.0, 0.0, 0.5]  # the NaN is left out of its group
    m1 = sum(g1) / 3
    s1 = math.sqrt(sum((r - m1) ** 2 for r in g1) / 2)
    want_group = [(r - m1) / (s1 + 1e-4) for r in g1] + [0.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(group_advantages(rewards, 4, "group"), torch.tensor(want_group, dtype=torch.float64))
    valid = [1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 2.0]
    mb = sum(valid) / 7
    sb = math.sqrt(sum((r - mb) ** 2 for r in valid) / 6)
    want_batch = [(r - m1) / (sb + 1e-4) for r in g1] + [0.0] * 5
    torch.testing.assert_close(group_advantages(rewards, 4, "batch"), torch.tensor(want_batch, dtype=torch.float64))
    want_none = [r - m1 for r in g1] + [0.0] * 5
    torch.testing.assert_close(group_advantages(rewards, 4, "none"), torch.tensor(want_none, dtype=torch.float64))


def test_bad_arguments_are_one_line_errors():
    logps, old, ref = fixed_logps()
    with pytest.raises(ConfigError, match=r"^unknown GRPO loss_type 'ppo' \(hint: use one of grpo, dr_grpo, dapo\)$"):
        grpo_loss(logps, MASK, ADV, loss_type="ppo")
    with pytest.raises(ConfigError, match=r"^the GRPO KL penalty beta=0.1 needs reference log-probs"):
        grpo_loss(logps, MASK, ADV, beta=0.1)
    with pytest.raises(ConfigError, match=r"^loss_type dr_grpo needs max_completion_tokens"):
        grpo_loss(logps, MASK, ADV, loss_type="dr_grpo")
    with pytest.raises(ConfigError, match=r"^7 rewards do not split into groups of 4"):
        group_advantages(torch.zeros(7), 4)
    with pytest.raises(ConfigError, match=r"^unknown scale_rewards 'max'"):
        group_advantages(torch.zeros(8), 4, "max")


def test_ratio_corrected_kl_gradient_equals_its_formula():
    logps, old, ref = fixed_logps()
    x = logps.clone().requires_grad_(True)
    grpo_loss(x, MASK, ADV, old_logps=old, ref_logps=ref, beta=BETA, epsilon=EPS, epsilon_high=EPS_HIGH,
              loss_type="dapo", kl_ratio_correction=True).backward()
    h = 1e-6
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            up, down = logps.clone(), logps.clone()
            up[i, t] += h
            down[i, t] -= h
            numeric = (published_loss("dapo", up, old, ref, BETA, EPS, EPS_HIGH, True)
                       - published_loss("dapo", down, old, ref, BETA, EPS, EPS_HIGH, True)) / (2 * h)
            assert float(x.grad[i, t]) == pytest.approx(numeric, rel=1e-6, abs=1e-9)
