"""Calibrate and check the planner's step-time model (`maximus.memory.step_time`, issue 23).

Modes:

* ``calibrate``: per dtype (fp32, and bf16), the rate of each op class the model prices, on the
  reference model's shapes (`_reference_model.py`), at ``--threads`` threads:
  - head: the exact loss (`linear_cross_entropy`) forward + backward over 2,048 tokens against the
    frozen 128,256 x 512 head, FLOPs 4 x T x H x V, at chunks of 128 / 256 / 512 / 1024 tokens
    (this also measures the default loss chunk per dtype);
  - decoder matmuls: a 2,048 x 512 @ 512 x 1,536 matmul (forward; the input gradient is the
    same product shape);
  - attention: causal SDPA on 8 heads x 2,048 x 64, forward (FLOPs: 2 x s^2 x d per head, the
    causal half) and backward as a multiple of the forward;
  - elementwise: one LoRA (r=16, all linear) decoder layer forward + backward minus what the
    three rates above predict for it, per token and per (hidden + intermediate) element;
  - dequantise: bitsandbytes NF4 -> dtype of a 512 x 1,536 weight, seconds per weight element.
  Prints the numbers `maximus.memory.step_time.CALIBRATION` holds.
* ``plans``: the reference model's QLoRA step (batch 1, seq 2,048, the default config otherwise)
  under each checkpointing plan (off, selective, 4 of 8 layers, full), interleaved step by step in
  one process: the model's predicted step time against the measured median.

    python benchmarks/step_cost.py calibrate --dtypes fp32 bf16
    python benchmarks/step_cost.py plans --dtype fp32 --steps 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def calibrate(args) -> None:
    from _reference_model import REFERENCE_CONFIG as C
    from maximus.losses.linear_cross_entropy import linear_cross_entropy

    T, H, V, I = args.tokens, C["hidden_size"], C["vocab_size"], C["intermediate_size"]
    heads = C["num_attention_heads"]
    d = H // heads
    out = {}
    for name in args.dtypes:
        dt = DTYPES[name]
        g = torch.Generator().manual_seed(0)
        row: dict = {}
        # -- head: the exact loss, chunk sizes interleaved round by round ---------------------
        w = (torch.randn(V, H, generator=g) * 0.02).to(dt)
        hid = torch.randn(T, H, generator=g).to(dt).requires_grad_(True)
        labels = torch.randint(0, V, (T,), generator=g)

        def head(c):
            hid.grad = None
            linear_cross_entropy(hid, w, labels, chunk_size=c).backward()
        chunks: dict[int, list[float]] = {c: [] for c in args.chunks}
        for r in range(args.repeats + 1):
            for c in args.chunks:
                t = time.perf_counter()
                head(c)
                if r:  # the first round warms up
                    chunks[c].append(time.perf_counter() - t)
        row["head_chunk_s"] = {c: statistics.median(v) for c, v in chunks.items()}
        # within a round, each chunk against the best-overall chunk: load-robust ratios
        best = min(row["head_chunk_s"], key=row["head_chunk_s"].get)
        row["head_chunk_ratio"] = {c: statistics.median(a / b for a, b in zip(v, chunks[best])) for c, v in chunks.items()}
        row["head_flops_per_s"] = 4 * T * H * V / row["head_chunk_s"][best]
        row["best_chunk"] = best
        del w, hid
        # -- decoder matmul -------------------------------------------------------------------
        x = torch.randn(T, H, generator=g).to(dt).requires_grad_(True)
        wl = torch.randn(I, H, generator=g).to(dt)

        with torch.no_grad():  # forward only: the backward's input gradient is the same product shape
            row["decoder_flops_per_s"] = 2 * T * H * I / _median_time(lambda: x @ wl.T, args.repeats * 3)
        # -- attention ------------------------------------------------------------------------
        q, k, v = (torch.randn(1, heads, T, d, generator=g).to(dt).requires_grad_(True) for _ in range(3))

        def attn():
            for t in (q, k, v):
                t.grad = None
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        fwd = 2 * T * T * d * heads  # causal half of 4 s^2 d
        with torch.no_grad():
            fwd_s = _median_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                                 args.repeats * 2)
        row["attention_flops_per_s"] = fwd / fwd_s
        row["attention_backward_x_forward"] = _median_time(attn, args.repeats * 2) / fwd_s - 1
        # -- dequantise -----------------------------------------------------------------------
        import bitsandbytes.functional as bnbf

        wq, state = bnbf.quantize_4bit(torch.randn(I, H, generator=g).to(dt), quant_type="nf4", compress_statistics=True)
        row["dequantize_s_per_weight"] = _median_time(lambda: bnbf.dequantize_4bit(wq, state), args.repeats * 3) / (I * H)
        # -- elementwise: the real decoder layers' forward minus matmuls and attention ---------
        row.update(_layer_forward(C, name, row, args))
        out[name] = row
        print(json.dumps({name: row}), flush=True)
    print("\n| dtype | head GFLOP/s (best chunk) | head time at chunk " + " / ".join(map(str, args.chunks))
          + " (x best, within a round) | decoder matmul GFLOP/s | attention GFLOP/s (backward x forward) | LoRA layer forward ms "
          "| elementwise ns per token x (h + i) | NF4 dequantise ns / weight |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, r in out.items():
        ratio = r["head_chunk_ratio"]
        print(f"| {name} | {r['head_flops_per_s'] / 1e9:.0f} ({r['best_chunk']}) | "
              f"{' / '.join(f'{ratio[c]:.2f}' for c in args.chunks)} | {r['decoder_flops_per_s'] / 1e9:.0f} | "
              f"{r['attention_flops_per_s'] / 1e9:.0f} ({r['attention_backward_x_forward']:.1f}) | {r['layer_forward_s'] * 1e3:.0f} | "
              f"{r['elementwise_s_per_element'] * 1e9:.2f} | {r['dequantize_s_per_weight'] * 1e9:.2f} |")


def _layer_forward(C: dict, dtype: str, rates: dict, args) -> dict:
    """Median forward time of the reference model's LoRA decoder layers inside a Maximus training
    step (hooks around each layer; what a full recompute replays), and the part of it the matmul
    and attention rates do not explain, per token per (hidden + intermediate) element."""
    import finetune_vs_peft as fvp
    from _reference_model import reference_model_dir
    from maximus.structure import find_decoder_layers
    from maximus.memory.step_time import layer_matmul_flops

    T = args.tokens
    n = args.repeats + 1
    with tempfile.TemporaryDirectory() as tmp:
        step, model, _, set_rows, info = fvp.build_maximus(reference_model_dir(), "lora", T, "off", n, Path(tmp),
                                                           dtype=dtype, meter=False)
        set_rows(fvp.synthetic_ids(n, T, C["vocab_size"]))
        _, layers = find_decoder_layers(model)
        spans: list[float] = []
        began: list[float] = []
        hooks = [layer.register_forward_pre_hook(lambda m, a: began.append(time.perf_counter())) for layer in layers]
        hooks += [layer.register_forward_hook(lambda m, a, o: spans.append(time.perf_counter() - began.pop()))
                  for layer in layers]
        for i in range(1, n + 1):
            if i == 2:
                spans.clear()  # the first step warms up
            step(i)
        for h in hooks:
            h.remove()
    layer_s = statistics.median(spans)
    h, i, heads = C["hidden_size"], C["intermediate_size"], C["num_attention_heads"]
    d = h // heads
    matmul = layer_matmul_flops(h, i, heads * d, C["num_key_value_heads"] * d, 16) * T
    explained = matmul / rates["decoder_flops_per_s"] + 2 * T * T * d * heads / rates["attention_flops_per_s"]
    return {"layer_forward_s": layer_s, "elementwise_s_per_element": max(0.0, layer_s - explained) / (T * (h + i))}


def plans(args) -> None:
    import finetune_vs_peft as fvp
    from _reference_model import REFERENCE_CONFIG, reference_model_dir
    from maximus.memory import estimate_peak

    torch.set_num_threads(args.threads)
    model_dir = reference_model_dir()
    policies = {"off": "off", "selective": "selective", "4/8 layers": ["full"] * 4 + ["none"] * 4, "full": "full"}
    n = args.warmup + args.steps
    ids = fvp.synthetic_ids(n, args.seq, REFERENCE_CONFIG["vocab_size"])
    from maximus.memory.checkpointing import apply_checkpointing

    with tempfile.TemporaryDirectory() as tmp:
        step, model, optimizer, set_rows, info = fvp.build_maximus(model_dir, args.method, args.seq, "off", n * len(policies),
                                                                   Path(tmp), dtype=args.dtype)
        trainer = info["trainer"]
        set_rows(torch.cat([ids] * len(policies)))
        times: dict[str, list[float]] = {k: [] for k in policies}
        i = 0
        for s in range(1, n + 1):
            for name, policy in policies.items():
                apply_checkpointing(trainer.model, policy, micro_batch=1, seq_len=args.seq)
                i += 1
                t = time.perf_counter()
                with trainer.meter.track(trainer.model, trainer.optimizer):
                    trainer.train_step(i)
                if s > args.warmup:
                    times[name].append(time.perf_counter() - t)
    dtype = "fp32" if args.dtype == "fp32" else "bf16"
    print(f"\n{args.method}, seq {args.seq}, {dtype}, {args.threads} threads, {args.steps} steps per plan "
          f"(interleaved)\n\n| plan | predicted step s | measured step s (median, range) | predicted / measured "
          "| predicted rank | measured rank |\n|---|---:|---:|---:|---:|---:|")
    pred = {}
    for name in policies:
        gc = {"4/8 layers": 4}.get(name, name)
        e = estimate_peak(REFERENCE_CONFIG, method=args.method, dtype=dtype, seq_len=args.seq, checkpointing=gc,
                          device="cpu")
        pred[name] = args.seq / e.tokens_per_s_guess
    meas = {k: statistics.median(v) for k, v in times.items()}
    prank = {k: r for r, k in enumerate(sorted(pred, key=pred.get), 1)}
    mrank = {k: r for r, k in enumerate(sorted(meas, key=meas.get), 1)}
    for name in policies:
        print(f"| {name} | {pred[name]:.2f} | {meas[name]:.2f} ({min(times[name]):.2f}-{max(times[name]):.2f}) | "
              f"{pred[name] / meas[name]:.2f} | {prank[name]} | {mrank[name]} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("calibrate", "plans"))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--method", default="qlora", choices=("qlora", "lora"))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    {"calibrate": calibrate, "plans": plans}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
