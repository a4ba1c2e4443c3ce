"""The same fine-tune step on the reference model: Maximus vs plain Transformers + PEFT (+ bitsandbytes).

Model: the reference Llama (docs/benchmarks/reference.md) (vocab 128,256, hidden 512, 8 layers; see
`_reference_model.py`), random weights. Step: batch 1, one packed row of `seq` random token ids
(labels = inputs), LoRA r=16 / alpha 32 on every linear layer (PEFT `all-linear`), torch AdamW
lr 2e-4, fp32 adapters. dtype (`--dtype auto`): what `training.dtype: auto` picks on this machine
(`resolve_dtype`: bf16 where native, else fp32), the same on both sides (bf16: bf16 weights and
autocast). QLoRA loads the base in bitsandbytes 4-bit NF4 with double quantisation and runs PEFT's
`prepare_model_for_kbit_training` (both sides).

* (a) Maximus: `maximus-train`'s default config (no target_vram: the plan fits the free memory;
  `gradient_checkpointing: auto`; the exact chunked loss), `trainer.setup()`, then
  `trainer.train_step(step)` under the trainer's memory meter on synthetic rows. Other variants
  (`--variants off full`: checkpointing forced) are named in their rows.
* (b) peer: `model(input_ids, labels=labels).loss.backward()` + `AdamW.step()`.

Each (implementation, setting) runs in a fresh subprocess (`--worker`), so the two never share
allocator state; a round is one peer run then one of ours, and speed ratios are taken within a
round (median and range over `--rounds`). The bf16 capability and the matmul rate in the run's
dtype are printed with the tables. Per run:

* training memory growth: peak process RSS during warm-up + measured steps minus RSS right after
  the model, adapter and optimizer were built (peak via VmHWM, reset with /proc/self/clear_refs
  after a malloc_trim, so both sides start from a trimmed heap);
* peak live tensor bytes of the warm-up step(s), from `maximus.memory.meter.MemoryMeter` (CPU
  storage tracker), and their growth over the tensors alive before (weights, optimizer state).
  Warm-up is not timed, so the tracker's Python work per op does not touch the speed numbers;
* tokens/CPU-s: tokens over the process CPU time of a step, far less load-sensitive than wall time;
* tokens/s: median over the measured steps; the loss of the first step (same data, same init),
  which shows both sides compute the same loss.

    python benchmarks/finetune_vs_peft.py --quick            # QLoRA seq 512 + 2048, 1 round, 1 warm-up + 3 steps
    python benchmarks/finetune_vs_peft.py                    # LoRA and QLoRA, seq 512 + 2048, 1 + 5 steps
    python benchmarks/finetune_vs_peft.py --quick --profile  # + top ops of one step of each side (QLoRA, longest seq)
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

QUICK_SETTINGS = [("qlora", 512), ("qlora", 2048)]
FULL_SETTINGS = [("lora", 512), ("lora", 2048), ("qlora", 512), ("qlora", 2048)]
#: (implementation, gradient checkpointing) rows per setting: the peer (no checkpointing) and
#: `maximus-train`'s default (`auto`: the plan fitted to the free memory). `--variants off full`
#: adds our side with checkpointing forced, named as such.
RUNS = [("peft", "off"), ("maximus", "auto")]
LORA = dict(r=16, alpha=32.0, dropout=0.0)
LEARNING_RATE = 2e-4
DATA_SEED = 1234


# ------------------------------------------------------------------------------------- memory
def _status_bytes(field: str) -> int:
    """A `VmRSS` / `VmHWM` line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim_and_reset_peak() -> int:
    """Return freed heap to the OS, restart the peak-RSS window, and return the RSS now (bytes)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the baseline is then a little higher
        pass
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return _status_bytes("VmRSS")


# ------------------------------------------------------------------------------------- data
def synthetic_ids(n_rows: int, seq: int, vocab: int):
    """`n_rows` rows of `seq` random token ids in [0, vocab), the same for both sides."""
    import torch

    g = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(0, vocab, (n_rows, seq), generator=g)


# ------------------------------------------------------------------------------------- the two sides
def compute_dtype(name: str = "auto", device: str = "cpu") -> str:
    """``fp32`` or ``bf16``: `auto` resolved the way `maximus.device.resolve_dtype` resolves
    `training.dtype: auto` (bf16 only where the device runs it natively), so the peer runs in
    what `maximus-train` would pick."""
    import torch

    from maximus.device import resolve_dtype

    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(resolve_dtype(name, torch.device(device)), "fp32")


def build_maximus(model_dir: Path, method: str, seq: int, checkpointing: str, total_steps: int, work: Path,
                  train_mode: bool = False, device: str = "cpu", kernels: str = "auto", dtype: str = "bf16",
                  meter: bool = True, target_vram: str | None = None):
    """A set-up Maximus trainer; returns (step(i) -> loss, model, optimizer, set_rows(ids), info).

    `maximus-train`'s default config (no target_vram, ``gradient_checkpointing: auto``, the exact
    loss) except what the arguments name; ``meter=True`` runs each step under the memory meter, as
    the trainer's loop does. ``info["trainer"]`` is the trainer."""
    import torch

    from maximus import Config, Trainer

    data = work / "tiny.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} for the tokenizer and packer"}) + "\n" for i in range(8)))
    optimization = {"gradient_checkpointing": checkpointing, "loss": "exact", "kernels": kernels}
    if target_vram is not None:
        optimization["target_vram"] = target_vram
    cfg = Config.from_dict({
        "model": str(model_dir), "dataset": str(data), "method": method, "device": device,
        "output_dir": str(work / "run"),
        "lora": {"r": LORA["r"], "alpha": LORA["alpha"], "dropout": LORA["dropout"], "target_modules": "all-linear"},
        "optimization": optimization,
        "training": {"batch_size": 1, "micro_batch_size": 1, "seq_len": seq, "max_steps": total_steps,
                     "learning_rate": LEARNING_RATE, "warmup_steps": 0, "scheduler": "constant",
                     "max_grad_norm": None, "dtype": dtype, "optimizer": "adamw"},
        "eval": {"enabled": False}, "logging": {"progress": "none"},
    })
    trainer = Trainer(cfg)
    trainer.setup()
    if train_mode:
        # Redundant since session 1's fix (`Trainer.setup` now calls `model.train()`); kept so the
        # `+train` policies of old command lines still run.
        trainer.model.train()

    def set_rows(ids, positions=None):
        """Rows of token ids, each one document (positions 0..n-1) unless `positions` are given."""
        if positions is None:
            positions = [range(len(r)) for r in ids]
        rows = [{"input_ids": r.tolist(), "labels": r.tolist(), "position_ids": list(p)} for r, p in zip(ids, positions)]
        trainer.data.train = rows
        # rows_for_step picks rows through a seeded permutation; pin row i-1 to step i instead,
        # so both sides see the same rows in the same order.
        order = torch.arange(len(rows))
        trainer._epoch_order = lambda epoch: order

    def step(i: int) -> float:
        if not meter:
            return trainer.train_step(i)["loss"]
        with trainer.meter.track(trainer.model, trainer.optimizer):
            return trainer.train_step(i)["loss"]

    return step, trainer.model, trainer.optimizer, set_rows, {"checkpointing": _checkpointing_summary(trainer),
                                                              "kernels": trainer.kernels.to_dict(), "trainer": trainer}


