"""The zigzag split of a row over the ranks of a context-parallel group (no process group needed).
Ring and Ulysses attention over 2 and 4 processes are checked against SDPA, with the training
they serve, in tests/train/test_context_parallel_training.py (one torchrun launch for both)."""
import pytest
import torch

from maximus.attention.context_split import ContextSplit, zigzag_indices
from maximus.errors import ConfigError


def test_zigzag_split_balances_causal_work_and_covers_the_row():
    shares = [zigzag_indices(16, 4, r).tolist() for r in range(4)]
    assert shares == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert {sum(i + 1 for i in share) for share in shares} == {34}  # query-key pairs under the causal mask
    split = ContextSplit(4, 2)
    row = torch.arange(16)
    assert split.take(row).tolist() == shares[2]
    gathered = torch.cat([ContextSplit(4, r).take(row) for r in range(4)])
    assert torch.equal(gathered[split.global_order(4)], row)


def test_a_row_that_does_not_split_evenly_names_both_numbers():
    with pytest.raises(ConfigError) as err:
        zigzag_indices(100, 4, 0)
    assert str(err.value) == ("a row of 100 tokens cannot be split evenly over context_parallel = 4 ranks "
                              "(it must be a multiple of 8 tokens) (hint: use a training.seq_len divisible by 8)")
