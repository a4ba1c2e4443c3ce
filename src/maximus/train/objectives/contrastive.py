"""The contrastive embedding objective (`objective: contrastive`): train a causal LM as a text
embedding model on (query, positive) pairs, with nested Matryoshka prefixes when
`optimization.matryoshka` is set.

One micro-batch of N pairs is one forward of 2N rows (queries then positives, padded to one
length by `maximus.data.collate`); each row is pooled (`contrastive.pooling`: `mean` or `last`)
by `maximus.embed.pool`, the code `maximus.embed` uses at inference, so training and use see the
same vectors. The loss is `maximus.losses.matryoshka.matryoshka_info_nce`: InfoNCE with in-batch
negatives at temperature `contrastive.temperature` on the full vector, plus `weight` times the
mean of the same loss on each prefix `[:, :d]` (normalised after truncation, as
`embed(dim=d)` does) for `d` in `optimization.matryoshka.dims`.

In-batch negatives are the other positives *of the same micro-batch* (and of the same rank under
DDP): gradient accumulation sums per-micro-batch losses, so it gives the gradient of several small
contrastive batches, not of one big one. The number of negatives per query is
`training.micro_batch_size - 1`; raise the micro-batch (not the accumulation) for harder training.
A duplicate positive inside a micro-batch counts as a negative (deduplicate the data).

Protocol (see `maximus.train.objectives.base.SFTObjective`): `count` = pairs, `tokens` = real tokens
of both sides, `loss_sum` = summed per-pair loss with the metric sum `accuracy` (queries whose own
positive scores highest in the micro-batch; the trainer divides by the pair count), `evaluate` =
held-out loss (in micro-batches, like training) and recall@1 / recall@10 of every held-out query
against all held-out positives, at the full width and at each evaluated prefix size.

Raises ConfigError: `optimization.use_ghost_logit` (there is no vocabulary loss to approximate).
"""
from __future__ import annotations

import torch

from maximus.memory.plan import Plan
from maximus.train.views import LivePlan, RunView

from maximus.losses.matryoshka import active_dims, matryoshka_info_nce, normalized_prefix
from maximus.forward import hidden_states
from maximus.train.objectives.base import Objective
from maximus.structure import row_lengths

SIDES = ("query", "positive")
RECALL_AT = (1, 10)

#: Prefix size evaluated when no Matryoshka dims are configured (the issue's 64-d goal).
DEFAULT_EVAL_DIM = 64


def pooled_pairs(model, batch: dict, pooling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(query vectors [N, H], positive vectors [N, H]): pooled, unnormalised, float32."""
    from maximus.embed import pool

    n = batch["query_input_ids"].shape[0]
    input_ids = torch.cat([batch[f"{side}_input_ids"] for side in SIDES])
    position_ids = torch.cat([batch[f"{side}_position_ids"] for side in SIDES])
    # No attention mask: padding is its own "document" after the text (see maximus.data.collate),
    # and with causal attention no real token sees it; pooling skips it by length.
    hidden = hidden_states(model, input_ids, position_ids)
    vectors = pool(hidden, row_lengths(position_ids), pooling)
    return vectors[:n], vectors[n:]


def recall_at_k(query: torch.Tensor, index: torch.Tensor, k: int) -> float:
    """Fraction of queries whose own row of ``index`` (same row number) is among the top ``k`` by
    inner product (cosine for normalised vectors)."""
    from maximus.embed import exact_search

    _, top = exact_search(query, index, k=k)
    truth = torch.arange(query.shape[0], device=top.device)[:, None]
    return float((top == truth).any(dim=1).float().mean())


class ContrastiveObjective(Objective):
    """InfoNCE (+ Matryoshka prefixes) on pooled hidden states; normalised by the pair count."""

    name = "contrastive"

    def __init__(self, cfg, plan: Plan | LivePlan, pad_token_id: int):
        super().__init__(cfg, plan, pad_token_id)
        opt = cfg.optimization
        self.refuse_ghost_logit("the contrastive loss has no vocabulary softmax")
        self.temperature = cfg.contrastive.temperature
        self.pooling = cfg.contrastive.pooling
        m = opt.matryoshka
        self.dims = list(m.dims) if m is not None else []
        self.weight = m.weight_for("contrastive") if m is not None else 0.0  # null weight = 1.0
        active_dims(self.dims, 1 << 30)  # a bad size fails at setup, not at the first step

    # ------------------------------------------------------------------------------ protocol
    def count(self, batch: dict) -> int:
        return int(batch["query_input_ids"].shape[0])

    def tokens(self, batch: dict) -> int:
        return int(sum(row_lengths(batch[f"{side}_position_ids"]).sum() for side in SIDES))

    def prepare(self, run: RunView) -> None:
        pass

    def loss_sum(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        query, positive = pooled_pairs(model, batch, self.pooling)
        loss = matryoshka_info_nce(query, positive, self.dims, self.weight, self.temperature, reduction="sum")
        with torch.no_grad():
            scores = normalized_prefix(query) @ normalized_prefix(positive).T
            correct = (scores.argmax(dim=1) == torch.arange(scores.shape[0], device=scores.device)).sum()
        return loss, {"accuracy": correct.double()}

    def eval_dims(self, hidden_size: int) -> list[int]:
        """Prefix sizes reported by `evaluate`: the active Matryoshka dims, else 64 when narrower
        than the model."""
        used = active_dims(self.dims, hidden_size)
        return used or ([DEFAULT_EVAL_DIM] if DEFAULT_EVAL_DIM < hidden_size else [])

    @torch.no_grad()
    def evaluate(self, run: RunView) -> dict:
        """Held-out pairs: `loss` (mean per pair, in micro-batches as in training), `accuracy`
        (in-batch top-1), and `recall@k` / `recall@k/{d}d` over the whole held-out set (each
        query against every held-out positive) at the full width and at each prefix size."""
        from maximus.data import collate
        from maximus.forward import autocast_for

        model, rows = run.model, run.data.eval
        size = self.plan.micro_batch_size
        max_batches = self.cfg.eval.max_batches
        loss, correct, queries, positives = 0.0, 0.0, [], []
        was_training = model.training
        model.eval()
        try:
            for i, start in enumerate(range(0, len(rows), size)):
                if max_batches is not None and i >= max_batches:
                    break
                batch = {k: v.to(run.device) for k, v in collate(rows[start:start + size], self.pad_token_id).items()}
                with autocast_for(run.device, run.dtype):
                    q, p = pooled_pairs(model, batch, self.pooling)
                loss += float(matryoshka_info_nce(q, p, self.dims, self.weight, self.temperature).double())
                correct += float((normalized_prefix(q) @ normalized_prefix(p).T).argmax(dim=1).eq(
                    torch.arange(q.shape[0], device=q.device)).sum())
                queries.append(q.float().cpu())
                positives.append(p.float().cpu())
        finally:
            model.train(was_training)
        pairs = sum(q.shape[0] for q in queries)
        result = {"loss": loss / max(pairs, 1), "accuracy": correct / max(pairs, 1), "pairs": pairs}
        if not pairs:
            return result
        query, positive = torch.cat(queries), torch.cat(positives)
        for dim in [None, *self.eval_dims(query.shape[1])]:
            q, p = normalized_prefix(query, dim), normalized_prefix(positive, dim)
            for k in RECALL_AT:
                result[f"recall@{k}" + (f"/{dim}d" if dim else "")] = recall_at_k(q, p, k)
        return result
