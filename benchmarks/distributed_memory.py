"""FSDP2 under torchrun: per-rank memory of parameters, gradients and optimizer state vs one process.

One training step (forward, backward, AdamW step) of a random Llama-shaped model, full fine-tuning
and LoRA r=16 on every linear layer, fp32, on the CPU with gloo. Measured with Maximus' meter
(`maximus.memory.meter`): the bytes of the distinct storages behind each rank's local parameter
shards, gradients and optimizer state after the step (`unique_storage_bytes`), and the step's
peak of live storage (`MemoryMeter.track`, CPU storage tracker, which also sees the transient
all-gathered layers). The one-process numbers come from the same script in the same run; the
N-process ones from `torchrun --standalone --nproc_per_node=N` running this script as a worker.
Goal: parameters + optimizer state per rank about 1/N of one process.

    python benchmarks/distributed_memory.py --quick      # vocab 32000, hidden 256, 4 layers; < 2 min
    python benchmarks/distributed_memory.py              # the reference model (vocab 128256, hidden 512, 8 layers)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SHAPES = {
    "quick": dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "reference": dict(vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, rope_theta=500000.0),
}


def build(shape: str, method: str):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False))
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    else:
        model.requires_grad_(True)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def measure(shape: str, method: str, seq: int, world: int, rank: int) -> dict:
    """One step on this rank's share of a batch of `world` sequences; bytes by category."""
    from torch.utils._pytree import tree_leaves

    from maximus.memory.meter import MemoryMeter, unique_storage_bytes
    from maximus.forward import sft_loss_sum

    model = build(shape, method)
    if world > 1:
        from maximus.train.distributed import shard_with_fsdp2

        shard_with_fsdp2(model, torch.device("cpu"), torch.float32, world)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (1, seq), generator=g)
    meter = MemoryMeter("cpu")

    def step():
        loss, n = sft_loss_sum(model, {"input_ids": ids, "labels": ids})
        (loss / n).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()  # optimizer state exists from here on, as in every later step
    locals_ = lambda ts: [_local(t) for t in ts]  # noqa: E731
    params = locals_(model.parameters())
    grads = locals_(p.grad for p in model.parameters() if p.grad is not None)
    states = locals_(v for v in tree_leaves(list(optimizer.state.values())) if isinstance(v, torch.Tensor))
    meter.adopt(*params, *grads, *states)
    meter.reset_peak()
    with meter.track():
        step()
    p_bytes, seen = unique_storage_bytes(params)
    g_bytes, g_seen = unique_storage_bytes(grads, exclude=seen)
    o_bytes, _ = unique_storage_bytes(states, exclude=seen | g_seen)
    return {"rank": rank, "world": world, "method": method, "parameters": p_bytes, "gradients": g_bytes,
            "optimizer_state": o_bytes, "step_peak": meter.peak_bytes()}


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [measure(args.shape, m, args.seq, world, rank) for m in args.methods]
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model (vocab 32000, hidden 256, 4 layers)")
    ap.add_argument("--nproc", type=int, default=2, help="processes for the FSDP2 run")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (one sequence per rank)")
    ap.add_argument("--methods", nargs="+", default=["full", "lora"])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    shape = "quick" if args.quick else "reference"
    torch.set_num_threads(1)
    single = {m: measure(shape, m, args.seq, 1, 0) for m in args.methods}
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--worker", "--shape", shape, "--seq", str(args.seq), "--out", out, "--methods", *args.methods]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.nproc)]
    n = args.nproc
    print(f"model: Llama {SHAPES[shape]} | fp32 | AdamW | {args.seq} tokens per rank | FSDP2 on {n} CPU processes (gloo)\n")
    print("| method | run | parameters MiB | gradients MiB | optimizer MiB | params + optimizer MiB | ratio to 1 process | goal 1/N | step peak MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in args.methods:
        one = single[m]
        base = one["parameters"] + one["optimizer_state"]
        print(f"| {m} | 1 process | {mib(one['parameters'])} | {mib(one['gradients'])} | {mib(one['optimizer_state'])} | "
              f"{mib(base)} | 1.00 | | {mib(one['step_peak'])} |")
        for rows in ranks:
            r = next(x for x in rows if x["method"] == m)
            both = r["parameters"] + r["optimizer_state"]
            print(f"| {m} | FSDP2 rank {r['rank']} of {n} | {mib(r['parameters'])} | {mib(r['gradients'])} | "
                  f"{mib(r['optimizer_state'])} | {mib(both)} | {both / base:.2f} | {1 / n:.2f} | {mib(r['step_peak'])} |")


if __name__ == "__main__":
    main()
