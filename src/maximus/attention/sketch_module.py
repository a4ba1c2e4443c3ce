"""`KroneckerSketch`: the learned parameters of Kronecker Sketching attention for one layer.

It lives at `self_attn.kronecker` of every attention layer so that PEFT can train and save it
(`modules_to_save=kronecker_module_names(model)`). Its `forward` runs the attention, so a PEFT
`ModulesToSaveWrapper` around it dispatches to the active copy.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from maximus.attention.kronecker import kronecker_sketch_attention
from maximus.config import KroneckerConfig
from maximus.errors import ConfigError

# Off-segment logit of the B factor at initialisation: softmax weight e^-8 ~ 3e-4, so each sub-slot
# starts as the mean of its own L/S positions, while gradients still reach every position.
_OFF_SEGMENT_LOGIT = -8.0


class KroneckerSketch(nn.Module):
    """Detail + sketch attention parameters for one attention layer.

    Layout derived from `KroneckerConfig(detail_tokens=W, sketch_slots=K, block=L)`:

    * detail: W // L blocks per query block: `local_blocks` = min(2, W // L) most recent (the
      query's own block included) and `select_blocks` = W // L - local_blocks chosen by score.
    * sketch: `sub_slots` S = min(L, floor(sqrt(K))) slots per block (factor B, S x L) times
      `buckets` M = K // S distance buckets (factor A): S * M <= K slots per query.

    Parameters (fp32, trainable): `sub_slot_logits` [S, L], `bucket_log_scale` [M],
    `score_query` / `score_key` [D, D] (identity at start), `score_prior` [D] (zero at start).

    Raises:
        ConfigError: detail_tokens smaller than block.
    """

    def __init__(self, head_dim: int, settings: KroneckerConfig):
        super().__init__()
        if settings.detail_tokens < settings.block:
            raise ConfigError(
                f"optimization.kronecker_sketching.detail_tokens ({settings.detail_tokens}) must be at least block ({settings.block})",
                "raise detail_tokens or lower block; detail_tokens is rounded down to whole blocks",
            )
        self.block = settings.block
        detail_blocks = settings.detail_tokens // settings.block
        self.local_blocks = min(2, detail_blocks)
        self.select_blocks = detail_blocks - self.local_blocks
        sub_slots = max(1, min(settings.block, math.isqrt(settings.sketch_slots)))
        buckets = max(1, settings.sketch_slots // sub_slots)
        segment = torch.arange(settings.block) * sub_slots // settings.block
        logits = torch.full((sub_slots, settings.block), _OFF_SEGMENT_LOGIT)
        logits[segment, torch.arange(settings.block)] = 0.0
        self.sub_slot_logits = nn.Parameter(logits)
        self.bucket_log_scale = nn.Parameter(torch.zeros(buckets))
        self.score_query = nn.Parameter(torch.eye(head_dim))
        self.score_key = nn.Parameter(torch.eye(head_dim))
        self.score_prior = nn.Parameter(torch.zeros(head_dim))

    @property
    def layout(self) -> tuple[int, int, int, int, int]:
        """(block, local_blocks, select_blocks, sub_slots, buckets): what the settings decide.
        Two settings with the same layout build the same sketch."""
        return (self.block, self.local_blocks, self.select_blocks, self.sub_slot_logits.shape[0],
                self.bucket_log_scale.shape[0])

    @property
    def detail_tokens(self) -> int:
        """Keys per query on the exact path (tokens); sequences this short are attended exactly."""
        return (self.local_blocks + self.select_blocks) * self.block

    @property
    def slots(self) -> int:
        """Sketch slots per query (sub_slots x buckets)."""
        return self.sub_slot_logits.shape[0] * self.bucket_log_scale.shape[0]

    def extra_repr(self) -> str:
        return (f"block={self.block}, local_blocks={self.local_blocks}, select_blocks={self.select_blocks}, "
                f"sub_slots={self.sub_slot_logits.shape[0]}, buckets={self.bucket_log_scale.shape[0]}")

    def forward(self, query, key, value, *, scaling: float, key_valid=None, doc_start=None,
                sliding_window=None, dropout_p: float = 0.0) -> torch.Tensor:
        """Attention output [B, H, Tq, D]; see `kronecker_sketch_attention` for the arguments."""
        return kronecker_sketch_attention(query, key, value, self, scaling=scaling, key_valid=key_valid,
                                          doc_start=doc_start, sliding_window=sliding_window, dropout_p=dropout_p)
