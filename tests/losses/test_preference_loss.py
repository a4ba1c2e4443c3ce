"""dpo_loss against the published formulas, written here independently with `math` in float64."""
import math

import pytest
import torch

from maximus.errors import ConfigError
from maximus.losses.preference import PreferenceLoss, dpo_loss, needs_reference

# Three pairs: summed log-probs (nats) of the answers, and their token counts.
PC = [-12.0, -30.5, -7.25]
PR = [-15.0, -28.0, -9.5]
RC = [-13.0, -29.0, -8.0]
RR = [-14.0, -29.5, -8.5]
LC = [4, 10, 3]
LR = [5, 8, 3]


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def expected(loss_type, beta, eps=0.0, gamma=0.5, alpha=1.0):
    """Per-pair losses and rewards straight from the papers."""
    out, rew_c, rew_r = [], [], []
    for pc, pr, rc, rr, lc, lr in zip(PC, PR, RC, RR, LC, LR):
        if loss_type == "sigmoid":  # Rafailov et al., eq. 7; cDPO smoothing (Mitchell 2023)
            z = (pc - rc) - (pr - rr)
            out.append(-(1 - eps) * log_sigmoid(beta * z) - eps * log_sigmoid(-beta * z))
            rew_c.append(beta * (pc - rc)); rew_r.append(beta * (pr - rr))
        elif loss_type == "hinge":  # SLiC-HF: max(0, 1 - beta * z)
            z = (pc - rc) - (pr - rr)
            out.append(max(0.0, 1 - beta * z))
            rew_c.append(beta * (pc - rc)); rew_r.append(beta * (pr - rr))
        elif loss_type == "ipo":  # Azar et al., eq. 17, on length-averaged log-probs
            h = (pc / lc - rc / lc) - (pr / lr - rr / lr)
            out.append((h - 1 / (2 * beta)) ** 2)
            rew_c.append(beta * (pc - rc) / lc); rew_r.append(beta * (pr - rr) / lr)
        elif loss_type == "simpo":  # Meng et al., eq. 6, gamma = beta * (gamma/beta ratio)
            m = beta / lc * pc - beta / lr * pr - beta * gamma
            out.append(-log_sigmoid(m))
            rew_c.append(beta * pc / lc); rew_r.append(beta * pr / lr)
        elif loss_type == "orpo":  # Hong et al., eqs. 4-7
            ac, ar = pc / lc, pr / lr
            odds_c = math.exp(ac) / (1 - math.exp(ac))
            odds_r = math.exp(ar) / (1 - math.exp(ar))
            out.append(-ac - alpha * log_sigmoid(math.log(odds_c / odds_r)))
            rew_c.append(beta * ac); rew_r.append(beta * ar)
    return out, rew_c, rew_r


def call(loss_type, beta, reduction="none", **kw):
    chosen_nll = kw.pop("chosen_nll", None)
    return dpo_loss(t(PC), t(PR), t(RC), t(RR), PreferenceLoss(loss_type=loss_type, beta=beta, **kw), reduction,
                    chosen_lengths=torch.tensor(LC), rejected_lengths=torch.tensor(LR), chosen_nll=chosen_nll)


@pytest.mark.parametrize("loss_type,beta,kw,ref_kw", [
    ("sigmoid", 0.1, {}, {}),
    ("sigmoid", 0.5, {"label_smoothing": 0.2}, {"eps": 0.2}),
    ("hinge", 0.1, {}, {}),
    ("hinge", 2.0, {}, {}),
    ("ipo", 0.1, {}, {}),
    ("ipo", 1.0, {}, {}),
    ("simpo", 2.0, {"simpo_gamma": 0.5}, {"gamma": 0.5}),
    ("simpo", 2.5, {"simpo_gamma": 0.3}, {"gamma": 0.3}),
    ("orpo", 0.1, {}, {}),
    ("orpo", 0.1, {"orpo_alpha": 0.25}, {"alpha": 0.25}),
])
def test_every_loss_matches_its_published_formula(loss_type, beta, kw, ref_kw):
    losses, rc, rr = call(loss_type, beta, **kw)
    want, want_c, want_r = expected(loss_type, beta, **ref_kw)
    assert losses.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert rc.tolist() == pytest.approx(want_c, rel=1e-12, abs=1e-12)
    assert rr.tolist() == pytest.approx(want_r, rel=1e-12, abs=1e-12)
    assert float(call(loss_type, beta, "mean", **kw)[0]) == pytest.approx(sum(want) / 3, rel=1e-12)
    assert float(call(loss_type, beta, "sum", **kw)[0]) == pytest.approx(sum(want), rel=1e-12)


