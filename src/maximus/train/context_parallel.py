"""Context parallelism in training (`training.context_parallel: N`): each row's tokens are split
over N ranks of the torchrun world, and attention still sees the whole causal row.

- `join` checks N against the world size and lays the world out as a 2-D device mesh, shard x
  context: the groups of N consecutive ranks along ``context`` share rows, the other factor
  (``shard``) splits the batch (`DistEnv.shard`). DDP averages gradients over the whole world,
  and FSDP2 shards parameters, gradients and optimizer state over it too (both mesh dimensions
  flattened, which is the world in rank order), so each rank holds 1/world of them;
- `install` switches the model's attention to ``"maximus_context_parallel"``: Ulysses
  (`maximus.attention.ulysses`) when the query heads divide by N, else ring attention
  (`maximus.attention.ring`, with a notice). Outside a training micro-batch (evaluation,
  generation: whole rows on every rank) it is padding-free attention, as without the split;
- `share` turns a collated micro-batch of whole rows into this rank's zigzag share: padded to a
  multiple of 2N tokens (padding has no target), targets shifted on the whole row (``shift_labels``),
  positions the whole row's (RoPE sees global positions), and the whole row's document ids for the
  attention when documents are packed (or padding follows a row);
- `attending(batch)` holds that layout while the micro-batch's forward and backward run.

Everything but attention (embeddings, MLP, norms, LoRA, the loss) runs on the local tokens. The
loss stays a sum over the local targets divided by the step's target count summed over all
ranks; DDP (or FSDP2's reduce-scatter) averages gradients over the world and the trainer scales
by the world size, so the update is the one-process update on the same rows.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from maximus.attention.context_split import ContextSplit
from maximus.attention.ring import ring_attention
from maximus.attention.ulysses import ulysses_attention, ulysses_fits
from maximus.errors import ConfigError, ModelError
from maximus.forward import IGNORE_INDEX, shift_labels
from maximus.structure import causal_lm_of, document_starts

IMPLEMENTATION = "maximus_context_parallel"
EXCHANGES = {"ulysses": ulysses_attention, "ring": ring_attention}

#: (split, exchange, document ids [B, T] or None) of the micro-batch in flight; None outside one.
_ACTIVE: list = [None]


def context_parallel_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                       **kwargs):
    """Transformers attention function: this rank's share of query [B, H, t, D] and key/value
    [B, Hkv, t, D] -> ([B, t, H, D], None) for the whole causal row; attention dropout is not
    applied under the split."""
    from maximus.attention.varlen import varlen_attention_forward

    active = _ACTIVE[0]
    if active is None:
        return varlen_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
    split, exchange, document_ids = active
    out = EXCHANGES[exchange](query, key, value, split, scale=scaling, document_ids=document_ids)
    return out.transpose(1, 2).contiguous(), None


def check_model_config(config, degree: int, longest_row: int) -> None:
    """Refuse, before the weights load, a model whose attention the split would change: the
    exchanges (`EXCHANGES`) compute plain causal softmax attention over the whole row, so a window
    shorter than the rows, soft-capped scores, attention sinks, attention dropout and image tokens
    (whose rows the split does not cut) would be dropped silently. `config`: the model's
    Transformers config; `longest_row`: the longest row the run trains on (tokens)."""
    from maximus.attention.varlen import sliding_window
    from maximus.vision import is_vision_config

    name = f"training.context_parallel {degree}"
    kind = getattr(config, "model_type", type(config).__name__)
    if is_vision_config(config):
        raise ModelError(f"{name} cannot split the rows of a vision-language model ({kind}): its image features "
                         "join the rows inside the model", "set training.context_parallel: 1")
    window = sliding_window(config)
    if window is not None and window < longest_row:
        raise ModelError(f"{name} cannot split {kind}'s sliding-window attention (sliding_window {window} tokens, "
                         f"rows of up to {longest_row}): the split attends to the whole causal row",
                         f"set training.seq_len to at most {window} or training.context_parallel: 1")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise ModelError(f"{name} cannot split {kind}'s soft-capped attention scores (attn_logit_softcapping "
                         f"{softcap})", "set training.context_parallel: 1")
    if kind == "gpt_oss":
        raise ModelError(f"{name} cannot split {kind}'s attention sinks (one extra logit per head)",
                         "set training.context_parallel: 1")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ModelError(f"{name} cannot apply attention dropout (attention_dropout {dropout}) to a split row",
                         "set attention_dropout: 0.0 in the model's config.json, or training.context_parallel: 1")


@dataclass
class ContextParallel:
    """This rank's part in splitting rows; degree 1 (the default) changes nothing."""

    split: ContextSplit = ContextSplit()
    exchange: str = "ulysses"

    @classmethod
    def join(cls, env, degree: int) -> "ContextParallel":
        """The group of `degree` ranks this one shares rows with (`env`: the trainer's `DistEnv`,
        whose batch split it adjusts). A collective: every rank calls it."""
        if degree == 1:
            return cls()
        if env.world_size % degree or env.world_size == 1:
            raise ConfigError(f"training.context_parallel ({degree}) does not divide the number of processes "
                              f"({env.world_size})",
                              f"launch with torchrun --nproc_per_node a multiple of {degree}, or change context_parallel")
        from torch.distributed.device_mesh import init_device_mesh

        env.context_parallel = degree
        # Rank r sits at (r // degree, r % degree): groups of `degree` consecutive ranks share rows.
        mesh = init_device_mesh(env.device.type if env.device is not None else "cpu",
                                (env.world_size // degree, degree), mesh_dim_names=("shard", "context"))
        return cls(ContextSplit(degree, mesh.get_local_rank("context"), mesh.get_group("context")))

    def install(self, model, say) -> None:
        """Route `model`'s attention through the split; `say` prints the one-line notice when the
        heads send it to ring attention."""
        if not self.split.enabled:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        from maximus.attention.varlen import _mask

        base = causal_lm_of(model)
        if not getattr(base, "_supports_attention_backend", False):
            raise ModelError(f"{type(base).__name__} does not route attention through Transformers' attention registry, "
                             "which training.context_parallel needs", "use a Llama, Mistral or Qwen2-family model")
        heads = base.config.num_attention_heads
        if not ulysses_fits(heads, self.split.degree):
            self.exchange = "ring"
            say(f"notice: training.context_parallel {self.split.degree}: the model's {heads} attention heads do not "
                f"divide by {self.split.degree}; attention runs as ring attention")
        AttentionInterface.register(IMPLEMENTATION, context_parallel_attention_forward)
        AttentionMaskInterface.register(IMPLEMENTATION, _mask)
        base.set_attn_implementation(IMPLEMENTATION)

    def share(self, batch: dict, pad_token_id: int | None) -> dict:
        """This rank's share of a collated SFT micro-batch of whole rows (unchanged at degree 1,
        and for preference pairs, which the objective splits itself: `share_rows`)."""
        if not self.split.enabled or "input_ids" not in batch:
            return batch
        return self.share_rows(batch["input_ids"], batch["labels"], batch.get("position_ids"), pad_token_id)

    def share_rows(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None,
                   pad_token_id: int | None) -> dict:
        """This rank's share of whole rows [R, T]: ``input_ids``, ``position_ids`` (global),
        ``shift_labels`` (shifted on the whole row) and, when the rows hold several documents
        (or padding), the whole rows' ``document_ids``."""
        rows, length = ids.shape
        if positions is None:
            positions = torch.arange(length).expand(rows, -1)
        multiple = 2 * self.split.degree
        extra = -length % multiple
        if extra:  # padding after the row: its own "document" (positions from 0), without targets
            ids = torch.cat([ids, ids.new_full((rows, extra), pad_token_id or 0)], dim=1)
            labels = torch.cat([labels, labels.new_full((rows, extra), IGNORE_INDEX)], dim=1)
            positions = torch.cat([positions, torch.arange(extra).expand(rows, -1).to(positions)], dim=1)
        share = {"input_ids": self.split.take(ids, 1), "position_ids": self.split.take(positions, 1),
                 "shift_labels": self.split.take(shift_labels(labels, positions), 1)}
        documents = document_starts(positions)
        if documents is not None:
            share["document_ids"] = documents
        return share

    def take_padded(self, values: torch.Tensor, fill) -> torch.Tensor:
        """This rank's share of per-token `values` [R, T] of whole rows (e.g. log-probs aligned
        with the targets), padded with `fill` to the length `share_rows` pads the rows to."""
        extra = -values.shape[1] % (2 * self.split.degree)
        if extra:
            values = torch.cat([values, values.new_full((values.shape[0], extra), fill)], dim=1)
        return self.split.take(values, 1)

    def broadcast_from_first(self, value):
        """`value` as the group's first rank holds it (a picklable object), on every rank of the
        group: what every rank must see alike, e.g. sampled completions."""
        if not self.split.enabled:
            return value
        box = [value]
        first = dist.get_global_rank(self.split.group, 0) if self.split.group is not None else 0
        dist.broadcast_object_list(box, src=first, group=self.split.group)
        return box[0]

    @contextlib.contextmanager
    def attending(self, batch: dict):
        """The span of one micro-batch's forward and backward (recomputed layers attend again).
        An objective that splits its own rows (`share_rows`) names their documents by `attend`."""
        if not self.split.enabled:
            yield
            return
        self.attend(batch.get("document_ids"))
        try:
            yield
        finally:
            _ACTIVE[0] = None

    def attend(self, document_ids: torch.Tensor | None) -> None:
        """Attention splits from here until the micro-batch ends, over rows with these documents."""
        _ACTIVE[0] = (self.split, self.exchange, document_ids)

    def sum_over_row(self, partial: torch.Tensor) -> torch.Tensor:
        """Per-row sums of the ranks' shares (e.g. a sequence's log-probability), summed over the
        group; differentiable (the gradient of the whole sum reaches every share)."""
        from torch.distributed.nn.functional import all_reduce

        if not self.split.enabled:
            return partial
        if not partial.is_floating_point():  # counts: no gradient
            total = partial.clone()
            dist.all_reduce(total, group=self.split.group)
            return total
        return all_reduce(partial, group=self.split.group or dist.group.WORLD)
