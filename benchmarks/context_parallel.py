"""Context parallelism on the CPU: one rank's activation peak and the step's throughput at the
same total tokens, one process vs `training.context_parallel: 4` (4 gloo processes, each row
split over them) vs DDP over 4 processes (one whole row each), at seq 4096.

A random Llama (hidden 256, 4 layers, 8 query / 4 key-value heads), LoRA r=16, fp32, no
checkpointing, `--steps` optimizer steps of 4 rows of exactly 4096 tokens each (16,384 tokens a
step in every run: one process accumulates 4 micro-batches of a row, the split runs 4 of a row
over 4 ranks, DDP one row per rank), through `maximus.train` (torchrun for the 4-process runs),
each process on one thread. Peak: run.json ``memory.breakdown.activations`` (rank 0, the CPU
meter, every step): the step's peak less weights, gradients and optimizer state, beside the
prediction (`maximus.memory.context_parallel.rank_activation_bytes`: the one-card estimate at
the rank's tokens plus Ulysses' exchange buffers). Throughput: the median ``tokens_per_s`` of
steps 2 to `--steps` (metrics.jsonl: the step's whole rows' tokens over its wall time). The
CPU, its bf16 flags and matmul rate (one thread) and the load average are printed first.

    python benchmarks/context_parallel.py            # ~6 min on 2 busy cores
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SEQ = 4096
RANKS = 4
ROWS = 4  # per optimizer step, in every run


def _model(path: Path):
    """(model directory, its config)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(None, vocab_size=300)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2 * SEQ,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path, config


def _config(model: Path, data: Path, out: Path, *, steps: int, context_parallel: int) -> Path:
    import yaml

    cfg = {"model": str(model), "dataset": {"path": str(data), "format": "text"}, "method": "lora",
           "lora": {"r": 16, "alpha": 32}, "output_dir": str(out), "eval": {"enabled": False},
           "logging": {"progress": "none"}, "optimization": {"gradient_checkpointing": "off"},
           "training": {"batch_size": ROWS, "micro_batch_size": 1, "max_steps": steps, "seq_len": SEQ,
                        "packing": False, "dtype": "fp32", "memory_meter": "every_step",
                        "context_parallel": context_parallel}}
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(config: Path, ranks: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]
    subprocess.run([*launcher, "-m", "maximus.train", "--config", str(config)], check=True, env=env,
                   stdout=subprocess.DEVNULL)


def _result(out: Path) -> dict:
    run = json.loads((out / "run.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [s for s in steps if s.get("step", 0) >= 2 and "tokens_per_s" in s]
    return {"activations_bytes": run["memory"]["breakdown"]["activations"],
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
            "tokens_per_step": sorted({s["tokens"] for s in timed}), "steps_timed": len(timed)}


def main() -> None:
    import argparse

    import torch
    from _machine import cpu_report
    from long_context import _data

    from maximus.memory.context_parallel import rank_activation_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the matmul rate of one process's thread, as each run's processes have
    print(cpu_report(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, shape = _model(tmp / "model")
        data = _data(tmp / "data.jsonl", SEQ, rows=ROWS * args.steps)
        runs = {"one process": (1, 1), f"context_parallel {RANKS}": (RANKS, RANKS), f"DDP over {RANKS}": (RANKS, 1)}
        results = {}
        for name, (ranks, cp) in runs.items():
            out = tmp / name.replace(" ", "_")
            _run(_config(model, data, out, steps=args.steps, context_parallel=cp), ranks)
            results[name] = _result(out)
            results[name]["predicted_bytes"] = rank_activation_bytes(
                shape, SEQ, cp, dtype_bytes=4, method="lora", lora_r=16, checkpointing="off", dtype="fp32", device="cpu")
            print(name, results[name], flush=True)
        one = results["one process"]["activations_bytes"]
        ddp = results[f"DDP over {RANKS}"]["tokens_per_s"]
        print("| run | tokens per step | activation peak per rank | vs one process | predicted | predicted / measured "
              "| tokens/s (median) | vs DDP |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {'/'.join(f'{t:,}' for t in r['tokens_per_step'])} "
                  f"| {r['activations_bytes'] / 2**20:.1f} MiB | {r['activations_bytes'] / one:.2f}x "
                  f"| {r['predicted_bytes'] / 2**20:.1f} MiB | {r['predicted_bytes'] / r['activations_bytes']:.3f} "
                  f"| {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / ddp:.2f}x |")


if __name__ == "__main__":
    main()
