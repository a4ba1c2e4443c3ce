"""Training speed of one QLoRA / LoRA step on the reference model: Maximus vs Transformers + PEFT
(+ bitsandbytes), side by side, with model-FLOPs utilisation (issues 9, 23).

Model: the reference Llama (docs/benchmarks/reference.md) (`_reference_model.py`: vocab 128,256, hidden 512, 8 layers),
LoRA r=16 on every linear layer, batch 1, seq 2048, AdamW. Our side runs `maximus-train`'s default
config (`finetune_vs_peft.build_maximus`): no target_vram (the plan fits the free memory),
`gradient_checkpointing: auto`, the exact loss, every step under the memory meter as the trainer's
loop runs it. Any other variant is named in its row (`--variants meter-off checkpointing-off
checkpointing-full`, `--target-vrams 1.1GB ...` for budgets that force recompute).

dtype: `--dtypes auto` (default) picks what `training.dtype: auto` picks (`resolve_dtype`: bf16
only where the device runs it natively, else fp32); `--dtypes fp32 bf16` measures both. The peer
runs in the same dtype (fp32 weights, or bf16 weights with bf16 autocast and fp32 adapters).

Each setting runs in one subprocess holding both sides: rounds of one peer step and one of ours,
the order flipping every round, so load on the shared machine hits both alike; the ratio (peer
step time / ours) is taken within each round and reported as median (range).

Rows are either one 2,048-token document per row (`--doc-lens 0`, the reference protocol) or packed
documents of `--doc-len` tokens (positions restart per document on both sides; the peer gets the
labels Transformers' `DataCollatorWithFlattening` would give: -100 at each document start).

MFU = model FLOPs per step / (median step wall time x the matmul rate in the step's dtype measured
in the same run, same thread count, on a 2048^3 matmul). Model FLOPs per token, for a frozen base:
``4 x matmul params`` (forward + input gradient; no weight gradient for frozen weights)
``+ 6 x LoRA params + 3 x attention forward`` where the attention forward is
``4 x (average causal context) x num_heads x head_dim x layers`` and the average context is half the
document length (only the FLOPs a document needs are counted, whatever the kernel does). The CPU's
bf16 capability (`resolve_dtype`'s verdict and the CPU flags) is printed with the table.

    python benchmarks/speed.py                                  # auto dtype, QLoRA + LoRA, 1 x 2048 and 8 x 256
    python benchmarks/speed.py --dtypes fp32 bf16               # both dtypes (bf16 is slow where emulated)
    python benchmarks/speed.py --quick                          # QLoRA, one-document rows, 2 rounds
    python benchmarks/speed.py --methods qlora --doc-lens 0 --target-vrams 1.1GB 0.9GB

On a CUDA GPU (the prepared device check `benchmarks/gpu.sh` runs this): ``--device cuda --shape 8b``
takes a Llama-3-8B-shaped model (random weights, built on the GPU and saved once, in a child process
of its own), times each step between `torch.cuda.synchronize()` calls and measures the matmul rate
on an 8192^3 product. Each side runs in its own process (ours first, then the peer; ratios pair
their steps in order), so each side's peak allocated GPU memory (`torch.cuda.max_memory_allocated`
over all its steps, its own weights included, nothing of the other side's) is honest; the planner's
predicted peak for our step stands beside our measured one. ``--time-budget-s`` bounds the whole
run: each child's timeout is what is left of it (a timed-out or failed child is one row's failure,
printed with its stderr tail), and rows are written to ``--json`` as they finish.
``--kernels`` picks our `optimization.kernels` (auto = Triton on CUDA).

    python benchmarks/speed.py --device cuda --shape 8b --quick --dtypes bf16 --time-budget-s 260
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def matmul_rate(threads: int, n: int = 2048, repeats: int = 5, device: str = "cpu", dtype: str = "bf16") -> float:
    """Best-of-`repeats` matmul rate in FLOP/s at `threads` threads (n x n x n; 8192 on CUDA), in
    ``dtype`` (``bf16`` or ``fp32``): the rate the steps of that dtype can reach."""
    import torch

    torch.set_num_threads(threads)
    n = 8192 if device == "cuda" else n
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(n, n, dtype=dt, device=device)
    b = torch.randn(n, n, dtype=dt, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def bf16_capability(device: str = "cpu") -> str:
    """What the device offers for bf16: `resolve_dtype`'s verdict and, on a CPU, the flags behind it."""
    import torch

    from maximus.device import bf16_supported

    native = bf16_supported(torch.device(device))
    if device != "cpu":
        return f"bf16 {'native' if native else 'not native'} on {device}"
    from _machine import cpu_flags

    flags = cpu_flags()
    have = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in flags]
    return f"bf16 {'native' if native else 'emulated'} (CPU flags: {', '.join(have) or 'unknown'})"


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


