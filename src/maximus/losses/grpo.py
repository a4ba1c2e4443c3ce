"""GRPO policy losses on per-token log-probabilities: ``grpo``, ``dr_grpo`` and ``dapo``.

Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) samples a group of G
completions per prompt, scores them, and uses each completion's reward relative to its group as
the advantage of every one of its tokens. Per completion token t of completion i, with
``r = exp(logp - logp_old)`` the importance ratio against the policy that sampled the group:

    pg_it = -min(r_it * A_i, clip(r_it, 1 - epsilon_low, 1 + epsilon_high) * A_i)
    kl_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1          (the k3 estimator, >= 0)
    l_it  = pg_it + beta * kl_it * r_it      (kl_ratio_correction, the default)
    l_it  = pg_it + beta * kl_it             (kl_ratio_correction=False: the GRPO paper's form)

The completions were sampled from the old policy, not the current one; weighting k3 by the ratio
``r`` makes it an unbiased estimate of KL(policy || reference) and gives its unbiased gradient
(DeepSeek-V3.2, 2025; TRL's ``use_bias_correction_kl``, on by default). The ratio carries
gradient: even on-policy (``r = 1`` in value) the gradient gains ``kl * grad(logp)``.

The three published normalisations of ``sum_it m_it * l_it`` (m = completion-token mask):

- ``grpo`` (Shao et al.): mean over completions of each completion's token mean,
  ``1/N sum_i (sum_t m_it l_it) / |o_i|``;
- ``dr_grpo`` ("GRPO done right", Liu et al. 2025): a constant, ``sum_it m_it l_it / (N * L_max)``
  with ``L_max`` the maximum completion length, which removes the length bias of ``grpo``;
- ``dapo`` (Yu et al. 2025): token level, ``sum_it m_it l_it / sum_it m_it`` over the whole batch
  (DAPO also introduced the separate ``epsilon_high``: "clip-higher").

These are the definitions TRL's GRPOTrainer uses (``loss_type`` grpo / dr_grpo / dapo). Tokens
whose ratio is clipped get no policy gradient: ``r > 1 + epsilon_high`` with A > 0, or
``r < 1 - epsilon_low`` with A < 0.

Advantages (:func:`group_advantages`, TRL's ``scale_rewards``): ``A_i = R_i - mean(group of i)``,
divided by ``std + 1e-4`` where std is the unbiased standard deviation of the group (``group``),
of the whole batch (``batch``), or not divided (``none``). A completion with no reward (NaN: every
reward function skipped it) is left out of its group's statistics and gets A = 0.

For gradient accumulation the loss comes as a sum and a unit count (:func:`grpo_loss_sum`): the
step's loss is ``sum(loss_sum) / sum(units)`` over its micro-batches, with units = completions
for ``grpo`` and ``dr_grpo`` and completion tokens for ``dapo``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from maximus.errors import ConfigError

LossType = Literal["grpo", "dr_grpo", "dapo"]
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")

#: Added to the standard deviation before dividing (TRL's constant), so a group of equal rewards
#: gives advantages of 0, not NaN.
STD_EPSILON = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group") -> torch.Tensor:
    """Advantages ``[N]`` of rewards ``[N]`` laid out group by group (``N = prompts x group_size``).

    NaN rewards (unscored completions) are ignored by the statistics and get advantage 0.

    Raises:
        ConfigError: unknown ``scale_rewards``, or N not a multiple of ``group_size``.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ConfigError(f"unknown scale_rewards {scale_rewards!r}", f"use one of {', '.join(SCALE_REWARDS)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ConfigError(f"{rewards.numel()} rewards do not split into groups of {group_size}",
                          "pass group_size completions per prompt")
    grouped = rewards.reshape(-1, group_size)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    advantages = grouped - mean
    if scale_rewards == "group":
        advantages = advantages / (_nanstd(grouped, dim=1) + STD_EPSILON)
    elif scale_rewards == "batch":
        advantages = advantages / (_nanstd(rewards.reshape(1, -1), dim=1) + STD_EPSILON)
    return torch.nan_to_num(advantages.reshape(-1), nan=0.0)


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaN, kept as a column; 0 where fewer than 2 values."""
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    squares = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True)
    return torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(mean))


@dataclass
class GrpoLossParts:
    """One micro-batch's share of the step's GRPO loss, and the sums behind its metrics.

    ``loss_sum / units`` is the loss of this micro-batch alone; summed over micro-batches first,
    it is the loss of the whole step. The metric sums are over completion tokens (divide by
    ``tokens``): ``kl_sum`` (as in the loss, ratio-weighted or not; 0 without a reference), ``clipped_low_sum`` /
    ``clipped_high_sum`` (tokens whose ratio was clipped from below with A < 0 / from above with
    A > 0)."""

    loss_sum: torch.Tensor
    units: torch.Tensor
    tokens: torch.Tensor
    kl_sum: torch.Tensor
    clipped_low_sum: torch.Tensor
    clipped_high_sum: torch.Tensor


def grpo_loss_sum(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *,
                  old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                  beta: float = 0.0, epsilon: float = 0.2, epsilon_high: float | None = None,
                  loss_type: LossType = "grpo", max_completion_tokens: int | None = None,
                  kl_ratio_correction: bool = True, row_lengths: torch.Tensor | None = None) -> GrpoLossParts:
    """The GRPO loss of a micro-batch of completions, as a sum and a unit count (module doc).

    Args:
        logps: ``[B, T]`` log-probs of the completion tokens under the policy (differentiable),
            in nats; positions outside ``mask`` are ignored.
        mask: ``[B, T]`` 1 (or True) on completion tokens, 0 on prompt and padding.
        advantages: ``[B]`` one advantage per completion.
        old_logps: ``[B, T]`` log-probs under the policy that sampled the completions; None means
            "this policy" (ratio 1, its gradient still flows: the on-policy case).
        ref_logps: ``[B, T]`` log-probs under the reference; required when ``beta > 0``.
        beta: weight of the KL penalty to the reference.
        epsilon, epsilon_high: clipping range ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` defaults to ``epsilon``).
        loss_type: ``grpo`` | ``dr_grpo`` | ``dapo``.
        max_completion_tokens: ``L_max`` of ``dr_grpo`` (required for it).
        kl_ratio_correction: weight the KL term by the importance ratio (module doc).
        row_lengths: ``[B]`` each whole completion's token count, the ``grpo`` divisor, when
            ``logps`` hold only a share of each completion's tokens (context parallelism: the
            shares' sums add up to the whole loss); default the mask's count per row.

    Raises:
        ConfigError: unknown ``loss_type``, ``beta > 0`` without ``ref_logps``, ``dr_grpo``
            without ``max_completion_tokens``, or a non-positive clipping range.
    """
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"unknown GRPO loss_type {loss_type!r}", f"use one of {', '.join(LOSS_TYPES)}")
    if beta > 0 and ref_logps is None:
        raise ConfigError(f"the GRPO KL penalty beta={beta} needs reference log-probs",
                          "pass ref_logps, or set beta: 0 (no reference pass)")
    if loss_type == "dr_grpo" and not max_completion_tokens:
        raise ConfigError("loss_type dr_grpo needs max_completion_tokens", "pass the generation's maximum completion length")
    high = epsilon if epsilon_high is None else epsilon_high
    if epsilon <= 0 or high <= 0:
        raise ConfigError(f"GRPO clipping range must be positive, got epsilon={epsilon}, epsilon_high={high}",
                          "use e.g. epsilon: 0.2, epsilon_high: 0.28")
    dtype = torch.promote_types(logps.dtype, torch.float32)
    logps = logps.to(dtype)
    mask = mask.to(dtype)
    adv = advantages.to(dtype).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps.to(dtype).detach()
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        delta = ref_logps.to(dtype).detach() - logps
        kl = torch.exp(delta) - delta - 1
        if kl_ratio_correction:
            kl = kl * ratio
        if beta > 0:
            per_token = per_token + beta * kl
    masked = per_token * mask
    lengths = mask.sum(dim=1)
    if loss_type == "grpo":
        divisor = lengths if row_lengths is None else row_lengths.to(dtype)
        loss_sum, units = (masked.sum(dim=1) / divisor.clamp(min=1)).sum(), torch.tensor(float(mask.shape[0]))
    elif loss_type == "dr_grpo":
        loss_sum, units = masked.sum() / float(max_completion_tokens), torch.tensor(float(mask.shape[0]))
    else:
        loss_sum, units = masked.sum(), lengths.sum().detach()
    with torch.no_grad():
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(dtype) * mask
        high_hit = ((ratio > 1 + high) & (adv > 0)).to(dtype) * mask
        parts = dict(tokens=lengths.sum(), kl_sum=(kl.detach() * mask).sum(),
                     clipped_low_sum=low.sum(), clipped_high_sum=high_hit.sum())
    return GrpoLossParts(loss_sum=loss_sum, units=units.to(dtype), **parts)


def grpo_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, **kwargs) -> torch.Tensor:
    """The GRPO loss of one batch of completions (a scalar): `grpo_loss_sum`'s sum / units."""
    parts = grpo_loss_sum(logps, mask, advantages, **kwargs)
    return parts.loss_sum / parts.units.clamp(min=1)
