"""The buffers of context parallelism's attention exchange (Ulysses' all-to-all), per local token:
the one term the estimator adds to a rank's share of a row (`maximus.memory.context_parallel`
explains the copies and derives the longest rows over several cards)."""
from __future__ import annotations

from typing import Any

#: Copies of a layer's queries, keys and values, and of its attention output, the all-to-all holds at once.
QKV_COPIES = 1
OUTPUT_COPIES = 4


def exchange_bytes_per_token(model_config: Any, degree: int, dtype_bytes: int = 2) -> int:
    """Bytes per local token of Ulysses' exchange buffers for one layer (0 at degree 1). Key/value
    heads that do not divide by `degree` travel repeated up to the query heads."""
    from maximus.memory.shape import model_shape

    if degree == 1:
        return 0
    shape = model_shape(model_config)
    kv_heads = shape.num_kv_heads if shape.num_kv_heads % degree == 0 else shape.num_heads
    per_head = shape.head_dim * dtype_bytes
    return per_head * (QKV_COPIES * (shape.num_heads + 2 * kv_heads) + OUTPUT_COPIES * shape.num_heads)