def preflight(side: str | None) -> None:
    """Import what the worker's side(s) will need, before any model is built or loaded: a missing
    module fails in seconds (also in the dry run of `gpu.sh`), not after minutes of loading."""
    import finetune_vs_peft  # noqa: F401
    if side in (None, "maximus"):
        from maximus import Config, Trainer  # noqa: F401
    if side in (None, "peft"):
        import bitsandbytes  # noqa: F401
        import peft  # noqa: F401
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: F401


def worker(args) -> dict:
    """One setting. CPU: both sides in this process, rounds of one peer step and one of ours (the
    order flips every round), so load on a shared machine hits both alike; ratios are taken per
    round. CUDA (``--side``): one side in this process, its peak over all its steps."""
    import torch

    import finetune_vs_peft as fvp
    from _cuda_peak import RunPeak
    from _reference_model import SHAPES, shaped_model_dir, shaped_model_path

    preflight(args.side)
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    names = [args.side] if args.side else ["peft", "maximus"]
    # CUDA: the driver's build child made the model. Ours is set up before anything else touches
    # the GPU, so a dry run checks its config and stops at the trainer's own device check.
    model_dir = shaped_model_path(args.shape, args.model_dir) if cuda else \
        shaped_model_dir(args.shape, args.model_dir, args.device)
    n_rows = args.warmup + args.steps
    ids, pos = synthetic_rows(n_rows, args.seq, SHAPES[args.shape]["vocab_size"], args.doc_len)
    sides, kernels, plan = {}, {}, None
    with tempfile.TemporaryDirectory() as tmp:
        if "maximus" in names:
            ours, _, _, set_rows, info = fvp.build_maximus(model_dir, args.method, args.seq, args.checkpointing,
                                                           n_rows, Path(tmp), device=args.device, kernels=args.kernels,
                                                           dtype=args.dtype, meter=not args.no_meter,
                                                           target_vram=args.target_vram)
            set_rows(ids, pos.tolist())
            trainer = info["trainer"]
            plan = {"checkpointing": info["checkpointing"], "loss_chunk": trainer.plan.loss_chunk_size,
                    "budget_bytes": trainer.plan.budget_bytes, "predicted_peak_bytes": trainer.plan.peak_bytes,
                    "predicted_step_s": args.seq / trainer.plan.tokens_per_s_guess
                    if trainer.plan.tokens_per_s_guess else None}
            sides["maximus"], kernels["maximus"] = ours, info["kernels"]
        rate = matmul_rate(args.threads, device=args.device, dtype=args.dtype)
        if "peft" in names:
            model, optimizer, kernels["peft"] = _peft(model_dir, args.method, args.device, args.dtype)
            sides["peft"] = _peft_step(model, optimizer, ids.to(args.device), pos.to(args.device), args.device,
                                       args.dtype)
        times = {k: [] for k in sides}
        losses = {k: [] for k in sides}
        with RunPeak() if cuda and len(sides) == 1 else contextlib.nullcontext() as run_peak:
            for i in range(1, n_rows + 1):
                order = ("peft", "maximus") if i % 2 else ("maximus", "peft")
                for impl in (name for name in order if name in sides):
                    sync(args.device)
                    t0 = time.perf_counter()
                    losses[impl].append(sides[impl](i))
                    sync(args.device)
                    if i > args.warmup:
                        times[impl].append(time.perf_counter() - t0)
    return {"step_s": times, "losses": losses, "plan": plan, "kernels": kernels,
            "bf16_capability": bf16_capability(args.device),
            "peak_bytes": {names[0]: run_peak.peak_bytes} if run_peak else None, "threads": torch.get_num_threads(),
            "rate": max(rate, matmul_rate(args.threads, device=args.device, dtype=args.dtype))}