def _checkpointing_summary(trainer) -> str:
    report = trainer.checkpointing
    modes = getattr(report, "modes", None)
    if modes:
        counts: dict[str, int] = {}
        for m in modes:
            counts[m] = counts.get(m, 0) + 1
        return ", ".join(f"{n}x {m}" for m, n in counts.items())
    return trainer.plan.checkpointing_label


def build_peft(model_dir: Path, method: str, device: str = "cpu", dtype: str = "bf16"):
    """The plain Transformers + PEFT (+ bitsandbytes) recipe; returns the same tuple as build_maximus.
    ``dtype``: ``bf16`` (bf16 weights and autocast, fp32 adapters) or ``fp32`` (everything fp32)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    kwargs: dict = dict(dtype=torch_dtype, attn_implementation="sdpa")
    if method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch_dtype, bnb_4bit_quant_storage=torch.uint8)
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if method != "qlora":
        model.to(device)
    model.config.use_cache = False
    if method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                             target_modules="all-linear", task_type="CAUSAL_LM", bias="none"))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE, weight_decay=0.0)
    rows: list = []

    def set_rows(ids):
        rows[:] = [r.unsqueeze(0) for r in ids]

    def step(i: int) -> float:
        ids = rows[i - 1]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, model, optimizer, set_rows, {"checkpointing": "off"}


# ------------------------------------------------------------------------------------- worker
def top_ops(step, i: int, limit: int = 15) -> list[dict]:
    """Self CPU time of the `limit` costliest ops of one step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(i)
    events = [e for e in prof.key_averages()]
    total = sum(e.self_cpu_time_total for e in events) or 1
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in events[:limit]]


