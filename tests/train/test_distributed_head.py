"""FSDP2 shards the output head too: 2 gloo processes equal one process, with the head split.

The lean loss never calls the head's forward; `shard_with_fsdp2` gives the head a forward
method the loss runs through (`forward.through_head`), so FSDP2 gathers the weight for the loss
and reduce-scatters its gradient. Oracle: the same tiny Llama trained by one process (full
fine-tuning, AdamW, 3 steps of 4 rows in micro-batches of 1). Checked per rank: the head is a
DTensor holding half the vocabulary rows (untied) or stays whole (tied to the embedding: one
weight cannot live in two FSDP units); per-step losses, every parameter after training, a
no-grad loss (the eval path) and logits from the head's ordinary forward (what `generate` uses)
equal the one-process run.

The file is also the worker: `torchrun ... test_distributed_head.py OUT_DIR`.
"""
import os
import sys
from pathlib import Path

import torch

VOCAB, ROWS, SEQ, STEPS = 96, 4, 16, 3


def _model(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie))
    model.requires_grad_(True)
    return model.train()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _train(model, rank: int, world: int) -> dict:
    """STEPS optimizer steps; each rank takes its contiguous rows, one micro-batch per row, and
    scales by world / (targets of the whole step), as the trainer does."""
    from maximus.forward import sft_loss_sum

    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-2)
    losses = []
    for ids in _batches():
        part = ids[rank * ROWS // world:(rank + 1) * ROWS // world]
        total = torch.zeros(())
        for row in part.split(1):
            loss, _ = sft_loss_sum(model, {"input_ids": row, "labels": row})
            (loss * world / (ROWS * (SEQ - 1))).backward()
            total += loss.detach()
        if world > 1:
            torch.distributed.all_reduce(total)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total) / (ROWS * (SEQ - 1)))
    model.eval()
    with torch.no_grad():
        probe = _batches()[0]
        eval_loss, _ = sft_loss_sum(model, {"input_ids": probe, "labels": probe})
        logits = model(input_ids=probe[:1]).logits
    return {"losses": losses, "eval_loss": float(eval_loss), "logits": logits}


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    from maximus.train.distributed import full_trainable_state, shard_with_fsdp2

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for tie in (False, True):
        model = _model(tie)
        shard_with_fsdp2(model, torch.device("cpu"), torch.float32, world)
        head = model.lm_head.weight
        layout = {"dtensor": isinstance(head, DTensor),
                  "local_rows": (head.to_local() if isinstance(head, DTensor) else head).shape[0]}
        with implicit_replication():  # the trainer's session(): a replicated tied weight meets shards
            result = _train(model, rank, world)
        state = full_trainable_state(model, keep=rank == 0)
        torch.save({**result, "state": state, "layout": layout}, out / f"tie{int(tie)}_rank{rank}.pt")
    # Leave together, as DistEnv.shutdown does: a rank exiting right after its collectives can
    # abort in interpreter shutdown while a gloo thread still releases a backward's work.
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_shards_the_head_and_equals_one_process(tmp_path):
    from two_ranks import rank_report, run_two_ranks

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_two_ranks([__file__, str(tmp_path)], tmp_path / "logs", env=env)
    assert proc.returncode == 0, rank_report(proc, tmp_path / "logs")
    for tie in (False, True):
        model = _model(tie)
        ref = _train(model, 0, 1)
        ref_state = {n: p.detach() for n, p in model.named_parameters()}
        for rank in (0, 1):
            got = torch.load(tmp_path / f"tie{int(tie)}_rank{rank}.pt", weights_only=False)
            # Untied: each rank holds half of the head's vocabulary rows; tied: the whole weight.
            assert got["layout"] == ({"dtensor": True, "local_rows": VOCAB // 2} if not tie
                                     else {"dtensor": False, "local_rows": VOCAB}), (tie, rank)
            for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
                assert abs(a - b) < 1e-5, (tie, rank, step, a, b)
            assert abs(got["eval_loss"] - ref["eval_loss"]) < 1e-4, (tie, rank)
            torch.testing.assert_close(got["logits"], ref["logits"], rtol=0, atol=1e-4)
        state = torch.load(tmp_path / f"tie{int(tie)}_rank0.pt", weights_only=False)["state"]
        assert state.keys() == ref_state.keys()
        for name, tensor in ref_state.items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-5, msg=f"tie={tie} {name}")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
