"""Output layer alone, forward + backward: naive (F.cross_entropy on full logits) vs exact
(chunked linear cross-entropy) vs ghost (Ghost Logit sampled softmax).

Reports per configuration the peak extra memory and the median wall time, with ratios to naive.

Memory is counted with the PyTorch profiler's allocator events (``profile_memory=True``): every
CPU allocation and free made by the loss, its backward and the gradient buffers, in order; the
peak of their running sum is the extra memory the step needs on top of its inputs (hidden,
weight, labels). It is exact and independent of machine load (the same accounting a CUDA
caching allocator's ``max_memory_allocated`` would give, minus allocator rounding). Time is the
median of ``--repeats`` interleaved runs (naive, exact, ghost, naive, ...), so that load from other
processes hits all three alike.

    python benchmarks/loss_layer.py --quick          # < 2 min on 2 cores: 2 configurations
    python benchmarks/loss_layer.py                  # vocab 32k/128k/262k, 4096-8192 tokens
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from maximus.losses import ghost_logit_loss, linear_cross_entropy, naive_cross_entropy

METHODS = {
    "naive": naive_cross_entropy,
    "exact": linear_cross_entropy,
    "ghost": ghost_logit_loss,
}

QUICK = [(4096, 512, 32000), (4096, 512, 128256)]
FULL = [(4096, 512, 32000), (8192, 512, 32000), (4096, 512, 128256), (8192, 1024, 128256),
        (4096, 2048, 128256), (4096, 512, 262144), (8192, 1024, 262144)]


def make_inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int = 0, frozen_head=False):
    """Hidden states like a final RMSNorm output, a head initialised like Llama (std 0.02)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dtype).requires_grad_(not frozen_head)
    y = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, y


def step(method: str, h, w, y) -> float:
    """One forward + backward; returns the loss value."""
    h.grad = w.grad = None
    loss = METHODS[method](h, w, y)
    loss.backward()
    return loss.item()


def _allocations(nodes, out):
    """Every allocator event (size > 0: allocation, < 0: free) in the profiler's event tree."""
    for node in nodes:
        if node.typed[0] == _EventType.Allocation:
            out.append((node.start_time_ns, node.typed[1].alloc_size))
        _allocations(node.children, out)
    return out


def peak_extra_bytes(method: str, h, w, y) -> int:
    """Peak of allocated-minus-freed CPU bytes during one step (profiler allocator events)."""
    h.grad = w.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(method, h, w, y)
    running = peak = 0
    for _, delta in sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree(), [])):
        running += delta
        peak = max(peak, running)
    h.grad = w.grad = None
    return peak


def run_config(tokens, hidden, vocab, dtype, repeats, frozen_head=False):
    h, w, y = make_inputs(tokens, hidden, vocab, dtype, frozen_head=frozen_head)
    row = {"config": f"{tokens} x {hidden} -> {vocab}"}
    for method in METHODS:
        row[f"{method}_loss"] = step(method, h, w, y)  # warm-up, and the loss value
        row[f"{method}_bytes"] = peak_extra_bytes(method, h, w, y)
    times = {m: [] for m in METHODS}
    for _ in range(repeats):
        for method in METHODS:
            start = time.perf_counter()
            step(method, h, w, y)
            times[method].append(time.perf_counter() - start)
    for method in METHODS:
        row[f"{method}_s"] = statistics.median(times[method])
    return row


def markdown(rows, dtype) -> str:
    mib = 2**20
    lines = [f"dtype {str(dtype).replace('torch.', '')}; tokens x hidden -> vocab; times are medians; "
             "memory is peak extra bytes over the inputs (includes the hidden/weight gradient buffers).", "",
             "| config | naive MiB | exact MiB | ghost MiB | exact/naive mem | naive s | exact s | ghost s "
             "| naive/exact speed | naive/ghost speed | ghost loss - exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['naive_bytes'] / mib:.0f} | {r['exact_bytes'] / mib:.0f} | "
            f"{r['ghost_bytes'] / mib:.0f} | {r['exact_bytes'] / r['naive_bytes']:.3f} | {r['naive_s']:.2f} | "
            f"{r['exact_s']:.2f} | {r['ghost_s']:.2f} | {r['naive_s'] / r['exact_s']:.2f}x | "
            f"{r['naive_s'] / r['ghost_s']:.2f}x | {r['ghost_loss'] - r['exact_loss']:+.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configurations, 2 repeats (< 2 min)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--frozen-head", action="store_true", help="head weight without gradient (LoRA/QLoRA case)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--configs", default=None,
                        help="override, e.g. '4096x512x128256,8192x1024x262144' (tokens x hidden x vocab)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per method (default 2 quick, 3 full)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    configs = QUICK if args.quick else FULL
    if args.configs:
        configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.quick else 3)
    rows = []
    for tokens, hidden, vocab in configs:
        rows.append(run_config(tokens, hidden, vocab, dtype, repeats, args.frozen_head))
        print(f"done {rows[-1]['config']}", flush=True)
    print(f"threads {torch.get_num_threads()}, head {'frozen' if args.frozen_head else 'trainable'}")
    print(markdown(rows, dtype))


if __name__ == "__main__":
    main()
