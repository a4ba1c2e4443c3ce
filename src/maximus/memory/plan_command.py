"""`maximus plan`: predict a run's peak memory and name the cheapest GPU that fits it.

    maximus plan --config FILE
    maximus plan --model ID_OR_DIR --method qlora --seq 2048 --batch 2 [--budget 16GB] [--json]

Only config.json is read (a local directory, a config.json path, a hub id from
`maximus.memory.estimate.KNOWN_SHAPES`, or the local Hugging Face cache): no weights, no network.

The "requested setting" is the run as asked: micro-batch = batch (no accumulation) unless
``--micro-batch`` says otherwise, full checkpointing unless ``--checkpointing`` says otherwise,
no offload. For every card in `maximus.config.GPU_CARDS` the planner then finds the fastest plan
that fits that card (keeping the effective batch), and the cheapest fitting card is named; beside
each card's plan stands the longest context that card fits (`max_seq_len_for_budget`, one
sequence per forward pass unless ``--micro-batch`` says otherwise, every memory knob allowed).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from maximus.arguments import ArgumentParser
from maximus.config import GPU_CARDS, Config, format_bytes, parse_bytes
from maximus.errors import BudgetError, ConfigError
from maximus.memory.estimate import DEVICE_FLOPS, estimate_peak, load_model_config, model_shape, technique_kwargs
from maximus.memory.planner import Plan, max_seq_len_for_budget, plan_for_budget

__all__ = ["plan_main", "plan_report", "plan_json", "CARD_TFLOPS"]

#: Dense bf16 (fp16 on the T4) tensor-core TFLOP/s from the vendors' data sheets, to turn the
#: planner's tokens/s guess (made for `DEVICE_FLOPS["cuda"]`) into one per card. Indicative only.
CARD_TFLOPS = {"T4": 65, "L4": 121, "A10": 125, "RTX3090": 71, "RTX4090": 165, "A100-40GB": 312, "A100-80GB": 312,
               "H100": 989, "H200": 989}


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="maximus plan", description="Predict peak training memory from config.json and "
                                "name the cheapest GPU that fits.")
    p.add_argument("--config", help="a Maximus YAML config (model, method, training.*, optimization.*)")
    p.add_argument("--model", help="hub id (e.g. meta-llama/Llama-3.1-8B), model directory or config.json")
    p.add_argument("--method", choices=["full", "lora", "qlora", "auto"], help="default: lora")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 2048)")
    p.add_argument("--batch", type=int, help="effective batch in sequences (default 8)")
    p.add_argument("--micro-batch", type=int, help="sequences per forward pass (default: planner's choice)")
    p.add_argument("--budget", help="also plan for this budget: 16GB, 24GiB, T4, ...")
    p.add_argument("--lora-r", type=int, help="adapter rank (default 16)")
    p.add_argument("--optimizer", choices=["adamw", "adamw_8bit", "paged_adamw_8bit"])
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--loss", choices=["exact", "naive", "ghost"], help="default: exact (chunked)")
    p.add_argument("--checkpointing", choices=["off", "full", "selective", "auto"])
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Merge the YAML config (if any) with command-line flags; flags win."""
    s: dict[str, Any] = dict(model=None, method="lora", seq_len=2048, batch_size=8, micro_batch=None, budget=None,
                             lora_r=16, lora_targets="all-linear", optimizer="adamw", dtype="bf16", loss_mode="exact",
                             checkpointing="auto", techniques={}, tile_tokens="auto", lean_lora=True)
    if args.config:
        cfg = Config.from_yaml(args.config)
        s.update(model=cfg.model, method=cfg.method, seq_len=cfg.training.seq_len, batch_size=cfg.training.batch_size,
                 lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules, optimizer=cfg.training.optimizer,
                 loss_mode="ghost" if cfg.optimization.use_ghost_logit else cfg.optimization.loss,
                 checkpointing=cfg.optimization.gradient_checkpointing,
                 techniques=technique_kwargs(cfg),  # what the config switches on, as the trainer plans it
                 dtype=cfg.training.dtype if cfg.training.dtype != "auto" else "bf16",
                 budget=cfg.optimization.target_vram, tile_tokens=cfg.optimization.tile_tokens,
                 lean_lora=cfg.optimization.lean_lora)
        if "method" not in cfg.model_fields_set and cfg.optimization.target_vram is not None:
            # A config that names a budget but no method (the article's) asks Maximus to choose.
            s["method"] = "auto"
        if isinstance(cfg.training.micro_batch_size, int):
            s["micro_batch"] = cfg.training.micro_batch_size
    flags = dict(model=args.model, method=args.method, seq_len=args.seq, batch_size=args.batch,
                 micro_batch=args.micro_batch, lora_r=args.lora_r, optimizer=args.optimizer, dtype=args.dtype,
                 loss_mode=args.loss, checkpointing=args.checkpointing)
    s.update({k: v for k, v in flags.items() if v is not None})
    if args.budget is not None:
        s["budget"] = parse_bytes(args.budget, "--budget")
    if not s["model"]:
        raise ConfigError("maximus plan needs --model or --config",
                          "e.g. maximus plan --model meta-llama/Llama-3.1-8B --method qlora --seq 2048 --batch 2")
    for key in ("seq_len", "batch_size"):
        if s[key] < 1:
            raise ConfigError(f"{key} must be positive, got {s[key]}", "pass --seq and --batch as positive integers")
    s["world_size"] = args.world_size
    return s


