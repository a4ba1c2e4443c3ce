"""How one row's tokens are split over the ranks of a context-parallel group (the zigzag split).

A causal row of ``T`` tokens is cut into ``2N`` equal chunks for ``N`` ranks; rank ``r`` holds
chunks ``r`` and ``2N-1-r`` (one early, one late). Under causal attention the work of a chunk
grows with its position, so each rank gets the same number of query-key pairs and no rank of a
ring waits on the others (the split of ring-flash-attention and Llama 3's context parallelism).
Everything a rank computes locally (MLP, norms, LoRA, loss) sees its ``T / N`` tokens; positions
stay the global ones (`ContextSplit.take` applied to ``position_ids``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from maximus.errors import ConfigError


def zigzag_chunks(degree: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * degree``) rank `rank` holds, in increasing order."""
    return rank, 2 * degree - 1 - rank


def zigzag_indices(length: int, degree: int, rank: int) -> torch.Tensor:
    """Global token indices (long, increasing) of rank `rank`'s share of a `length`-token row."""
    if length % (2 * degree):
        raise ConfigError(f"a row of {length} tokens cannot be split evenly over context_parallel = {degree} ranks "
                          f"(it must be a multiple of {2 * degree} tokens)",
                          f"use a training.seq_len divisible by {2 * degree}")
    chunk = length // (2 * degree)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in zigzag_chunks(degree, rank)])


@dataclass(frozen=True)
class ContextSplit:
    """One rank's place in a context-parallel group: `degree` ranks share each row, this one is
    `rank` within `group` (None: the default group). Degree 1 is one process holding whole rows."""

    degree: int = 1
    rank: int = 0
    group: object = None

    @property
    def enabled(self) -> bool:
        return self.degree > 1

    def indices(self, length: int, device=None) -> torch.Tensor:
        """Global indices of this rank's share of a `length`-token row."""
        return zigzag_indices(length, self.degree, self.rank).to(device)

    def take(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's share of `tensor` along its token dimension `dim` (whole at degree 1)."""
        if not self.enabled:
            return tensor
        return tensor.index_select(dim, self.indices(tensor.shape[dim], tensor.device))

    def global_order(self, local_length: int, device=None) -> torch.Tensor:
        """The permutation that puts the ranks' shares, concatenated in rank order, back in the
        row's order: ``row = cat(shares)[global_order]``."""
        length = local_length * self.degree
        gathered = torch.cat([zigzag_indices(length, self.degree, r) for r in range(self.degree)])
        return torch.argsort(gathered).to(device)

    def peer(self, offset: int) -> int:
        """Global rank of the group member `offset` places after this one on the ring."""
        member = (self.rank + offset) % self.degree
        return dist.get_global_rank(self.group, member) if self.group is not None else member
