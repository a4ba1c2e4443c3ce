"""Longest context in the memory you have (issue 17): predicted for Llama-3.1-8B, measured on this CPU.

Predicted: `max_seq_len_for_budget` for Llama-3.1-8B QLoRA r=32, batch 1 (default 10 % margin) on
8 / 16 / 24 / 80 GB cards, before (untiled, PEFT's LoRA layers) and now (tiled MLP recompute, lean
LoRA projections), beside Unsloth's published figures.

Measured: the reference model of docs/benchmarks/reference.md, QLoRA r=16, batch 1, full checkpointing, one
training run per (length, setup) in a fresh process, through `Trainer` (peak = run.json
``memory.peak_bytes``, the CPU meter), for three setups:

* ``tiled``: Maximus, MLP tiles of ``--tile`` tokens, lean LoRA;
* ``untiled``: Maximus, ``tile_tokens: off``, lean LoRA;
* ``peer``: Transformers + PEFT + bitsandbytes, gradient checkpointing, Transformers' loss,
  peak from the same meter (`measure_step_peak`); skipped where its logits alone pass ``--peer-max-gib``.

plus ``budget``: 16,384 tokens under ``target_vram: 1.5GB`` (the planner chooses). Each peak sits
beside `estimate_peak` for the same settings.

    flock /tmp/bench.lock python benchmarks/long_context.py                 # everything (~20 min, 2 cores)
    python benchmarks/long_context.py --predicted-only                      # the 8B table (1 s)
    flock /tmp/bench.lock python benchmarks/long_context.py --lengths 4096 16384
    flock /tmp/bench.lock python benchmarks/long_context.py --speed-pairs 2     # tiled vs untiled step at 16k
    flock /tmp/bench.lock python benchmarks/long_context.py --lengths 16384 --lean-norm off   # Transformers' RMSNorm

On a CUDA GPU (a step of the prepared device check `benchmarks/gpu.sh`): ``--device cuda --shape 8b``
runs the same table on the Llama-3-8B shape (random bf16 weights built on the GPU by a child of its
own, QLoRA r=32 as in the predicted table), peak = the highest `torch.cuda.max_memory_allocated` over
the whole run (`_cuda_peak.RunPeak`: every step's window, weights included; run.json's per-step
maximum beside it), plus ``card``: the longest context the planner predicts for ``--card`` (default
16GB), sized with the host memory this machine has (printed; the child plans its offload with it),
run under ``target_vram: <card>``, whose measured peak must stay under it. This process never
touches the GPU. ``--setups`` orders the rows; ``--time-budget-s`` bounds the whole run (each
child's timeout is what is left); a failed, timed-out or out-of-memory child is one row saying so.

    python benchmarks/long_context.py --device cuda --shape 8b --lengths 16384 --card 16GB --setups tiled card
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

EIGHT_B = "meta-llama/Llama-3.1-8B"
#: Unsloth's published longest context, Llama 3.1 8B QLoRA r=32 batch 1 (README / docs
#: "unsloth-benchmarks"), and Hugging Face + FA2 beside it (None: OOM).
UNSLOTH = {"8GB": (2972, None), "16GB": (40724, 2551), "24GB": (78475, 5789), "80GB": (342733, 28454)}
GIB = 2**30


def predicted_table() -> list[str]:
    from maximus.memory.planner import max_seq_len_for_budget, plan_for_budget, resolve_budget

    lines = ["| card | Maximus before (untiled, PEFT layers, Transformers' RMSNorm) | tiled + lean LoRA, Transformers' "
             "RMSNorm | Maximus now (tiled + lean LoRA + lean RMSNorm) | plan at that length "
             "| host RAM it fills | Unsloth | HF + FA2 (Unsloth's figure) | now / Unsloth |",
             "|---|---|---|---|---|---|---|---|---|"]
    for card, (unsloth, hf) in UNSLOTH.items():
        budget = resolve_budget(card)
        before = max_seq_len_for_budget(EIGHT_B, budget, method="qlora", lora_r=32, tile_tokens="off", lean_lora=False,
                                        lean_norm=False)
        stock_norm = max_seq_len_for_budget(EIGHT_B, budget, method="qlora", lora_r=32, lean_norm=False)
        now = max_seq_len_for_budget(EIGHT_B, budget, method="qlora", lora_r=32)
        plan = plan_for_budget(EIGHT_B, budget, method="qlora", lora_r=32, batch_size=1, seq_len=now)
        knobs = [plan.checkpointing_label] + [n for n, on in (("activation offload", plan.offload_activations),
                                                              ("optimizer offload", plan.offload_optimizer)) if on]
        knobs.append(f"tiles {plan.tile_tokens}" if plan.tile_tokens else "untiled")
        lines.append(f"| {card} | {before:,} | {stock_norm:,} | **{now:,}** | {', '.join(knobs)} | {plan.host_bytes / GIB:.1f} GiB | {unsloth:,} | "
                     f"{'OOM' if hf is None else f'{hf:,}'} | {now / unsloth:.2f}x |")
    lines += ["", "The same search when the host RAM is checked (`host_budget_bytes`, as `plan_run` does on a real "
              "GPU with the available RAM): longest context by host RAM available for offloaded state", "",
              "| card | " + " | ".join(f"{h} GB host" for h in HOST_GB) + " |", "|---|" + "---|" * len(HOST_GB)]
    for card in UNSLOTH:
        found = [max_seq_len_for_budget(EIGHT_B, resolve_budget(card), method="qlora", lora_r=32,
                                        host_budget_bytes=int(h * 1e9)) for h in HOST_GB]
        lines.append(f"| {card} | " + " | ".join(f"{n:,}" for n in found) + " |")
    return lines


#: Host RAM sizes (GB) of the host-checked table: a Colab T4 has ~12.7 GB.
HOST_GB = (12, 16, 32, 64)


# ------------------------------------------------------------------------------------------------
# One measured run (in a child process)


def _data(path: Path, seq_len: int, rows: int) -> Path:
    """`rows` documents of about 1.7 x seq_len tokens each (3.4 tokens per word with the tiny
    tokenizer), so that with ``packing: false`` every row is one document cut to exactly seq_len
    tokens: the length the prediction is made for. (Packed rows of shorter documents are not full:
    rows of 2,000-word documents held 13.5k tokens at seq 16,384 and 27k at 32,768.)"""
    rng = random.Random(0)
    words = "red green blue gold stone river cloud tiger eagle maple north south seven quiet bright".split()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq_len // 2))}) + "\n")
    return path


def _lora_r(shape: str) -> int:
    """r=16 on the reference model (the CPU table of the issue), r=32 on the 8B shape (Unsloth's setting)."""
    return 32 if shape == "8b" else 16


def _prediction(setup: str, seq_len: int, tile: int | None, shape: str = "reference", device: str = "cpu",
                lean_norm: bool = True) -> int:
    from _reference_model import SHAPES

    from maximus.memory.estimate import estimate_peak

    config, r = SHAPES[shape], _lora_r(shape)
    if setup == "peer":
        return estimate_peak(config, method="qlora", lora_r=r, seq_len=seq_len, checkpointing="full",
                             loss_mode="naive", device=device, lean_norm=False).peak_bytes
    return estimate_peak(config, method="qlora", lora_r=r, seq_len=seq_len, checkpointing="full",
                         tile_tokens=tile, lean_lora=True, device=device, lean_norm=lean_norm).peak_bytes


def run_ours(setup: str, seq_len: int, tile: int, steps: int, work: Path, shape: str = "reference",
             device: str = "cpu", budget: str = "1.5GB", lean_norm: bool = True) -> dict:
    from _cuda_peak import RunPeak
    from _reference_model import shaped_model_dir, shaped_model_path

    from maximus import Config, Trainer

    r = _lora_r(shape)
    opt: dict = {"gradient_checkpointing": "full", "tile_tokens": tile if setup == "tiled" else "off"}
    if setup in ("budget", "card"):
        opt = {"target_vram": budget}
    opt["lean_norm"] = lean_norm
    # CUDA: the driver's build child made the model (a dry run checks this config, then stops at RunPeak).
    model = shaped_model_path(shape) if device == "cuda" else shaped_model_dir(shape, device=device)
    cfg = {"model": str(model), "method": "qlora", "output_dir": str(work / "run"),
           "dataset": {"path": str(_data(work / "data.jsonl", seq_len, steps + 1)), "format": "text"},
           "lora": {"r": r, "alpha": 2 * r}, "optimization": opt,
           "training": {"batch_size": 1, "micro_batch_size": 1, "max_steps": steps, "seq_len": seq_len,
                        "dtype": "bf16", "warmup_steps": 0, "learning_rate": 1e-4, "packing": False},
           "device": device,
           "eval": {"enabled": False, "before": False}, "logging": {"progress": "none"}}
    trainer = Trainer(Config.from_dict(cfg))
    with RunPeak() if device == "cuda" else contextlib.nullcontext() as run_peak:
        trainer.train()
    cuda_peak = run_peak.peak_bytes if device == "cuda" else None
    summary = json.loads((work / "run" / "run.json").read_text())
    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_ = [m for m in metrics if "step_time_s" in m]
    plan = summary.get("plan", {})
    planned = setup in ("budget", "card")
    chosen_tile = plan.get("tile_tokens") if planned else (tile if setup == "tiled" else None)
    # Under a budget the run's own plan holds the prediction (a known architecture always has one).
    predicted = plan["peak_bytes"] if planned else _prediction(setup, seq_len, chosen_tile, shape, device, lean_norm)
    rows = summary.get("data", {})
    # peak_bytes: on CUDA the whole run's maximum (every step, loading included); meter_peak_bytes:
    # run.json's, the highest of the metered steps' own peaks.
    return {"setup": setup, "seq_len": seq_len, "peak_bytes": cuda_peak or summary["memory"]["peak_bytes"],
            "data": {k: rows.get(k) for k in ("rows", "tokens", "truncated") if k in rows},
            "meter_peak_bytes": summary["memory"]["peak_bytes"], "predicted": predicted,
            "step_time_s": [m["step_time_s"] for m in steps_], "losses": [m.get("loss") for m in steps_],
            "step_tokens": [m.get("tokens") for m in steps_],
            "tile": chosen_tile, "plan": {k: plan.get(k) for k in ("checkpointing_label", "tile_tokens",
                                                                   "loss_chunk_size", "budget_bytes")}}


def run_peer(seq_len: int, steps: int, shape: str = "reference", device: str = "cpu") -> dict:
    import torch
    from _cuda_peak import RunPeak
    from _reference_model import shaped_model_dir
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from maximus.memory import measure_step_peak

    r = _lora_r(shape)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(str(shaped_model_dir(shape, device=device)), quantization_config=quant,
                                                 dtype=torch.bfloat16, device_map={"": device})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 300, (1, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    times = []

    def step():
        start = time.perf_counter()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)

    with RunPeak() if device == "cuda" else contextlib.nullcontext() as run_peak:
        peak, _ = measure_step_peak(step, model, optimizer, device=device, warmup=steps - 1)
    if device == "cuda":  # every step's window, not only the last one measure_step_peak opens
        peak = run_peak.peak_bytes
    return {"setup": "peer", "seq_len": seq_len, "peak_bytes": peak,
            "predicted": _prediction("peer", seq_len, None, shape, device),
            "step_time_s": times, "losses": [], "tile": None, "plan": {}}


def _child(spec: dict) -> dict:
    import torch

    # Imported before any model is built, so a missing module fails in seconds (also in the dry run).
    from maximus import Config, Trainer  # noqa: F401
    if spec["setup"] == "peer":
        import bitsandbytes  # noqa: F401
        import peft  # noqa: F401

    torch.set_num_threads(spec["threads"])
    shape, device = spec.get("shape", "reference"), spec.get("device", "cpu")
    with tempfile.TemporaryDirectory() as work:
        if spec["setup"] == "peer":
            return run_peer(spec["seq_len"], spec["steps"], shape, device)
        return run_ours(spec["setup"], spec["seq_len"], spec["tile"], spec["steps"], Path(work), shape, device,
                        spec.get("budget", "1.5GB"), spec.get("lean_norm", True))


def measure(spec: dict, timeout_s: float) -> dict:
    """One row in a child process: its result, or the row ``{**spec, "error": ...}`` (``"oom": True``
    where it ran out of memory) when the child failed or took longer than ``timeout_s``."""
    from _child import ChildFailed, run_child

    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), HF_HUB_OFFLINE="1")
    try:
        return run_child([sys.executable, __file__, "--child", json.dumps(spec)], timeout_s,
                         f"{spec['setup']} {spec['seq_len']}", env=env)
    except ChildFailed as exc:
        text = str(exc)
        return {**spec, "oom": "OutOfMemoryError" in text or "out of memory" in text.lower(), "error": text}


