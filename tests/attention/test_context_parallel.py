"""Ring and Ulysses attention over 2 and 4 gloo processes equal one process's SDPA on the whole
row: outputs and the gradients of queries, keys and values (MHA and GQA, plain causal rows and
packed documents whose boundaries fall inside chunks and across ranks), to 1e-5 in fp32; and
causality by perturbation: changing every input after position t changes no output at or before
t on any rank (and does change later ones). The ranks run `context_parallel_worker.py`."""
import json
import os
from pathlib import Path

import pytest
import torch

from maximus.attention.context_split import ContextSplit, zigzag_indices
from maximus.errors import ConfigError
from two_ranks import rank_report, run_two_ranks

WORKER = Path(__file__).with_name("context_parallel_worker.py")


@pytest.mark.parametrize("ranks", [2, 4])
def test_split_attention_equals_one_process(tmp_path, ranks):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = run_two_ranks([str(WORKER), str(tmp_path)], tmp_path / "logs", env=env, nproc=ranks)
    assert proc.returncode == 0, rank_report(proc, tmp_path / "logs")
    for rank in range(ranks):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 12
        for case, errors in results.items():
            if case.endswith("perturbation"):
                assert errors["early"] == 0.0, (rank, case)
                assert errors["late"] > 0.1, (rank, case)
            else:
                assert set(errors) == {"out", "grad_q", "grad_k", "grad_v"}
                assert max(errors.values()) < 1e-5, (rank, case, errors)


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