def worker(args) -> dict:
    import torch

    from _reference_model import REFERENCE_CONFIG, reference_model_dir
    from maximus.memory.meter import MemoryMeter

    torch.set_num_threads(args.threads)
    model_dir = reference_model_dir(args.model_dir)
    n_rows = args.warmup + args.steps + (1 if args.profile else 0)
    ids = synthetic_ids(n_rows, args.seq, REFERENCE_CONFIG["vocab_size"])
    t_load = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.impl == "maximus":
            step, model, optimizer, set_rows, info = build_maximus(model_dir, args.method, args.seq, args.checkpointing,
                                                                   n_rows, Path(tmp), train_mode=args.train_mode,
                                                                   dtype=args.dtype, target_vram=args.target_vram)
            info["budget"] = args.target_vram or f"none (free memory {_free_gb()})"
            info = {k: v for k, v in info.items() if k != "trainer"}
        else:
            step, model, optimizer, set_rows, info = build_peft(model_dir, args.method, dtype=args.dtype)
        set_rows(ids)
        load_s = time.perf_counter() - t_load
        base_rss = _trim_and_reset_peak()
        # Warm-up steps run under the live-tensor meter (untimed: the tracker adds Python work per
        # op); the first of them also creates the optimizer state, which the peak then includes.
        # Our measured steps run under the trainer's own meter, as `maximus-train` runs them.
        meter = MemoryMeter("cpu")
        meter.adopt(model, optimizer)
        before_live = meter.current_bytes()
        meter.reset_peak()
        losses, times, cpu_times = [], [], []
        for i in range(1, args.warmup + 1):
            with meter.track(model, optimizer):
                losses.append(step(i))
        for i in range(args.warmup + 1, args.warmup + args.steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            losses.append(step(i))
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        peak_rss = _status_bytes("VmHWM")
        result = {
            "impl": args.impl, "method": args.method, "seq": args.seq, "checkpointing": info["checkpointing"],
            "dtype": args.dtype, "round": args.round,
            "policy": args.checkpointing + (" + train()" if args.train_mode else "")
                      + (f", target_vram {args.target_vram}" if args.target_vram else ""),
            "budget": info.get("budget", "-"), "load_s": load_s, "base_rss": base_rss, "peak_rss": peak_rss,
            "rss_growth": peak_rss - base_rss, "live_before": before_live, "live_peak": meter.peak_bytes(),
            "live_growth": meter.peak_bytes() - before_live, "step_s": times, "cpu_s": cpu_times,
            "tokens_per_s": args.seq / statistics.median(times),
            "tokens_per_cpu_s": args.seq / statistics.median(cpu_times),
            "losses": losses, "threads": torch.get_num_threads(),
        }
        if args.profile:
            result["top_ops"] = top_ops(step, n_rows)
    return result


# ------------------------------------------------------------------------------------- driver
def launch_worker(cmd: list[str], threads: int, timeout: float, label: str) -> dict:
    """Run one `--worker` subprocess and return the JSON it prints after ``RESULT ``. Every worker
    gets exactly ``threads`` OpenMP threads (the trainer would otherwise pick by the machine's
    load), so both sides of a comparison run alike. A timeout, a non-zero exit or no result raises
    `_child.ChildFailed` (a RuntimeError) ending with the worker's stderr tail."""
    from _child import run_child

    return run_child(cmd, timeout, f"worker {label}", env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def run_worker(impl: str, policy: str, method: str, seq: int, args) -> dict:
    train_mode = policy.endswith("+train")
    policy = policy.removesuffix("+train")
    vram = None
    if policy not in ("off", "auto", "full"):  # a target_vram variant: `auto` under that budget
        vram, policy = policy, "auto"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--impl", impl, "--checkpointing", policy,
           "--method", method, "--seq", str(seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--dtype", args.dtype, "--round", str(args.round)]
    if vram:
        cmd += ["--target-vram", vram]
    if args.model_dir:
        cmd += ["--model-dir", str(args.model_dir)]
    if train_mode:
        cmd.append("--train-mode")
    if args.profile and method == "qlora" and seq == max(s for _, s in args.settings) and policy == "off":
        cmd.append("--profile")
    t0 = time.perf_counter()
    result = launch_worker(cmd, args.threads, args.worker_timeout, f"{impl}/{policy} {method} seq {seq}")
    result["wall_s"] = time.perf_counter() - t0
    print(f"  {impl:<8} ckpt {policy:<4} {method} seq {seq}: growth {result['rss_growth'] / 2**20:7.0f} MiB RSS, "
          f"{result['live_growth'] / 2**20:7.0f} MiB live, {result['tokens_per_s']:6.0f} tok/s, "
          f"loss {result['losses'][0]:.4f} ({result['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return result


def _free_gb() -> str:
    import psutil

    return f"{psutil.virtual_memory().available / 1e9:.1f} GB"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def markdown_table(results: list[dict]) -> str:
    rows = ["| method | seq | implementation | grad. ckpt | train memory growth (RSS, MiB) | ratio | "
            "peak live tensors (MiB) | live growth (MiB) | ratio | tokens/s (median) | ratio | tokens/CPU-s | ratio | "
            "step-1 loss |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    peers = {(r["method"], r["seq"], r["round"]): r for r in results if r["impl"] == "peft"}
    for r in results:
        peer = peers.get((r["method"], r["seq"], r["round"]))
        name = "Transformers + PEFT" + (" + bnb" if r["method"] == "qlora" else "") if r["impl"] == "peft" else "Maximus"
        ckpt = r["policy"] if not r["policy"].startswith("auto") else f"{r['policy']} ({r['checkpointing']})"

        def ratio(key):
            if peer is None or r is peer:
                return "1"
            return f"{r[key] / peer[key]:.2f}x" if peer[key] else "-"

        rows.append(f"| {r['method'].upper() if r['method'] != 'qlora' else 'QLoRA'} | {r['seq']} | {name} | {ckpt} | "
                    f"{_mib(r['rss_growth'])} | {ratio('rss_growth')} | {_mib(r['live_peak'])} | {_mib(r['live_growth'])} | "
                    f"{ratio('live_growth')} | {r['tokens_per_s']:,.0f} | {ratio('tokens_per_s')} | "
                    f"{r['tokens_per_cpu_s']:,.0f} | {ratio('tokens_per_cpu_s')} | {r['losses'][0]:.4f} |")
    return "\n".join(rows).replace("| LORA |", "| LoRA |")


def ratio_summary(results: list[dict]) -> str:
    """Per (method, seq, our variant): the tokens/s ratio to the peer of the same round, median (range)."""
    peers = {(r["method"], r["seq"], r["round"]): r for r in results if r["impl"] == "peft"}
    groups: dict[tuple, list[float]] = {}
    for r in results:
        peer = peers.get((r["method"], r["seq"], r["round"]))
        if r["impl"] == "peft" or peer is None:
            continue
        groups.setdefault((r["method"], r["seq"], r["policy"], r["checkpointing"]), []).append(
            r["tokens_per_s"] / peer["tokens_per_s"])
    lines = ["| method | seq | our checkpointing (plan) | tokens/s ratio to the peer, median (range) | rounds |",
             "|---|---:|---|---:|---:|"]
    for (method, seq, policy, plan), ratios in groups.items():
        lines.append(f"| {'QLoRA' if method == 'qlora' else 'LoRA'} | {seq} | {policy} ({plan}) | "
                     f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) | {len(ratios)} |")
    return "\n".join(lines)


def ops_table(result: dict) -> str:
    lines = [f"Top ops of one {result['impl']} step ({result['method']}, seq {result['seq']}), by self CPU time:", "",
             "| op | calls | self ms | share |", "|---|---:|---:|---:|"]
    for op in result["top_ops"]:
        lines.append(f"| `{op['op']}` | {op['calls']} | {op['self_ms']:,.0f} | {op['share']:.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="QLoRA seq 512 and 2048, 1 warm-up + 3 measured steps")
    p.add_argument("--steps", type=int, default=None, help="measured steps per run (default 3 quick, 5 full)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before measuring")
    p.add_argument("--profile", action="store_true", help="also profile one step of each side (QLoRA, longest seq)")
    p.add_argument("--model-dir", type=Path, default=None, help="reference model cache directory")
    p.add_argument("--json", type=Path, default=None, help="also write all results here")
    p.add_argument("--preview-train-fix", action="store_true",
                   help="add a Maximus `auto` row (longest seq) that calls model.train() after setup")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker (default 1: on a shared, oversubscribed CPU a 2-thread region "
                        "waits for whichever thread is descheduled)")
    p.add_argument("--worker-timeout", type=int, default=900, help="seconds before a worker is killed")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="both sides; auto = what training.dtype: auto picks here (bf16 only where native)")
    p.add_argument("--rounds", type=int, default=None, help="peer / ours subprocess pairs per setting (1 quick, 2 full)")
    p.add_argument("--variants", nargs="*", default=[],
                   help="also our side with gradient_checkpointing forced (off, full) or under a target_vram "
                        "(a size such as 0.75GB); named in the rows")
    p.add_argument("--target-vram", default=None, help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    # worker mode (one implementation, one setting, in its own process)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=("maximus", "peft"), help=argparse.SUPPRESS)
    p.add_argument("--method", choices=("lora", "qlora"), help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", choices=("off", "auto", "full"), default="off", help=argparse.SUPPRESS)
    p.add_argument("--train-mode", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.quick else 5
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the memory meter watches the warm-up steps)")
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0

    from _reference_model import reference_model_dir
    from speed import bf16_capability, matmul_rate

    args.dtype = compute_dtype(args.dtype)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    reference_model_dir(args.model_dir)  # build the cache once, before the workers race for it
    args.settings = QUICK_SETTINGS if args.quick else FULL_SETTINGS
    results = []
    started = time.perf_counter()
    runs = RUNS + [("maximus", v) for v in args.variants] + ([("maximus", "auto+train")] if args.preview_train_fix else [])
    for method, seq in args.settings:
        longest = seq == max(s for m, s in args.settings if m == method)
        for args.round in range(args.rounds):
            for impl, policy in runs:
                if policy == "auto+train" and not longest:
                    continue
                results.append(run_worker(impl, policy, method, seq, args))
    rate = matmul_rate(args.threads, dtype=args.dtype)
    print(f"\ntotal {time.perf_counter() - started:.0f} s, {args.warmup} warm-up + {args.steps} measured steps per run, "
          f"{args.rounds} round(s) of peer then ours per setting; dtype {args.dtype} on both sides; {bf16_capability()}; "
          f"{args.dtype} matmul rate {rate / 1e9:,.0f} GFLOP/s at {args.threads} thread(s)\n")
    print(markdown_table(results))
    print()
    print(ratio_summary(results))
    for r in results:
        if "top_ops" in r:
            print()
            print(ops_table(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
