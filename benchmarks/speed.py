"""Training speed of one QLoRA / LoRA step on the reference model: Maximus vs Transformers + PEFT
(+ bitsandbytes), side by side, with model-FLOPs utilisation (issue 9).

Model: the ANCHORS.md reference Llama (`_reference_model.py`: vocab 128,256, hidden 512, 8 layers),
LoRA r=16 on every linear layer, batch 1, seq 2048, bf16 autocast, AdamW; the exact loss on our side
(`optimization.loss: exact`, gradient checkpointing off on both sides). The two recipes are
`finetune_vs_peft.build_maximus` / `build_peft`, each run in its own subprocess, alternating
peer / ours `--repeats` times so that load on the shared machine hits both alike.

Rows are either one 2,048-token document per row (`--doc-len 0`, the ANCHORS protocol) or packed
documents of `--doc-len` tokens (positions restart per document on both sides; the peer gets the
labels Transformers' `DataCollatorWithFlattening` would give: -100 at each document start).

MFU = model FLOPs per step / (median step wall time x the bf16 matmul rate measured in the same
run, same thread count, on a 2048^3 matmul). Model FLOPs per token, for a frozen base (QLoRA/LoRA):
``4 x matmul params`` (forward + input gradient; no weight gradient for frozen weights)
``+ 6 x LoRA params + 3 x attention forward`` where the attention forward is
``4 x (average causal context) x num_heads x head_dim x layers`` and the average context is half the
document length (only the FLOPs a document needs are counted, whatever the kernel does).

    python benchmarks/speed.py                       # 2 threads, seq 2048, one document per row + 256-token documents
    python benchmarks/speed.py --quick               # one repeat, one-document rows only
    python benchmarks/speed.py --method lora --doc-len 0

On a CUDA GPU (the prepared device check `benchmarks/gpu.sh` runs this): ``--device cuda --shape 8b``
takes a Llama-3-8B-shaped model (random weights, built on the GPU and saved once), times each step
between `torch.cuda.synchronize()` calls, measures the matmul rate on an 8192^3 bf16 product, and
adds each side's peak allocated GPU memory during its steps (`torch.cuda.max_memory_allocated`,
weights included). ``--kernels`` picks our `optimization.kernels` (auto = Triton on CUDA).

    python benchmarks/speed.py --device cuda --shape 8b --quick
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def matmul_rate(threads: int, n: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """Best-of-`repeats` bf16 matmul rate in FLOP/s at `threads` threads (n x n x n; 8192 on CUDA)."""
    import torch

    torch.set_num_threads(threads)
    n = 8192 if device == "cuda" else n
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def sync(device: str) -> None:
    """Wait for queued GPU work, so wall-clock times cover it (no-op on CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def model_flops_per_token(config: dict, seq: int, doc_len: int, lora_r: int) -> float:
    """Useful FLOPs per trained token of a frozen-base LoRA step (see the module docstring)."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i
    matmul = layers * per_layer + config["vocab_size"] * h  # + the output head
    lora_in_out = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, i), (h, i), (i, h)]
    lora = layers * sum(lora_r * (a + b) for a, b in lora_in_out)
    doc = doc_len or seq
    attention_fwd = 4 * (doc / 2) * heads * d * layers
    return 4 * matmul + 6 * lora + 3 * attention_fwd


def synthetic_rows(n_rows: int, seq: int, vocab: int, doc_len: int):
    """(input_ids [n, seq], position_ids [n, seq]) the same for both sides."""
    import torch

    from finetune_vs_peft import synthetic_ids

    ids = synthetic_ids(n_rows, seq, vocab)
    doc = doc_len or seq
    pos = (torch.arange(seq) % doc).expand(n_rows, -1).contiguous()
    return ids, pos


def worker(args) -> dict:
    import torch

    import finetune_vs_peft as fvp
    from _reference_model import SHAPES, shaped_model_dir

    torch.set_num_threads(args.threads)
    rate = matmul_rate(args.threads, device=args.device)  # per worker, next to its steps: the load changes
    model_dir = shaped_model_dir(args.shape, args.model_dir, args.device)
    n_rows = args.warmup + args.steps
    ids, pos = synthetic_rows(n_rows, args.seq, SHAPES[args.shape]["vocab_size"], args.doc_len)
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        if args.impl == "maximus":
            step, model, optimizer, set_rows, info = fvp.build_maximus(model_dir, args.method, args.seq, "off", n_rows,
                                                                       Path(tmp), train_mode=True, device=args.device,
                                                                       kernels=args.kernels)
            set_rows(ids, pos.tolist())
            kernels = info["kernels"]
        else:
            model, optimizer, kernels = _peft(model_dir, args.method, args.device)
            step = _peft_step(model, optimizer, ids.to(args.device), pos.to(args.device), args.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        losses, times, cpu = [], [], []
        for i in range(1, n_rows + 1):
            sync(args.device)
            t0, c0 = time.perf_counter(), time.process_time()
            losses.append(step(i))
            sync(args.device)
            if i > args.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        peak = torch.cuda.max_memory_allocated() if cuda else None
    predicted = None
    if cuda and args.impl == "maximus":  # the planner's estimate of this very step, to check it on a GPU
        from maximus.memory import estimate_peak

        predicted = estimate_peak(SHAPES[args.shape], method=args.method, seq_len=args.seq, checkpointing="off",
                                  loss_mode="exact", device="cuda").peak_bytes
    return {"impl": args.impl, "step_s": times, "cpu_s": cpu, "losses": losses, "kernels": kernels,
            "threads": torch.get_num_threads(), "peak_bytes": peak, "predicted_peak_bytes": predicted,
            "rate": max(rate, matmul_rate(args.threads, device=args.device))}


def _peft(model_dir: Path, method: str, device: str):
    import finetune_vs_peft as fvp

    _, model, optimizer, _, _ = fvp.build_peft(model_dir, method, device)
    return model, optimizer, {"attention": model.config._attn_implementation}


def _peft_step(model, optimizer, ids, pos, device: str):
    import torch

    def step(i: int) -> float:
        row, p = ids[i - 1:i], pos[i - 1:i]
        labels = row.clone()
        labels[p == 0] = -100  # DataCollatorWithFlattening: no target across a document start
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=row, position_ids=p, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def run_worker(impl: str, doc_len: int, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--impl", impl, "--method", args.method,
           "--seq", str(args.seq), "--doc-len", str(doc_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--device", args.device, "--shape", args.shape, "--kernels", args.kernels]
    if args.model_dir:
        cmd += ["--model-dir", str(args.model_dir)]
    from finetune_vs_peft import launch_worker

    result = launch_worker(cmd, args.threads, args.worker_timeout, f"{impl} doc {doc_len}")
    print(f"  {impl:<8} doc {doc_len or args.seq:>5}: steps {[round(t, 2) for t in result['step_s']]} s, "
          f"loss {result['losses'][0]:.4f}", file=sys.stderr, flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one repeat, one-document rows only, 1 warm-up + 2 steps")
    p.add_argument("--method", choices=("qlora", "lora"), default="qlora")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--doc-lens", type=int, nargs="+", default=[0, 256], help="0 = one document per row")
    p.add_argument("--repeats", type=int, default=2, help="alternating peer/ours runs per setting")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--shape", choices=("reference", "8b"), default="reference",
                   help="reference = ANCHORS.md's model; 8b = Llama-3-8B's shape (GPU)")
    p.add_argument("--kernels", choices=("auto", "triton", "compile", "eager"), default="auto",
                   help="our optimization.kernels")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker-timeout", type=int, default=1200)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=("maximus", "peft"), help=argparse.SUPPRESS)
    p.add_argument("--doc-len", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    if args.quick:
        args.repeats, args.doc_lens, args.steps = 1, [0], 2

    from _reference_model import SHAPES, shaped_model_dir

    t0 = time.perf_counter()
    shaped_model_dir(args.shape, args.model_dir, args.device)  # built once, before the workers time anything
    print(f"model {args.shape}: ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rate = matmul_rate(args.threads, device=args.device)
    where = "CUDA" if args.device == "cuda" else f"{args.threads} threads"
    print(f"bf16 matmul rate, {where}: {rate / 1e9:.0f} GFLOP/s", file=sys.stderr)
    rows = []
    for doc_len in args.doc_lens:
        runs = {"peft": [], "maximus": []}
        for _ in range(args.repeats):
            for impl in ("peft", "maximus"):
                runs[impl].append(run_worker(impl, doc_len, args))
        flops = model_flops_per_token(SHAPES[args.shape], args.seq, doc_len, 16) * args.seq
        summary = {}
        for impl, results in runs.items():
            steps = [t for r in results for t in r["step_s"]]
            cpu = [t for r in results for t in r["cpu_s"]]
            med = statistics.median(steps)
            # MFU against the best matmul rate seen anywhere in this run (the machine's capability).
            peak = max([rate] + [r["rate"] for rs in runs.values() for r in rs])
            summary[impl] = {"tokens_per_s": args.seq / med, "tokens_per_cpu_s": args.seq / statistics.median(cpu),
                             "mfu": flops / med / peak, "loss": results[0]["losses"][0], "step_s": med,
                             "kernels": results[0]["kernels"], "peak_rate": peak,
                             "peak_bytes": max((r["peak_bytes"] or 0) for r in results) or None,
                             "predicted_peak_bytes": results[0].get("predicted_peak_bytes")}
        rows.append((doc_len, summary))
    rate = max(s["peak_rate"] for _, summary in rows for s in summary.values())
    where = "on CUDA" if args.device == "cuda" else f"at {args.threads} threads"
    print(f"\nbf16 matmul rate (best seen) {rate / 1e9:,.0f} GFLOP/s {where}; {args.shape} shape, {args.method}, "
          f"seq {args.seq}, {args.repeats} x ({args.warmup} warm-up + {args.steps} steps) per side\n")
    cuda = args.device == "cuda"
    # On CUDA the CPU time says little; the peak GPU memory of the steps takes its columns.
    extra = ("peak GPU memory GiB", lambda s: s["peak_bytes"] / 2**30) if cuda else \
        ("tokens/CPU-s", lambda s: s["tokens_per_cpu_s"])
    print(f"| documents per row | implementation | step s (median) | tokens/s | ratio | {extra[0]} | ratio | MFU | step-1 loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for doc_len, summary in rows:
        peer = summary["peft"]
        docs = f"1 x {args.seq}" if not doc_len else f"{args.seq // doc_len} x {doc_len}"
        for impl in ("peft", "maximus"):
            s = summary[impl]
            name = "Transformers + PEFT" + (" + bnb" if args.method == "qlora" else "") if impl == "peft" else "Maximus"
            value, base = extra[1](s), extra[1](peer)
            print(f"| {docs} | {name} | {s['step_s']:.2f} | {s['tokens_per_s']:,.0f} | {s['tokens_per_s'] / peer['tokens_per_s']:.2f}x | "
                  f"{value:,.1f} | {value / base:.2f}x | {s['mfu']:.1%} | {s['loss']:.4f} |")
    for doc_len, summary in rows:
        ours = summary["maximus"]
        if ours.get("predicted_peak_bytes") and ours.get("peak_bytes"):
            print(f"\nplanner check ({doc_len or args.seq}-token documents): predicted peak "
                  f"{ours['predicted_peak_bytes'] / 2**30:.2f} GiB, measured {ours['peak_bytes'] / 2**30:.2f} GiB "
                  f"({ours['predicted_peak_bytes'] / ours['peak_bytes'] - 1:+.1%})")
    if args.json:
        args.json.write_text(json.dumps({"rate": rate, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
