"""Preference losses on sequence log-probabilities: DPO (sigmoid), IPO, hinge, SimPO, ORPO.

Every loss compares a preferred answer ("chosen") with a dispreferred one ("rejected") for the
same prompt. Inputs are per-pair sequence log-probabilities, i.e. the sum over the answer's
tokens of log p(token | prefix), in nats. The formulas follow the papers, in the form TRL uses:

- ``sigmoid`` (DPO, Rafailov et al. 2023), with conservative label smoothing eps (cDPO):
  ``z = (pc - pr) - (rc - rr)``; ``loss = -(1 - eps) log s(beta z) - eps log s(-beta z)``.
- ``ipo`` (Azar et al. 2023): ``z`` as above on *per-token average* log-probs;
  ``loss = (z - 1 / (2 beta))^2``.
- ``hinge`` (SLiC, Zhao et al. 2023): ``loss = relu(1 - beta z)``.
- ``simpo`` (Meng et al. 2024): no reference; average log-probs;
  ``loss = -log s(beta (avg_c - avg_r) - beta * simpo_gamma)``, where ``simpo_gamma`` is the
  paper's gamma / beta ratio (the reward margin gamma is ``beta * simpo_gamma``).
- ``orpo`` (Hong et al. 2024): no reference; average log-probs;
  ``log_odds = (avg_c - avg_r) - (log(1 - exp(avg_c)) - log(1 - exp(avg_r)))``;
  ``loss = nll_c - orpo_alpha * log s(log_odds)`` with ``nll_c`` the chosen answer's mean
  per-token negative log-likelihood (``-avg_c`` unless ``chosen_nll`` is given).

Rewards (detached, reported as metrics): ``beta * (policy - reference)`` for the reference
losses, ``beta * average log-prob`` for SimPO and ORPO. Reward accuracy is
``chosen_reward > rejected_reward``.

where s is the logistic sigmoid, pc / pr the policy's chosen / rejected log-probs, rc / rr the
reference's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from maximus.errors import ConfigError

LossType = Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"]
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
LENGTH_NORMALISED = ("ipo", "simpo", "orpo")


def needs_reference(loss_type: str) -> bool:
    """Whether `loss_type` compares against a reference model (False for SimPO and ORPO)."""
    return loss_type not in REFERENCE_FREE


@dataclass(frozen=True)
class PreferenceLoss:
    """Which preference loss, and its settings (the config's ``dpo`` section; see the module doc).

    Fields:
        loss_type: ``sigmoid`` | ``ipo`` | ``hinge`` | ``simpo`` | ``orpo``.
        beta: inverse temperature (DPO's KL strength; SimPO's reward scale).
        label_smoothing: assumed probability that a pair's label is flipped (``sigmoid`` only).
        simpo_gamma: SimPO's target-margin ratio gamma / beta.
        orpo_alpha: ORPO's weight of the odds-ratio term (the paper's lambda).

    Checked when the loss is computed (`dpo_loss`), not here.
    """

    loss_type: LossType = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    orpo_alpha: float = 1.0


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None,
             loss: PreferenceLoss = PreferenceLoss(), reduction: str = "mean", *,
             chosen_lengths: torch.Tensor | None = None, rejected_lengths: torch.Tensor | None = None,
             chosen_nll: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Preference loss of a batch of pairs, and the implicit rewards.

    Args:
        policy_chosen_logps, policy_rejected_logps: ``[B]`` summed log-probs (nats) of each
            pair's chosen / rejected answer under the model being trained (differentiable).
        ref_chosen_logps, ref_rejected_logps: ``[B]`` the same under the reference model (no
            gradient needed); ignored (may be None) for ``simpo`` and ``orpo``.
        loss: which loss and its settings (`PreferenceLoss`; default: DPO's sigmoid, beta 0.1).
        reduction: ``mean`` | ``sum`` over pairs, or ``none`` for the ``[B]`` per-pair losses.
        chosen_lengths, rejected_lengths: ``[B]`` answer token counts. ``ipo``, ``simpo`` and
            ``orpo`` divide the summed log-probs by them; when None the log-probs given are
            taken to be per-token averages already.
        chosen_nll: ``[B]`` ORPO's supervised term; default ``-average chosen log-prob``.

    Returns:
        ``(loss, chosen_rewards, rejected_rewards)``: loss is a scalar (``mean``/``sum``) or
        ``[B]``; rewards are ``[B]``, detached. All float32 (float64 inputs stay float64).

    Raises:
        ConfigError: unknown ``loss_type`` / ``reduction``, missing reference log-probs for a
            loss that needs them, or ``label_smoothing`` outside [0, 0.5).
    """
    loss_type, beta, label_smoothing = loss.loss_type, loss.beta, loss.label_smoothing
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"unknown preference loss {loss_type!r}", hint=f"use one of {', '.join(LOSS_TYPES)}")
    if reduction not in ("mean", "sum", "none"):
        raise ConfigError(f"unknown reduction {reduction!r}", hint="use 'mean', 'sum' or 'none'")
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}",
                          hint="it is the assumed fraction of flipped labels, e.g. 0.1")
    dtype = torch.promote_types(policy_chosen_logps.dtype, torch.float32)
    pc, pr = policy_chosen_logps.to(dtype), policy_rejected_logps.to(dtype)
    if loss_type in LENGTH_NORMALISED:
        pc, pr = _per_token(pc, chosen_lengths), _per_token(pr, rejected_lengths)

    if loss_type in REFERENCE_FREE:
        chosen_rewards, rejected_rewards = beta * pc.detach(), beta * pr.detach()
        if loss_type == "simpo":
            losses = -F.logsigmoid(beta * (pc - pr) - beta * loss.simpo_gamma)
        else:  # orpo
            # log(1 - exp(x)) for x < 0, written stably as log(-expm1(x)).
            log_odds = (pc - pr) - (torch.log(-torch.expm1(pc)) - torch.log(-torch.expm1(pr)))
            nll = -pc if chosen_nll is None else chosen_nll.to(dtype)
            losses = nll - loss.orpo_alpha * F.logsigmoid(log_odds)
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ConfigError(f"preference loss {loss_type!r} needs reference log-probs",
                              hint="pass ref_chosen_logps and ref_rejected_logps, or use loss_type 'simpo' or 'orpo'")
        rc, rr = ref_chosen_logps.to(dtype).detach(), ref_rejected_logps.to(dtype).detach()
        if loss_type in LENGTH_NORMALISED:
            rc, rr = _per_token(rc, chosen_lengths), _per_token(rr, rejected_lengths)
        logits = (pc - pr) - (rc - rr)
        if loss_type == "sigmoid":
            losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                      - F.logsigmoid(-beta * logits) * label_smoothing)
        elif loss_type == "ipo":
            losses = (logits - 1 / (2 * beta)) ** 2
        else:  # hinge
            losses = torch.relu(1 - beta * logits)
        chosen_rewards, rejected_rewards = beta * (pc - rc).detach(), beta * (pr - rr).detach()

    if reduction == "mean":
        losses = losses.mean()
    elif reduction == "sum":
        losses = losses.sum()
    return losses, chosen_rewards, rejected_rewards


def _per_token(logps: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    if lengths is None:
        return logps
    return logps / lengths.to(logps.dtype).clamp(min=1)
