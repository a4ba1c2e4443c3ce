"""What the context-parallel tests run under torchrun (gloo), in one launch per world size:

1. `attention_checks` (unless the launch says "attention": false): ring and Ulysses attention
   over the zigzag split against one process's SDPA on the whole row. Every rank builds the same
   seeded tensors, computes the reference itself, and writes the largest differences it saw to
   OUT/attention-rank<r>.json;
2. `two_steps` of each training config: each step's loss and gradients (after DDP's average);
   rank 0 writes OUT/<name>.safetensors. The one-process oracle imports and calls `two_steps`;
3. each whole run of "runs" (`Trainer.train`: plan, join, train, write the run directory), which
   leaves the process group; the next run joins it again. Rank 0 prints the degree each joined at.

Usage: context_parallel_worker.py LAUNCH.json OUT
(LAUNCH: {"attention": bool, "configs": {name: cfg}, "runs": {name: cfg}}; "configs" and "runs" optional).
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from maximus import Config, Trainer
from maximus.attention.context_split import ContextSplit
from maximus.attention.ring import ring_attention
from maximus.attention.ulysses import ulysses_attention

ATTENTIONS = {"ring": ring_attention, "ulysses": ulysses_attention}
BATCH, HEADS, LENGTH, HEAD_DIM = 2, 4, 48, 8
CUT = 19  # the perturbation changes every position after this one


def documents() -> torch.Tensor:
    """Two rows of packed documents, boundaries inside chunks and across ranks."""
    ids = torch.zeros(BATCH, LENGTH, dtype=torch.long)
    for b, cuts in enumerate(([0, 5, 30], [0, 17, 18, 41])):
        for i, start in enumerate(cuts):
            ids[b, start:] = i
    return ids


def reference(q, k, v, docs):
    gqa = k.shape[1] != q.shape[1]
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def tensors(kv_heads, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM, generator=g)
    k, v = (torch.randn(BATCH, kv_heads, LENGTH, HEAD_DIM, generator=g) for _ in range(2))
    return q, k, v, torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM, generator=g)


def parity(attention, split, kv_heads, docs) -> dict:
    q, k, v, grad_out = tensors(kv_heads, seed=kv_heads)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*full, docs)
    ref.backward(grad_out)
    local = [split.take(t, 2).requires_grad_() for t in (q, k, v)]
    out = attention(*local, split, document_ids=docs)
    out.backward(split.take(grad_out, 2))
    errors = {"out": (out - split.take(ref, 2)).abs().max().item()}
    for name, mine, whole in zip("qkv", local, full):
        errors[f"grad_{name}"] = (mine.grad - split.take(whole.grad, 2)).abs().max().item()
    return errors


def causality(attention, split, kv_heads) -> float:
    """Largest change of an output at or before CUT when every input after CUT changes."""
    q, k, v, _ = tensors(kv_heads, seed=7)
    noise = tensors(kv_heads, seed=8)
    later = torch.arange(LENGTH) > CUT
    outs = []
    for inputs in ((q, k, v), tuple(torch.where(later[:, None], n, t) for t, n in zip((q, k, v), noise))):
        outs.append(attention(*(split.take(t, 2) for t in inputs), split))
    early = split.indices(LENGTH) <= CUT
    changed_late = (outs[0] - outs[1])[:, :, ~early].abs().max().item() if (~early).any() else 1.0
    return (outs[0] - outs[1])[:, :, early].abs().max().item(), changed_late


def attention_checks(out_dir: Path) -> None:
    split = ContextSplit(dist.get_world_size(), dist.get_rank())
    results = {}
    for name, attention in ATTENTIONS.items():
        for kv_heads in (HEADS, 2):
            for packed in (False, True):
                results[f"{name} kv{kv_heads} {'packed' if packed else 'causal'}"] = parity(
                    attention, split, kv_heads, documents() if packed else None)
            early, late = causality(attention, split, kv_heads)
            results[f"{name} kv{kv_heads} perturbation"] = {"early": early, "late": late}
    (out_dir / f"attention-rank{split.rank}.json").write_text(json.dumps(results))


STEPS = 2


def two_steps(cfg: dict) -> tuple[dict[str, torch.Tensor], Trainer]:
    """{"loss": [step losses], "<step>/<parameter>": gradient} of the first STEPS steps of `cfg`."""
    kept: dict[str, torch.Tensor] = {}

    def keep_grads(trainer, step):  # the gradient itself, before AdamW turns it into ~sign(grad)
        for name, p in trainer.model.named_parameters():
            if p.requires_grad:
                grad = p.grad.detach()
                if isinstance(grad, DTensor):  # an FSDP2 shard: gathered whole (every rank takes part)
                    grad = grad.full_tensor()
                kept[f"{step}/{name}"] = grad.clone()

    trainer = Trainer(Config.from_dict(cfg), hooks={"after_backward": keep_grads})
    trainer.setup()
    losses = [trainer.train_step(step)["loss"] for step in range(1, STEPS + 1)]
    kept["loss"] = torch.tensor(losses, dtype=torch.float64)
    return kept, trainer


def main(launch: Path, out: Path) -> None:
    spec = json.loads(launch.read_text())
    dist.init_process_group("gloo")  # the trainers below join this group
    if spec["attention"]:
        attention_checks(out)
    trainer = None
    for name, cfg in spec.get("configs", {}).items():
        kept, trainer = two_steps(cfg)
        if trainer.dist.is_main:
            save_file(kept, str(out / f"{name}.safetensors"))
            print(f"{name}: exchange {trainer.context.exchange}, strategy {trainer.dist.strategy}", flush=True)
    if trainer is not None:
        trainer.dist.shutdown(clean=True)
    for name, cfg in spec.get("runs", {}).items():
        trainer = Trainer(Config.from_dict(cfg))
        trainer.train()  # joins a process group of its own, and leaves it at its end (DistEnv.shutdown)
        if trainer.dist.is_main:
            print(f"{name}: joined at context_parallel {trainer.context.split.degree}, "
                  f"{trainer.dist.data_world_size} batch share(s)", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