def _peft(model_dir: Path, method: str, device: str, dtype: str):
    import finetune_vs_peft as fvp

    _, model, optimizer, _, _ = fvp.build_peft(model_dir, method, device, dtype)
    return model, optimizer, {"attention": model.config._attn_implementation}


def _peft_step(model, optimizer, ids, pos, device: str, dtype: str):
    import torch

    def step(i: int) -> float:
        row, p = ids[i - 1:i], pos[i - 1:i]
        labels = row.clone()
        labels[p == 0] = -100  # DataCollatorWithFlattening: no target across a document start
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(input_ids=row, position_ids=p, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def worker_command(setting: dict, args, side: str | None) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--method", setting["method"],
           "--dtype", setting["dtype"], "--seq", str(args.seq), "--doc-len", str(setting["doc_len"]),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--device", args.device, "--shape", args.shape, "--kernels", args.kernels,
           "--checkpointing", setting.get("checkpointing", "auto")]
    if side:
        cmd += ["--side", side]
    if setting.get("target_vram"):
        cmd += ["--target-vram", setting["target_vram"]]
    if setting.get("no_meter"):
        cmd.append("--no-meter")
    if args.model_dir:
        cmd += ["--model-dir", str(args.model_dir)]
    return cmd


#: CUDA: the seconds kept for the peer's process while ours runs (its timeout is the rest of the budget).
PEER_KEEP_S = 75


def run_worker(setting: dict, args, deadline) -> dict:
    """One setting: CPU, both sides in one worker; CUDA, ours then the peer, each in its own
    worker (the peer runs even when ours failed, and its numbers go into the failure's message),
    merged into one result (steps paired in order). Raises `_child.ChildFailed` (a RuntimeError)
    or `_child.DryStop`."""
    from _child import ChildFailed, DryStop
    from finetune_vs_peft import launch_worker

    label = setting_label(setting, args.seq)
    if args.device != "cuda":
        result = launch_worker(worker_command(setting, args, None), args.threads,
                               deadline.child_timeout(args.worker_timeout), label)
    else:
        parts, stops, failures = {}, [], []
        for side, keep in (("maximus", PEER_KEEP_S), ("peft", 0)):
            try:
                parts[side] = launch_worker(worker_command(setting, args, side), args.threads,
                                            deadline.child_timeout(args.worker_timeout, keep), f"{label} {side}")
            except DryStop as stop:  # the dry run goes on to the other side's worker
                print(f"  {stop}", file=sys.stderr, flush=True)
                stops.append(stop)
            except ChildFailed as exc:
                failures.append(str(exc))
        if failures:
            done = [f"{side}: steps {[round(t, 2) for t in r['step_s'][side]]} s, peak "
                    f"{r['peak_bytes'][side] / 2**30:.2f} GiB" for side, r in parts.items()]
            raise ChildFailed("\n".join(failures + done))
        if stops:
            raise stops[-1]
        ours, peer = parts["maximus"], parts["peft"]
        result = {key: {**peer[key], **ours[key]} for key in ("step_s", "losses", "kernels", "peak_bytes")}
        result.update(plan=ours["plan"], threads=ours["threads"], rate=max(ours["rate"], peer["rate"]),
                      bf16_capability=ours["bf16_capability"])
    print(f"  {label}: peer {[round(t, 2) for t in result['step_s']['peft']]} s, "
          f"ours {[round(t, 2) for t in result['step_s']['maximus']]} s ({result['plan']['checkpointing']}), "
          f"loss {result['losses']['peft'][0]:.4f} / {result['losses']['maximus'][0]:.4f}", file=sys.stderr, flush=True)
    return result