def interleaved_speed(seq_len: int, tile: int, pairs: int, threads: int) -> dict:
    """Step seconds of one model, tiled and untiled steps alternating after one warm-up step (the
    machine's noise hits both alike): QLoRA r=16 on the reference model, lean LoRA, full
    checkpointing, exact chunked loss under bf16 autocast, as the trainer runs it."""
    import torch
    from _reference_model import reference_model_dir

    from maximus import Config
    from maximus.forward import autocast_for
    from maximus.kernels.lean_lora import install_lean_lora
    from maximus.kernels.lean_norm import install_lean_norm
    from maximus.losses.linear_cross_entropy import linear_cross_entropy
    from maximus.memory.checkpointing import set_recompute_modes
    from maximus.models import load_model
    from maximus.structure import causal_lm_of

    torch.set_num_threads(threads)
    cpu_times: dict[bool, list[float]] = {True: [], False: []}  # process CPU seconds per step, tiled / untiled
    cfg = Config.from_dict({"model": str(reference_model_dir()), "dataset": "unused", "method": "qlora",
                            "lora": {"r": 16, "alpha": 32}, "training": {"dtype": "bf16"}})
    model, _ = load_model(cfg, device=torch.device("cpu"))
    model.train()
    install_lean_lora(model)
    install_lean_norm(model)
    lm = causal_lm_of(model)
    ids = torch.randint(0, 300, (1, seq_len), generator=torch.Generator().manual_seed(0))
    layers = lm.config.num_hidden_layers

    def step(tile_tokens):
        set_recompute_modes(model, ["full"] * layers, tile_tokens=tile_tokens)
        model.zero_grad(set_to_none=True)
        start, cpu = time.perf_counter(), time.process_time()
        with autocast_for(torch.device("cpu"), torch.bfloat16):
            hidden = lm.model(input_ids=ids).last_hidden_state
            loss = linear_cross_entropy(hidden[:, :-1], lm.lm_head.weight, ids[:, 1:])
        loss.backward()
        cpu_times[tile_tokens is not None].append(time.process_time() - cpu)
        return time.perf_counter() - start, loss.item()

    step(None)  # warm-up
    times = {"tiled": [], "untiled": []}
    losses = {"tiled": [], "untiled": []}
    for _ in range(pairs):
        for name, t in (("tiled", tile), ("untiled", None)):
            seconds, loss = step(t)
            times[name].append(seconds)
            losses[name].append(loss)
    ratios = [a / b for a, b in zip(times["tiled"], times["untiled"])]
    cpu = {"tiled": cpu_times[True], "untiled": cpu_times[False][1:]}  # [0] of untiled is the warm-up
    cpu_ratios = [a / b for a, b in zip(cpu["tiled"], cpu["untiled"])]
    return {"seq_len": seq_len, "tile": tile, "times": times, "losses": losses, "ratios": ratios,
            "cpu_times": cpu, "cpu_ratios": cpu_ratios}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--predicted-only", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--tile", type=int, default=1024, help="tile of the tiled setup (tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-max-gib", type=float, default=None,
                        help="skip the peer where its float32 logits and their gradients (12 B per logit) pass this "
                             "(default 8 on cpu, 100 on cuda)")
    parser.add_argument("--speed-length", type=int, default=16384, help="length of the 2-step tiled/untiled timing")
    parser.add_argument("--speed-pairs", type=int, default=0,
                        help="only time N interleaved tiled/untiled step pairs at --speed-length in one process")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", choices=("reference", "8b"), default=None,
                        help="model shape (default: reference on cpu, 8b on cuda)")
    parser.add_argument("--card", default="16GB",
                        help="cuda: also run the planner's longest context for this card under target_vram: CARD")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--lean-norm", choices=("on", "off"), default="on",
                        help="our setups with optimization.lean_norm (off: Transformers' RMSNorm, the ablation)")
    parser.add_argument("--setups", nargs="+", choices=("tiled", "untiled", "peer", "card"), default=None,
                        help="cuda: the rows to run, in this order (default: tiled untiled peer card)")
    parser.add_argument("--row-timeout", type=float, default=3600, help="seconds before a row's child is killed")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="the whole run's seconds: no child's timeout reaches past it")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.shape = args.shape or ("8b" if args.device == "cuda" else "reference")
    if args.peer_max_gib is None:
        args.peer_max_gib = 100.0 if args.device == "cuda" else 8.0
    if args.speed_pairs:
        import statistics

        r = interleaved_speed(args.speed_length, args.tile, args.speed_pairs, args.threads)
        print(f"{args.speed_length} tokens, tiles {args.tile}: tiled {['%.1f' % t for t in r['times']['tiled']]} s, "
              f"untiled {['%.1f' % t for t in r['times']['untiled']]} s; tiled / untiled median "
              f"{statistics.median(r['ratios']):.3f} (range {min(r['ratios']):.3f}-{max(r['ratios']):.3f}); "
              f"process CPU seconds tiled {['%.1f' % t for t in r['cpu_times']['tiled']]}, untiled "
              f"{['%.1f' % t for t in r['cpu_times']['untiled']]}, tiled / untiled median "
              f"{statistics.median(r['cpu_ratios']):.3f} (range {min(r['cpu_ratios']):.3f}-{max(r['cpu_ratios']):.3f}); "
              f"losses tiled {r['losses']['tiled']} untiled {r['losses']['untiled']}")
        return 0
    if args.child:
        print("RESULT " + json.dumps(_child(json.loads(args.child))), flush=True)
        return 0

    if args.device == "cuda" and not args.predicted_only:  # the predicted table is the same on any machine
        return measured_on_cuda(args)
    print("## Predicted: Llama-3.1-8B QLoRA r=32, batch 1, 10 % margin (`max_seq_len_for_budget`)\n")
    print("\n".join(predicted_table()), flush=True)
    if args.predicted_only:
        return 0

    import torch

    from maximus.device import bf16_supported

    n = 2048
    a = torch.randn(n, n, dtype=torch.bfloat16)
    torch.set_num_threads(args.threads)
    a @ a
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    rate = 5 * 2 * n**3 / (time.perf_counter() - start)
    del a
    print(f"\nCPU: native bf16 {bf16_supported(torch.device('cpu'))}, bf16 matmul {rate / 1e9:,.0f} GFLOP/s "
          f"({n}^3, {args.threads} threads); shape {args.shape}, QLoRA r={_lora_r(args.shape)}\n", flush=True)
    specs = []
    for seq in args.lengths:
        for setup in ("tiled", "untiled"):
            specs.append(dict(setup=setup, seq_len=seq, tile=args.tile, steps=2 if seq == args.speed_length else 1))
        if seq == 16384:
            specs.append(dict(setup="budget", seq_len=seq, tile=args.tile, steps=1))
        if seq * VOCAB * 12 <= args.peer_max_gib * GIB:
            specs.append(dict(setup="peer", seq_len=seq, tile=None, steps=2))
    return measure_rows(specs, args)


