"""Output-layer losses that never hold the tokens x vocabulary logits.

* :func:`linear_cross_entropy`: exact cross-entropy of ``hidden @ weight.T``, chunked (default).
* :func:`token_log_probs`: per-token ``log p(label)`` for sequence log-probabilities (DPO).
* :func:`naive_cross_entropy`: full-logits reference (``optimization.loss: naive``).
* :func:`ghost_logit_loss`: sampled softmax over hard candidates plus a "ghost" tail logit
  (``optimization.use_ghost_logit: true``); training only, evaluation stays exact.
* :func:`matryoshka_loss_sum`: nested-prefix auxiliary loss (``optimization.matryoshka``);
  :func:`cross_entropy_with_matryoshka`: main loss + auxiliary loss in one shared chunked pass
  (what training uses); :func:`matryoshka_info_nce`: the nested contrastive loss (``objective: contrastive``).
* :func:`dpo_loss`: DPO / IPO / hinge / SimPO / ORPO on sequence log-probs (``objective: dpo``), its
  settings in :class:`PreferenceLoss`.
* :func:`grpo_loss_sum` / :func:`grpo_loss` / :func:`group_advantages`: GRPO, Dr. GRPO and DAPO on
  per-token log-probs (``objective: grpo``).
"""
from maximus.losses.ghost_logit import ghost_logit_loss
from maximus.losses.matryoshka import cross_entropy_with_matryoshka, matryoshka_info_nce, matryoshka_loss_sum
from maximus.losses.preference import PreferenceLoss, dpo_loss
from maximus.losses.grpo import group_advantages, grpo_loss, grpo_loss_sum
from maximus.losses.linear_cross_entropy import (
    chunk_size_for_budget,
    linear_cross_entropy,
    naive_cross_entropy,
    token_log_probs,
)

__all__ = [
    "chunk_size_for_budget",
    "cross_entropy_with_matryoshka",
    "matryoshka_info_nce",
    "dpo_loss",
    "PreferenceLoss",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_sum",
    "matryoshka_loss_sum",
    "ghost_logit_loss",
    "linear_cross_entropy",
    "naive_cross_entropy",
    "token_log_probs",
]
