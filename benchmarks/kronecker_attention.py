"""Kronecker Sketching attention vs SDPA: fwd+bwd time and peak memory, one layer and a small model.

Each (implementation, length) runs in its own subprocess so the peak is that run's own: on CUDA
`torch.cuda.max_memory_allocated`, on CPU the growth of the process's peak RSS (ru_maxrss) over
the state right after imports (inputs, weights, warm-up and timed steps included). Times are medians over `--reps` steps after one warm-up.

    python benchmarks/kronecker_attention.py            # N = 2k..32k, layer and model
    python benchmarks/kronecker_attention.py --quick    # layer only, N = 2k..8k, one rep, no warm-up

Layer: one attention op, batch 1, 8 query heads, 4 kv heads, head_dim 64 (the reference model's
attention). Model: the reference Llama decoder stack (hidden 512, 8/4 heads, intermediate 1536)
with 4 layers and no LM head (loss = mean of the last hidden state), so attention is what grows.
Kronecker settings: the defaults (detail_tokens 256, sketch_slots 64, block 64).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _peak_bytes_start(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_bytes_end(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _layer_step(impl, n, dev, dtype):
    import torch.nn.functional as F

    from maximus.attention import KroneckerSketch
    from maximus.config import KroneckerConfig

    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, 8, n, 64, generator=g).to(dev, dtype).requires_grad_(True)
    k = torch.randn(1, 4, n, 64, generator=g).to(dev, dtype).requires_grad_(True)
    v = torch.randn(1, 4, n, 64, generator=g).to(dev, dtype).requires_grad_(True)
    sketch = KroneckerSketch(64, KroneckerConfig()).to(dev)

    def step():
        if impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = sketch(q, k, v, scaling=64 ** -0.5)
        out.float().square().mean().backward()
        for t in (q, k, v):
            t.grad = None
    return step


def _model_step(impl, n, dev, dtype):
    from transformers import LlamaConfig, LlamaModel

    from maximus.attention import install_kronecker

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32768,
                      rope_theta=500000.0, attn_implementation="sdpa")
    model = LlamaModel(cfg).to(dev, dtype).train()
    if impl == "kronecker":
        install_kronecker(model, True)
    ids = torch.randint(0, 32000, (1, n), generator=torch.Generator().manual_seed(0)).to(dev)

    def step():
        out = model(ids, use_cache=False).last_hidden_state
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
    return step


def worker(mode, impl, n, reps, warmup):
    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    start = _peak_bytes_start(dev)
    step = (_layer_step if mode == "layer" else _model_step)(impl, n, dev, dtype)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = _peak_bytes_end(dev) - start
    print(json.dumps({"seconds": statistics.median(times), "peak_bytes": peak}))


def _run(mode, impl, n, reps, warmup):
    cmd = [sys.executable, __file__, "--worker", mode, impl, str(n), str(reps), str(warmup)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1][:80]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="layer only, N up to 8k, one rep, no warm-up (< 2 min idle)")
    ap.add_argument("--lengths", type=int, nargs="*", help="override the sequence lengths (tokens)")
    ap.add_argument("--modes", nargs="*", choices=["layer", "model"], help="default: both (quick: layer)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        mode, impl, n, reps, warmup = args.worker
        worker(mode, impl, int(n), int(reps), int(warmup))
        return
    lengths = args.lengths or ([2048, 4096, 8192] if args.quick else [2048, 4096, 8192, 16384, 32768])
    reps, warmup = (1, 0) if args.quick else (args.reps, 1)
    modes = args.modes or (["layer"] if args.quick else ["layer", "model"])
    print(f"device: {_device()}, torch {torch.__version__}, reps {reps} (median), warm-up {warmup}\n")
    for mode in modes:
        print(f"### {mode}: fwd+bwd\n")
        print("| N | SDPA s | Kronecker s | speed-up | SDPA peak MiB | Kronecker peak MiB | memory ratio |")
        print("|---|---|---|---|---|---|---|")
        for n in lengths:
            a, b = _run(mode, "sdpa", n, reps, warmup), _run(mode, "kronecker", n, reps, warmup)
            if "error" in a or "error" in b:
                print(f"| {n} | {a.get('error', '')} | {b.get('error', '')} | | | | |")
                continue
            ma, mb = a["peak_bytes"] / 2**20, b["peak_bytes"] / 2**20
            print(f"| {n} | {a['seconds']:.3f} | {b['seconds']:.3f} | {a['seconds'] / b['seconds']:.2f}x "
                  f"| {ma:.0f} | {mb:.0f} | {mb / max(ma, 1e-9):.2f}x |", flush=True)
        print()


if __name__ == "__main__":
    main()