VOCAB = 128256
#: The card row is sized for this share of the host memory the child's planner may fill with
#: offloaded state (run_plan.HOST_OFFLOAD_SHARE of what is available), so that what the child
#: itself takes before it plans (the loaded model, the data) cannot tip its plan over.
HOST_SIZING_SHARE = 0.8


def measured_on_cuda(args) -> int:
    """The CUDA table: the model built in a child, then ``--setups`` in that order (``card``: the
    planner's longest context for ``--card``, sized with this machine's host memory). This process
    never touches the GPU."""
    import psutil
    from _child import ChildFailed, Deadline, DryStop, host_memory_line, run_child
    from _reference_model import SHAPES

    from maximus.memory.planner import max_seq_len_for_budget, resolve_budget
    from maximus.memory.spec_from_config import HOST_OFFLOAD_SHARE

    deadline = Deadline(args.time_budget_s)
    print(f"{host_memory_line()}; shape {args.shape}, QLoRA r={_lora_r(args.shape)}", flush=True)
    build = [sys.executable, str(HERE / "_reference_model.py"), "--shape", args.shape, "--device", args.device]
    try:
        built = run_child(build, deadline.child_timeout(args.row_timeout), f"model {args.shape}")
        print(f"  model {args.shape}: ready in {built['build_s']:.0f} s", flush=True)
    except DryStop as stop:  # the dry run goes on to the rows
        print(f"  {stop}", flush=True)
    except ChildFailed as exc:
        print(f"  model {args.shape}: {exc}", flush=True)
        return 1
    specs = []
    for setup in args.setups or ("tiled", "untiled", "peer", "card"):
        if setup == "card":
            if not args.card:
                continue
            host_budget = int(psutil.virtual_memory().available * HOST_OFFLOAD_SHARE * HOST_SIZING_SHARE)
            longest = max_seq_len_for_budget(SHAPES[args.shape], resolve_budget(args.card), method="qlora",
                                             lora_r=_lora_r(args.shape), host_budget_bytes=host_budget)
            print(f"  planner: longest context under {args.card} with {host_budget / GIB:.1f} GiB of host memory "
                  f"for offloaded state = {longest:,} tokens", flush=True)
            specs.append(dict(setup="card", seq_len=longest, tile=args.tile, steps=2, budget=args.card))
            continue
        for seq in args.lengths:
            if setup == "peer" and seq * VOCAB * 12 > args.peer_max_gib * GIB:
                continue
            steps = 2 if setup == "peer" or seq == args.speed_length else 1
            specs.append(dict(setup=setup, seq_len=seq, tile=args.tile if setup != "peer" else None, steps=steps))
    return measure_rows(specs, args, deadline)