def plan_report(s: dict[str, Any]) -> dict[str, Any]:
    """Everything `maximus plan` shows, as one JSON-ready dict (bytes for memory)."""
    config = load_model_config(s["model"])
    shape = model_shape(config)
    common = dict(dtype=s["dtype"], optimizer=s["optimizer"], lora_r=s["lora_r"], lora_targets=s["lora_targets"],
                  world_size=s["world_size"])
    requested_method = "qlora" if s["method"] == "auto" else s["method"]
    micro = s["micro_batch"] or max(1, s["batch_size"] // s["world_size"])
    checkpointing = "full" if s["checkpointing"] == "auto" else s["checkpointing"]
    requested = estimate_peak(shape, method=requested_method, micro_batch=micro, seq_len=s["seq_len"],
                              checkpointing=checkpointing, loss_mode=s["loss_mode"], lean_lora=s["lean_lora"],
                              **s["techniques"], **common)
    plan_kw = dict(method=s["method"], batch_size=s["batch_size"], seq_len=s["seq_len"], loss_mode=s["loss_mode"],
                   micro_batch_size=s["micro_batch"] or "auto", gradient_checkpointing=s["checkpointing"],
                   tile_tokens=s["tile_tokens"], lean_lora=s["lean_lora"], **s["techniques"], **common)
    longest_kw = dict(method=requested_method, micro_batch=s["micro_batch"] or 1, loss_mode=s["loss_mode"],
                      tile_tokens=s["tile_tokens"], lean_lora=s["lean_lora"], **s["techniques"],
                      **{k: v for k, v in common.items() if k != "world_size"})

    def plan_or_none(budget: int) -> tuple[Plan | None, str | None]:
        try:
            return plan_for_budget(shape, budget, **plan_kw), None
        except BudgetError as exc:
            return None, exc.message

    cards = []
    for name, (memory, price) in GPU_CARDS.items():
        plan, why = plan_or_none(memory)
        speed = None
        if plan is not None and name in CARD_TFLOPS:
            speed = plan.tokens_per_s_guess * CARD_TFLOPS[name] * 1e12 / DEVICE_FLOPS["cuda"]
        longest = max_seq_len_for_budget(shape, memory, **longest_kw) if s["world_size"] == 1 else None
        cards.append({"card": name, "memory_bytes": memory, "price_per_hour": price, "fits": plan is not None,
                      "plan": plan.to_dict() if plan else None, "why_not": why, "longest_context_tokens": longest,
                      "tokens_per_s_guess": speed,
                      "usd_per_million_tokens": price / (speed * 3600) * 1e6 if speed else None})
    fitting = [c for c in cards if c["fits"]]
    cheapest = min(fitting, key=lambda c: (c["price_per_hour"], c["memory_bytes"]))["card"] if fitting else None
    report: dict[str, Any] = {
        "model": str(s["model"]),
        "shape": {"params": shape.num_params, "layers": shape.num_layers, "hidden_size": shape.hidden_size,
                  "vocab_size": shape.vocab_size},
        "settings": {k: s[k] for k in ("method", "seq_len", "batch_size", "lora_r", "optimizer", "dtype", "loss_mode",
                                       "world_size")} | {"micro_batch": micro, "checkpointing": checkpointing}
                    | {k: v for k, v in requested.settings.items() if k in ("attention", "objective", "kronecker")},
        "peak_bytes": requested.peak_bytes,
        "notes": requested.notes,
        "breakdown": requested.breakdown,
        "cards": cards,
        "cheapest_card": cheapest,
        "longest_context_micro_batch": longest_kw["micro_batch"],
    }
    budget = s.get("budget")
    if budget == "auto":
        from maximus.memory.planner import resolve_budget
        import torch

        budget = resolve_budget("auto", "cuda") if torch.cuda.is_available() else None
    if isinstance(budget, int):
        plan, why = plan_or_none(budget)
        report["budget"] = {"budget_bytes": budget, "fits": plan is not None, "plan": plan.to_dict() if plan else None,
                            "why_not": why}
    return report


def _print_tables(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    s = report["settings"]
    console.print(f"[bold]{report['model']}[/bold]: {report['shape']['params'] / 1e9:.2f}B parameters, "
                  f"{s['method']}, {s['batch_size']} x {s['seq_len']} tokens, {s['dtype']}, loss {s['loss_mode']}")
    t = Table(title=f"requested setting (micro-batch {s['micro_batch']}, {s['checkpointing']} checkpointing)")
    t.add_column("part")
    t.add_column("memory", justify="right")
    for k, v in report["breakdown"].items():
        t.add_row(k, format_bytes(v))
    t.add_row("[bold]predicted peak[/bold]", f"[bold]{format_bytes(report['peak_bytes'])}[/bold]")
    console.print(t)
    for note in report.get("notes", []):
        console.print(f"note: {note}")

    cards = Table(title="best plan per card; longest context: tokens per sequence that fit the card at micro-batch "
                        f"{report['longest_context_micro_batch']}")
    for col in ("card", "memory", "$/hour", "plan", "predicted peak", "tokens/s (guess)", "$/M tokens"):
        cards.add_column(col, justify="right" if col not in ("card", "plan") else "left")
    cards.add_column("longest context", justify="right", no_wrap=True)
    for c in report["cards"]:
        p = c["plan"]
        longest = f"{c['longest_context_tokens']:,}" if c.get("longest_context_tokens") is not None else "-"
        if p:
            gc = p["gradient_checkpointing"]
            gc = gc if isinstance(gc, str) else f"{sum(gc)}/{len(gc)} layers"
            offload = "+".join(n for n, k in (("act", "offload_activations"), ("opt", "offload_optimizer")) if p[k])
            desc = (f"{p['method']} mb {p['micro_batch_size']} x acc {p['grad_accum']}, ckpt {gc}"
                    + (f", offload {offload}" if offload else ""))
            if p.get("tile_tokens"):
                desc += f", tiles {p['tile_tokens']}"
            cards.add_row(c["card"], format_bytes(c["memory_bytes"]), f"{c['price_per_hour']:.2f}", desc,
                          format_bytes(p["peak_bytes"]), f"{c['tokens_per_s_guess'] or 0:.0f}",
                          f"{c['usd_per_million_tokens']:.2f}" if c["usd_per_million_tokens"] else "-", longest)
        else:
            cards.add_row(c["card"], format_bytes(c["memory_bytes"]), f"{c['price_per_hour']:.2f}",
                          "does not fit", "-", "-", "-", longest)
    console.print(cards)
    if report["cheapest_card"]:
        console.print(f"cheapest card that fits: [bold]{report['cheapest_card']}[/bold]")
    else:
        console.print("no listed card fits: use more GPUs (--world-size), method qlora, or a shorter --seq")
    if "budget" in report:
        b = report["budget"]
        if b["fits"]:
            plan = Plan(**{k: v for k, v in b["plan"].items() if k != "effective_batch"})
            console.print(plan.table())
        else:
            console.print(f"budget {format_bytes(b['budget_bytes'])}: {b['why_not']}")


def plan_json(argv: list[str]) -> dict[str, Any]:
    """The object `maximus plan ARGV --json` prints (`maximus ui`'s planner page shows exactly this)."""
    return plan_report(_settings(_parser().parse_args(argv)))


def plan_main(argv: list[str]) -> int:
    """Entry point of `maximus plan`; returns the exit code. Raises MaximusError on bad input."""
    args = _parser().parse_args(argv)
    report = plan_json(argv)
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_tables(report)
    return 0