def setting_label(s: dict, seq: int) -> str:
    docs = f"1 x {seq}" if not s["doc_len"] else f"{seq // s['doc_len']} x {s['doc_len']}"
    variant = "default config"
    if s.get("target_vram"):
        variant = f"target_vram {s['target_vram']}"
    elif s.get("checkpointing", "auto") != "auto":
        variant = f"gradient_checkpointing {s['checkpointing']}"
    if s.get("no_meter"):
        variant += ", meter off"
    return f"{s['dtype']} {s['method']} {docs} [{variant}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="QLoRA, one-document rows only, 1 warm-up + 2 rounds")
    p.add_argument("--methods", nargs="+", choices=("qlora", "lora"), default=["qlora", "lora"])
    p.add_argument("--method", choices=("qlora", "lora"), default=None, help="one method (same as --methods M)")
    p.add_argument("--dtypes", nargs="+", choices=("auto", "fp32", "bf16"), default=["auto"],
                   help="auto = what training.dtype: auto picks here (bf16 only where native); both sides alike")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--doc-lens", type=int, nargs="+", default=[0, 256], help="0 = one document per row")
    p.add_argument("--target-vrams", nargs="*", default=[],
                   help="also run our side under these budgets (e.g. 1.1GB), to show each plan's speed")
    p.add_argument("--variants", nargs="*", default=[], choices=("meter-off", "checkpointing-off", "checkpointing-full"),
                   help="named non-default variants of our side")
    p.add_argument("--steps", type=int, default=3, help="measured rounds (one step per side each)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--shape", choices=("reference", "8b"), default="reference",
                   help="reference = the model of docs/benchmarks/reference.md; 8b = Llama-3-8B's shape (GPU)")
    p.add_argument("--kernels", choices=("auto", "triton", "compile", "eager"), default="auto",
                   help="our optimization.kernels")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker-timeout", type=int, default=1800, help="seconds before a worker is killed (one row fails)")
    p.add_argument("--build-timeout", type=int, default=120, help="cuda: seconds for the child that builds the model")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="the whole run's seconds: no child's timeout reaches past it")
    p.add_argument("--side", choices=("maximus", "peft"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bf16", help=argparse.SUPPRESS)
    p.add_argument("--doc-len", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--target-vram", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-meter", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.method:
        args.methods = [args.method]
    if args.worker:
        from finetune_vs_peft import compute_dtype

        args.method = args.methods[0] if not args.method else args.method
        args.dtype = compute_dtype(args.dtype, args.device)
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    if args.quick:
        args.doc_lens, args.steps, args.methods = [0], 2, [args.method or "qlora"]

    from _child import ChildFailed, Deadline, DryStop, host_memory_line, run_child
    from _reference_model import SHAPES, shaped_model_dir

    cuda = args.device == "cuda"
    deadline = Deadline(args.time_budget_s)
    print(host_memory_line(), file=sys.stderr, flush=True)
    # On CUDA this process never touches the GPU (no context, no cached blocks beside the workers):
    # `auto` is resolved by each worker, and the model is built in a child of its own.
    if not cuda:
        from finetune_vs_peft import compute_dtype

        args.dtypes = [compute_dtype(d, args.device) for d in args.dtypes]
    dtypes = list(dict.fromkeys(args.dtypes))
    t0 = time.perf_counter()
    if cuda:
        build = [sys.executable, str(HERE / "_reference_model.py"), "--shape", args.shape, "--device", args.device]
        try:
            build_s = run_child(build + (["--cache-dir", str(args.model_dir)] if args.model_dir else []),
                                deadline.child_timeout(args.build_timeout), f"model {args.shape}")["build_s"]
            print(f"model {args.shape}: ready in {build_s:.0f} s", file=sys.stderr, flush=True)
        except DryStop as stop:  # the dry run goes on to the workers
            print(f"  {stop}", file=sys.stderr, flush=True)
        except ChildFailed as exc:
            print(f"model {args.shape}: {exc}", file=sys.stderr, flush=True)
            return 1
    else:
        shaped_model_dir(args.shape, args.model_dir, args.device)  # built once, before the workers time anything
        print(f"model {args.shape}: ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print(bf16_capability(args.device), file=sys.stderr)
    settings = []
    for dtype in dtypes:
        for method in args.methods:
            for doc_len in args.doc_lens:
                base = {"dtype": dtype, "method": method, "doc_len": doc_len}
                settings.append(base)
                for v in args.variants:
                    settings.append({**base, **{"meter-off": {"no_meter": True},
                                                "checkpointing-off": {"checkpointing": "off"},
                                                "checkpointing-full": {"checkpointing": "full"}}[v]})
                for budget in args.target_vrams:
                    settings.append({**base, "target_vram": budget})
    results, failed = [], 0
    for s in settings:
        try:
            results.append((s, run_worker(s, args, deadline)))
        except DryStop:  # run_worker printed where each side stopped
            pass
        except RuntimeError as exc:  # a timeout, a budget nothing fits: one row's failure, the others go on
            failed += 1
            print(f"  {setting_label(s, args.seq)}: failed: {exc}", file=sys.stderr, flush=True)
        if args.json:  # written as rows finish: a timeout of the whole run keeps the finished ones
            args.json.write_text(json.dumps([{"setting": s, **r} for s, r in results], indent=1))
    where = "on CUDA" if cuda else f"at {args.threads} threads"
    rates = {}
    for s, r in results:
        rates[s["dtype"]] = max(rates.get(s["dtype"], 0), r["rate"])
    capability = results[0][1]["bf16_capability"] if results else bf16_capability("cpu") if not cuda else "no rows"
    print(f"\n{capability}; matmul rate (best seen) {where}: "
          + ", ".join(f"{d} {v / 1e9:,.0f} GFLOP/s" for d, v in rates.items())
          + f"; {args.shape} shape, seq {args.seq}, {args.warmup} warm-up + {args.steps} rounds "
          + ("(each side in its own process, ours first; ratios pair their steps in order)\n" if cuda else
             "(one peer step and one of ours per round, order alternating)\n"))
    extra = "| tokens/s peer / ours | peak GPU GiB peer / ours | predicted peak GiB ours (error) " if cuda else ""
    print("| dtype | method | documents per row | our config (plan) | peer step s | our step s | "
          "ratio, median (range) | MFU peer / ours | step-1 loss peer / ours " + extra + "|")
    print("|---|---|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if cuda else ""))
    for s, r in results:
        flops = model_flops_per_token(SHAPES[args.shape], args.seq, s["doc_len"], 16) * args.seq
        peer, ours = r["step_s"]["peft"], r["step_s"]["maximus"]
        ratios = [a / b for a, b in zip(peer, ours)]
        mp, mo = statistics.median(peer), statistics.median(ours)
        rate = rates[s["dtype"]]
        label = setting_label(s, args.seq)
        variant = label[label.index("[") + 1:-1]
        plan = r["plan"]["checkpointing"] + (f", chunk {r['plan']['loss_chunk']}" if r["plan"]["loss_chunk"] else "")
        docs = f"1 x {args.seq}" if not s["doc_len"] else f"{args.seq // s['doc_len']} x {s['doc_len']}"
        row = (f"| {s['dtype']} | {'QLoRA' if s['method'] == 'qlora' else 'LoRA'} | {docs} | {variant} ({plan}) | "
               f"{mp:.2f} | {mo:.2f} | **{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) | "
               f"{flops / mp / rate:.0%} / {flops / mo / rate:.0%} | "
               f"{r['losses']['peft'][0]:.4f} / {r['losses']['maximus'][0]:.4f} |")
        if cuda:
            peaks, predicted = r["peak_bytes"], r["plan"]["predicted_peak_bytes"]
            error = f"{predicted / 2**30:.2f} ({predicted / peaks['maximus'] - 1:+.1%})" if predicted else "none"
            row += (f" {args.seq / mp:,.0f} / {args.seq / mo:,.0f} | {peaks['peft'] / 2**30:.2f} / "
                    f"{peaks['maximus'] / 2**30:.2f} | {error} |")
        print(row)
    return 1 if failed else 0


if __name__ == "__main__":
    from _child import guarded_main

    sys.exit(guarded_main(main))