def measure_rows(specs: list[dict], args, deadline=None) -> int:
    """Each spec in a child process, in order; rows printed and written to ``--json`` as they
    finish; then the table. 1 when a row failed (other than running out of memory), else 0."""
    from _child import Deadline, DryStop

    from maximus.memory.planner import resolve_budget

    deadline = deadline or Deadline(args.time_budget_s)
    cuda = args.device == "cuda"
    rows, failed, dry_stopped = [], 0, {}
    for spec in specs:
        spec.update(threads=args.threads, shape=args.shape, device=args.device, lean_norm=args.lean_norm == "on")
        # the code paths a child can take: the peer, ours, ours under a budget (its own config)
        kind = "peer" if spec["setup"] == "peer" else "ours under a budget" if spec.get("budget") else "ours"
        if kind in dry_stopped:  # a dry run checks each path once (a few seconds a child in CI)
            print(f"  {spec['setup']} {spec['seq_len']}: dry run: the same child as {dry_stopped[kind]}", flush=True)
            continue
        try:
            r = measure(spec, deadline.child_timeout(args.row_timeout))
        except DryStop as stop:
            print(f"  {stop}", flush=True)
            dry_stopped[kind] = f"{spec['setup']} {spec['seq_len']}"
            continue
        except RuntimeError as exc:  # no time left for this row
            r = {**spec, "error": str(exc)}
        rows.append(r)
        if r.get("oom"):
            print(f"  {r['setup']:8s} {r['seq_len']:6d}: out of memory ({r['error'].splitlines()[-1]})", flush=True)
        elif "error" in r:
            failed += 1
            print(f"  {r['setup']:8s} {r['seq_len']:6d}: failed: {r['error']}", flush=True)
        else:
            budget = f", {'under' if r['peak_bytes'] <= resolve_budget(spec['budget']) else 'OVER'} {spec['budget']}" \
                if spec.get("budget") and cuda else ""
            print(f"  {r['setup']:8s} {r['seq_len']:6d}: peak {r['peak_bytes'] / 2**20:8.0f} MiB{budget}, predicted "
                  f"{r['predicted'] / 2**20:8.0f} MiB ({r['predicted'] / r['peak_bytes'] - 1:+.1%}), "
                  f"steps {['%.1f' % t for t in r['step_time_s']]} s of {r.get('step_tokens') or [r['seq_len']]} "
                  f"tokens, tile {r['tile']}, plan {r['plan']}",
                  flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    steps_peak = " | steps' own peak (run.json)" if cuda else ""
    print(f"\n| tokens | setup | measured peak{steps_peak} | predicted | error | step (s) | tokens/s |")
    print("|---|---|---|---|---|---|---|" + ("---|" if cuda else ""))
    for r in rows:
        if "error" in r:
            what = "out of memory" if r.get("oom") else "failed"
            print(f"| {r['seq_len']:,} | {r['setup']} | {what} |" + (" |" if cuda else "") + " | | | |")
            continue
        t = r["step_time_s"][-1]
        own = f" | {r['meter_peak_bytes'] / 2**20:,.0f} MiB" if cuda and r.get("meter_peak_bytes") else \
            (" | -" if cuda else "")
        print(f"| {r['seq_len']:,} | {r['setup']}{' (tiles %d)' % r['tile'] if r['tile'] else ''} "
              f"| {r['peak_bytes'] / 2**20:,.0f} MiB{own} | {r['predicted'] / 2**20:,.0f} MiB "
              f"| {r['predicted'] / r['peak_bytes'] - 1:+.1%} | {t:.1f} | {r['seq_len'] / t:,.0f} |")
    pair = {r["setup"]: r for r in rows if r["seq_len"] == args.speed_length and r["setup"] in ("tiled", "untiled")
            and "error" not in r}
    if len(pair) == 2:
        ratio = pair["tiled"]["step_time_s"][-1] / pair["untiled"]["step_time_s"][-1]
        print(f"\nspeed at {args.speed_length}: tiled step / untiled step = {ratio:.3f} (second step of each; "
              f"losses tiled {pair['tiled']['losses']} untiled {pair['untiled']['losses']})")
    return 1 if failed else 0


if __name__ == "__main__":
    from _child import guarded_main

    raise SystemExit(guarded_main(main))