def test_fixed_values_by_hand():
    # One pair with margin z = 2, beta = 0.5: -log sigmoid(1) = log(1 + e^-1) = 0.31326168751822286
    one = torch.tensor([0.0], dtype=torch.float64)
    loss, c, r = dpo_loss(one + 1, one - 1, one, one, PreferenceLoss(beta=0.5))
    assert float(loss) == pytest.approx(0.31326168751822286, rel=1e-15)
    assert (float(c), float(r)) == (0.5, -0.5)
    # Policy equal to reference: log 2 for sigmoid, exactly 1 for hinge, 1/(4 beta^2) for IPO.
    z = torch.zeros(2, dtype=torch.float64)
    assert float(dpo_loss(z, z, z, z)[0]) == pytest.approx(math.log(2), rel=1e-15)
    assert float(dpo_loss(z, z, z, z, PreferenceLoss(loss_type="hinge"))[0]) == 1.0
    assert float(dpo_loss(z, z, z, z, PreferenceLoss(loss_type="ipo", beta=0.1))[0]) == pytest.approx(25.0, rel=1e-15)


def test_lengths_none_means_logps_are_already_averages():
    avg_c, avg_r = t([a / n for a, n in zip(PC, LC)]), t([a / n for a, n in zip(PR, LR)])
    got = dpo_loss(avg_c, avg_r, None, None, PreferenceLoss(loss_type="simpo", beta=2.0), reduction="none")[0]
    assert got.tolist() == pytest.approx(expected("simpo", 2.0)[0], rel=1e-12)


def test_orpo_uses_a_given_chosen_nll():
    nll = t([1.0, 2.0, 3.0])
    got = call("orpo", 0.1, chosen_nll=nll)[0]
    base = call("orpo", 0.1)[0]
    want = [b + n - (-pc / lc) for b, n, pc, lc in zip(base.tolist(), nll.tolist(), PC, LC)]
    assert got.tolist() == pytest.approx(want, rel=1e-12)


def test_gradient_of_sigmoid_dpo_matches_the_closed_form():
    # d loss / d pc = -beta * sigmoid(-beta z) (the DPO gradient weight), reference gets none.
    pc = t(PC).requires_grad_()
    rc = t(RC).requires_grad_()
    loss, _, _ = dpo_loss(pc, t(PR), rc, t(RR), PreferenceLoss(beta=0.1), reduction="sum")
    loss.backward()
    z = [(a - c) - (b - d) for a, b, c, d in zip(PC, PR, RC, RR)]
    assert pc.grad.tolist() == pytest.approx([-0.1 / (1 + math.exp(0.1 * zi)) for zi in z], rel=1e-12)
    assert rc.grad is None


def test_float32_inputs_give_float32_outputs():
    loss, c, r = dpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2))
    assert loss.dtype == c.dtype == r.dtype == torch.float32


def test_errors_are_one_line_with_a_hint():
    z = torch.zeros(1)
    with pytest.raises(ConfigError) as e:
        dpo_loss(z, z, z, z, PreferenceLoss(loss_type="kto"))
    assert str(e.value) == "unknown preference loss 'kto' (hint: use one of sigmoid, ipo, hinge, simpo, orpo)"
    with pytest.raises(ConfigError) as e:
        dpo_loss(z, z, None, None, PreferenceLoss(loss_type="sigmoid"))
    assert str(e.value) == ("preference loss 'sigmoid' needs reference log-probs (hint: pass ref_chosen_logps and "
                            "ref_rejected_logps, or use loss_type 'simpo' or 'orpo')")
    with pytest.raises(ConfigError) as e:
        dpo_loss(z, z, z, z, reduction="avg")
    assert str(e.value) == "unknown reduction 'avg' (hint: use 'mean', 'sum' or 'none')"
    with pytest.raises(ConfigError) as e:
        dpo_loss(z, z, z, z, PreferenceLoss(label_smoothing=0.5))
    assert str(e.value) == ("label_smoothing must be in [0, 0.5), got 0.5 "
                            "(hint: it is the assumed fraction of flipped labels, e.g. 0.1)")
    assert [needs_reference(k) for k in ("sigmoid", "ipo", "hinge", "simpo", "orpo")] == [True, True, True, False, False]
