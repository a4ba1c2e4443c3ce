"""`maximus plan`: predict a run's peak memory and name the cheapest GPU that fits it.

    maximus plan --config FILE [--measure]
    maximus plan --model ID_OR_DIR --method qlora --seq 2048 --batch 2 [--budget 16GB] [--json]

With ``--model`` only config.json is read (a local directory, a config.json path, a hub id from
`maximus.memory.shape.KNOWN_SHAPES`, or the local Hugging Face cache): no weights, no network.
With ``--config`` the tokenizer and the data are read too, when they can be (the plan is for the
rows the data has); ``--measure`` also trains a short probe of the run on this device (weights
loaded) and sizes the cards from the estimator calibrated by it (`measure_report`).

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
from dataclasses import replace
from typing import Any, Callable

from maximus.arguments import ArgumentParser
from maximus.config import GPU_CARDS, Config, format_bytes
from maximus.errors import BudgetError, ConfigError
from maximus.memory.coefficients import DEVICE_FLOPS
from maximus.memory.lengths import RowLengths
from maximus.memory.optimizer_state import OPTIMIZERS
from maximus.memory.plan import Plan, plan_summary, recompute_label
from maximus.memory.planner import check_batch_splits, max_seq_len_for_budget, plan_for_budget, resolve_budget
from maximus.memory.spec_from_config import fixed_strategy, plan_run, run_spec
from maximus.memory.run_spec import RunSpec, SearchSpace

__all__ = ["plan_main", "plan_report", "plan_json", "CARD_TFLOPS", "card_tokens_per_s"]

#: Dense bf16 (fp16 on the T4) tensor-core TFLOP/s from the vendors' data sheets, to turn the
#: planner's tokens/s guess (made for `DEVICE_FLOPS["cuda"]`) into one per card. Indicative only.
CARD_TFLOPS = {"T4": 65, "L4": 121, "A10": 125, "RTX3090": 71, "RTX4090": 165, "A100-40GB": 312, "A100-80GB": 312,
               "H100": 989, "H200": 989}


def card_tokens_per_s(plan: Plan, compute_scale: float, h2d_bytes_per_s: float) -> tuple[float, str]:
    """(tokens/s, ``compute`` or ``transfer``) of `plan` on a card whose compute runs
    `compute_scale` times the planner's reference GPU and whose host-to-device copies run at
    `h2d_bytes_per_s`: a plan that streams weights takes the slower of its compute and its copies
    (they overlap, one layer ahead); any other plan is compute-bound."""
    if not plan.streamed_bytes_per_step:
        return plan.tokens_per_s_guess * compute_scale, "compute"
    tokens = plan.micro_batch_tokens_max or plan.micro_batch_size * plan.seq_len
    compute_s = tokens / (plan.compute_tokens_per_s * compute_scale)
    transfer_s = plan.streamed_bytes_per_step / h2d_bytes_per_s
    return tokens / max(compute_s, transfer_s), "transfer" if transfer_s > compute_s else "compute"


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
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), help="default adamw; see docs/optimizers.md")
    p.add_argument("--optimizer-rank", type=int, help="apollo / apollo_mini / galore projection rank")
    p.add_argument("--optimizer-in-backward", action="store_true", help="step each weight inside the backward")
    p.add_argument("--embedding-optimizer", choices=["adamw", "adamw_4bit"],
                   help="apollo / apollo_mini / galore / muon: the embedding's and the head's moments (default adamw)")
    p.add_argument("--master-weights", choices=["fp32", "bf16"], help="full fine-tuning: fp32 master weights "
                   "(default) or bf16 weights with stochastic rounding")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--loss", choices=["exact", "naive", "ghost"], help="default: exact (chunked)")
    p.add_argument("--checkpointing", choices=["none", "off", "full", "selective", "auto"],
                   help="none (off: the same), full, selective or auto")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--gpus", type=int, help="also show, per card, the longest context over 1, 2, 4, ... up to this many "
                                            "cards with training.context_parallel, and the degree --seq needs")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--measure", action="store_true", help="with --config: run a few real optimizer steps at a small "
                   "micro-batch on this device, calibrate the estimator with the measured peak, and size the cards "
                   "from the calibrated estimate")
    p.add_argument("--probe-steps", type=int, default=3, help="optimizer steps of the --measure probe (default 3)")
    p.add_argument("--probe-micro-batch", type=int, default=1,
                   help="rows per micro-batch of the --measure probe (default 1; two micro-batches per step)")
    return p


def _config(args: argparse.Namespace) -> Config:
    """The run to plan, as a `Config`: the YAML file (if any) with the command-line flags applied
    as overrides (flags win), so `maximus plan` and `maximus-train` plan the same run the same way
    (`plan_run`)."""
    flags = {"model": args.model, "method": args.method, "training.seq_len": args.seq,
             "training.batch_size": args.batch, "training.micro_batch_size": args.micro_batch, "lora.r": args.lora_r,
             "training.optimizer": args.optimizer, "training.dtype": args.dtype, "optimization.loss": args.loss,
             "optimization.gradient_checkpointing": args.checkpointing, "optimization.target_vram": args.budget,
             "training.optimizer_rank": args.optimizer_rank, "training.master_weights": args.master_weights,
             "training.embedding_optimizer": args.embedding_optimizer}
    if args.optimizer_in_backward:  # the global norm is unknown when each weight steps in the backward
        flags.update({"training.optimizer_in_backward": True, "training.max_grad_norm": "null"})
    if args.loss is not None:  # the flag names the loss outright: the article's spelling gives way
        flags["optimization.use_ghost_logit"] = False
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None]
    if args.config:
        return Config.from_yaml(args.config, overrides)
    if not args.model:
        raise ConfigError("maximus plan needs --model or --config",
                          "e.g. maximus plan --model meta-llama/Llama-3.1-8B --method qlora --seq 2048 --batch 2")
    # Only the model is read (no data): the dataset is a placeholder the planner never opens.
    return Config.from_dict({"model": args.model, "dataset": "(not read by maximus plan)"}, overrides,
                            source="maximus plan")


def _requested(cfg: Config, world_size: int) -> Config:
    """The run as asked, before any planning: micro-batch = the per-process batch (no accumulation)
    unless given, full checkpointing unless given, no offload; QLoRA when the planner would choose
    the method."""
    t, opt = cfg.training, cfg.optimization
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else max(1, t.batch_size // world_size)
    update: dict[str, Any] = {
        "training": t.model_copy(update={"micro_batch_size": micro}),
        "optimization": opt.model_copy(update={
            "gradient_checkpointing": "full" if opt.gradient_checkpointing == "auto" else opt.gradient_checkpointing,
            "offload": opt.offload.model_copy(update={"activations": "off", "optimizer": "off"})}),
    }
    if _planner_picks_method(cfg):
        update["method"] = "qlora"
    return cfg.model_copy(update=update)


def _planner_picks_method(cfg: Config) -> bool:
    return "method" not in cfg.model_fields_set or cfg.method == "auto"


def largest_image(spec: RunSpec, budget_bytes: int, *, seq_len: int, micro_batch: int) -> dict | None:
    """The largest image (pixels) whose rows still fit `budget_bytes` at `micro_batch`, as the
    longest context is for text: each row keeps its text tokens (``seq_len`` less its image tokens)
    and gets the image tokens of that size (`maximus.memory.vision_terms.image_geometry`). A
    processor that resizes every image to one size has one answer: that size, or None when it
    does not fit. None when not even the smallest image fits."""
    from maximus.memory.vision_terms import image_geometry, processor_limits

    vision = spec.techniques.vision
    text = max(1, seq_len - vision.geometry.tokens * vision.images_per_row)

    def spec_at(pixels: int | None):
        g = vision.geometry if pixels is None else image_geometry(vision.shape, vision.processor, pixels)
        return replace(vision, geometry=g)

    def fits(tower) -> bool:
        rows = text + tower.geometry.tokens * tower.images_per_row
        at = replace(spec, techniques=replace(spec.techniques, vision=tower)).searching(
            batch_size=micro_batch, seq_len=rows, micro_batch_size=micro_batch)
        try:
            plan_for_budget(at, budget_bytes, name_longest=False)
            return True
        except BudgetError:
            return False

    def found(tower) -> dict:
        g = tower.geometry
        return {"width": g.width, "height": g.height, "pixels": g.width * g.height, "image_tokens": g.tokens,
                "fixed_size": g.fixed}

    if vision.geometry.fixed:
        return found(vision) if fits(vision) else None
    lo_px, hi_px = processor_limits(vision.shape, vision.processor)
    if not fits(spec_at(lo_px)):
        return None
    lo, hi = lo_px, hi_px
    if fits(spec_at(hi)):
        return found(spec_at(hi))
    while hi - lo > max(1, lo // 100):  # invariant: lo fits, hi does not; 1 % is finer than the patch grid
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(spec_at(mid)) else (lo, mid)
    return found(spec_at(lo))


def data_lengths(cfg: Config, world_size: int = 1) -> tuple[RowLengths | None, str | None]:
    """The run's row lengths read from its data (`maximus.train.order.read_lengths`), or None and
    the one-line reason when the tokenizer or the data cannot be read here (a hub id with no local
    files, the article's placeholder dataset): the plan then assumes rows of ``seq_len`` tokens."""
    from maximus.errors import MaximusError
    from maximus.train.order import read_lengths

    try:
        return read_lengths(cfg, world_size=world_size), None
    except MaximusError as exc:
        return None, (f"the data was not read ({exc.message}): every row is planned at training.seq_len "
                      f"({cfg.training.seq_len:,} tokens)")


def plan_report(cfg: Config, *, world_size: int = 1, lengths: RowLengths | None = None,
                gpus: int | None = None) -> dict[str, Any]:
    """Everything `maximus plan` shows, as one JSON-ready dict (bytes for memory); the plans
    themselves (`Plan` objects) under the keys ``_requested`` / ``_budget`` for the tables.
    ``lengths``: the data's rows (`data_lengths`), else every row at ``seq_len``."""
    check_batch_splits(cfg.training.batch_size, world_size)
    requested = plan_run(_requested(cfg, world_size), device="cuda", world_size=world_size, budget_bytes=None,
                         lengths=lengths)
    t = cfg.training
    # The longest context and the largest image per card: every memory knob allowed, one rank.
    longest = replace(run_spec(cfg, device="cuda", world_size=1, lengths=lengths), lengths=None,
                      dtype=requested.dtype)
    longest = replace(longest, search=SearchSpace(method=requested.method, tile_tokens=cfg.optimization.tile_tokens))
    shape, vision = longest.shape, longest.techniques.vision  # a VLM's tower: the most images a row of the data has
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 1

    def plan_or_none(budget: int) -> tuple[Plan | None, str | None]:
        try:
            return plan_run(cfg, device="cuda", world_size=world_size, budget_bytes=budget, lengths=lengths), None
        except BudgetError as exc:
            return None, exc.message

    def shardings(cards: int) -> tuple[bool, ...]:  # DDP, FSDP2, or under `auto` whichever holds the longer row
        try:
            strategy = fixed_strategy(cfg, requested.method, cards)[0]
        except ConfigError:
            return (False,)
        return {"fsdp": (True,), None: (False, True)}.get(strategy, (False,))

    cards = [_card(name, (memory, price, h2d), plan_or_none(memory), longest, world_size == 1, micro, t.seq_len,
                   gpus, shardings) for name, (memory, price, h2d) in GPU_CARDS.items()]
    fitting = [c for c in cards if c["fits"]]
    cheapest = min(fitting, key=lambda c: (c["price_per_hour"], c["memory_bytes"]))["card"] if fitting else None
    report: dict[str, Any] = {
        "model": str(cfg.model),
        "vision": None if vision is None else {
            "images_per_row": vision.images_per_row, "image_width": vision.geometry.width,
            "image_height": vision.geometry.height, "image_tokens": vision.geometry.tokens,
            "tower_tokens": vision.geometry.patches, "fixed_size": vision.geometry.fixed,
            "tower_trains": vision.lora_vision, "projector_trains": vision.lora_projector},
        "shape": {"params": shape.num_params, "layers": shape.num_layers, "hidden_size": shape.hidden_size,
                  "vocab_size": shape.vocab_size},
        "settings": {"method": "auto" if _planner_picks_method(cfg) and cfg.optimization.target_vram is not None
                     else cfg.method, "seq_len": t.seq_len, "batch_size": t.batch_size, "lora_r": cfg.lora.r,
                     "optimizer": t.optimizer, "dtype": requested.dtype, "loss_mode": cfg.optimization.loss_mode,
                     "world_size": world_size, "micro_batch": requested.micro_batch_size,
                     "checkpointing": requested.checkpointing_label, "attention": requested.attention.kind,
                     "objective": requested.objective},
        "requested": requested.to_dict(),
        "peak_bytes": requested.peak_bytes,
        "notes": list(requested.notes),
        "breakdown": dict(requested.breakdown),
        "cards": cards,
        "cheapest_card": cheapest,
        "longest_context_micro_batch": micro,
        "_requested": requested,
    }
    budget = cfg.optimization.target_vram
    if budget == "auto":
        import torch

        budget = resolve_budget("auto", "cuda") if torch.cuda.is_available() else None
    if isinstance(budget, int):
        plan, why = plan_or_none(budget)
        report["budget"] = {"budget_bytes": budget, "fits": plan is not None, "plan": plan.to_dict() if plan else None,
                            "why_not": why}
        report["_budget"] = plan
    return report


def _card(name: str, card: tuple[int, float, float], planned: tuple[Plan | None, str | None], longest: RunSpec,
          one_rank: bool, micro: int, seq_len: int, gpus: int | None,
          shardings: Callable[[int], tuple[bool, ...]]) -> dict[str, Any]:
    """One card's row of `plan_report`: its plan (or why none fits), the speed (compute- or
    transfer-bound) and cost guesses; for `one_rank`, the longest context of the run `longest`
    and the largest image of a VLM; with `gpus`, the longest context over several cards under
    context parallelism (`longest_over_cards`: DDP or FSDP2 as `shardings` allows). `card`: (memory bytes, US$/hour, host-to-device bytes/s), `GPU_CARDS`'."""
    memory, price, h2d = card
    plan, why = planned
    speed = bound = None
    if plan is not None and name in CARD_TFLOPS:
        speed, bound = card_tokens_per_s(plan, CARD_TFLOPS[name] * 1e12 / DEVICE_FLOPS["cuda"], h2d)
    tokens = max_seq_len_for_budget(longest, memory, micro_batch=micro) if one_rank else None
    image = (largest_image(longest, memory, seq_len=seq_len, micro_batch=micro)
             if one_rank and longest.techniques.vision is not None else None)
    longest_cp = {}
    if gpus:
        from maximus.memory.context_parallel import fewest_cards, longest_over_cards

        over_cards = longest_over_cards(longest, memory, gpus, shardings, micro_batch=micro)
        longest_cp = {"longest_context_over_cards": over_cards,
                      "context_parallel_for_seq": fewest_cards(over_cards, seq_len)}
    return {**longest_cp, "card": name, "memory_bytes": memory, "price_per_hour": price,
            "fits": plan is not None, "plan": plan.to_dict() if plan else None, "why_not": why,
            "longest_context_tokens": tokens, "largest_image": image, "tokens_per_s_guess": speed, "bound": bound,
            "usd_per_million_tokens": price / (speed * 3600) * 1e6 if speed else None}


#: How the calibrated estimate did in our own tests (docs/benchmarks/planner.md, "Calibrated by a
#: measured probe"): the largest error of its prediction for a 4x larger micro-batch.
MEASURED_ACCURACY = ("in Maximus' own tests (docs/benchmarks/planner.md, fp32 LoRA on CPU) the calibrated prediction "
                     "for a micro-batch of 3.5x-4.2x the probe's tokens was within {:.1%} of the measured peak "
                     "(4 runs), and within 4.4% at 8.1x (1 run)")
CALIBRATED_4X_WORST_ERROR = 0.032


def measure_report(cfg: Config, lengths: RowLengths, *, world_size: int = 1, steps: int = 3,
                   micro_batch: int = 1) -> dict[str, Any]:
    """`maximus plan --measure`: the probe (`maximus.train.probe.run_probe`), the calibrated
    prediction of the configured run on the probe's device, and per card the fastest plan whose
    calibrated peak fits (`maximus.memory.calibration.fit_card`), with how far each extrapolates
    from the probe (its largest micro-batch's tokens / the probe's)."""
    from maximus.memory.calibration import fit_card
    from maximus.memory.planner import DEFAULT_MARGIN
    from maximus.train.probe import run_probe

    cal = run_probe(cfg, steps=steps, micro_batch=micro_batch)
    here = plan_run(cfg, device=cal.device, world_size=world_size, lengths=lengths)

    def plan_for(budget: int) -> Plan | None:
        try:
            return plan_run(cfg, device="cuda", world_size=world_size, budget_bytes=budget, lengths=lengths)
        except BudgetError:
            return None

    def tokens(plan: Plan) -> int:
        return plan.micro_batch_tokens_max or plan.micro_batch_size * plan.seq_len

    cards = []
    for name, (memory, price, _) in GPU_CARDS.items():
        plan = fit_card(memory, cal, plan_for, DEFAULT_MARGIN)
        cards.append({"card": name, "memory_bytes": memory, "price_per_hour": price, "fits": plan is not None,
                      "plan": plan.to_dict() if plan else None,
                      "calibrated_peak_bytes": cal.peak(plan) if plan else None,
                      "extrapolation": tokens(plan) / cal.probe_tokens if plan else None})
    fitting = [c for c in cards if c["fits"]]
    ratios = [c["extrapolation"] for c in fitting]
    return {"probe": cal.to_dict(),
            "here": {"device": cal.device, "plan": here.to_dict(), "calibrated_peak_bytes": cal.peak(here),
                     "extrapolation": tokens(here) / cal.probe_tokens},
            "cards": cards,
            "cheapest_card": min(fitting, key=lambda c: (c["price_per_hour"], c["memory_bytes"]))["card"] if fitting
            else None,
            "extrapolation_range": [min(ratios), max(ratios)] if ratios else None,
            "accuracy": MEASURED_ACCURACY.format(CALIBRATED_4X_WORST_ERROR)}


def _print_measure(console, m: dict[str, Any]) -> None:
    from rich.table import Table

    p = m["probe"]
    console.print(f"measured probe: {p['steps']} optimizer steps at micro-batch {p['probe_micro_batch']} on "
                  f"{p['device']} (largest micro-batch {p['probe_tokens']:,} tokens): peak "
                  f"{format_bytes(p['measured_peak_bytes'])} measured, {format_bytes(p['predicted_peak_bytes'])} "
                  f"predicted ({p['probe_error']:+.1%}); resident {format_bytes(p['measured_static_bytes'])} measured / "
                  f"{format_bytes(p['predicted_static_bytes'])} predicted (x{p['static_scale']:.3f}), the step's "
                  f"growth x{p['dynamic_scale']:.3f}")
    h = m["here"]
    console.print(f"calibrated on {h['device']}: the run as configured (micro-batch {h['plan']['micro_batch_size']}, "
                  f"{h['extrapolation']:.1f}x the probe's tokens) {format_bytes(h['calibrated_peak_bytes'])} "
                  f"(uncalibrated estimate {format_bytes(h['plan']['peak_bytes'])})")
    table = Table(title="calibrated plan per card (the probe's measured ratios applied to the estimate)")
    for col in ("card", "memory", "plan", "estimate", "calibrated peak", "x probe tokens"):
        table.add_column(col, justify="left" if col in ("card", "plan") else "right")
    for c in m["cards"]:
        q = c["plan"]
        if q is None:
            table.add_row(c["card"], format_bytes(c["memory_bytes"]), "does not fit", "-", "-", "-")
            continue
        batch = (f"micro-batches of {q['micro_batch_tokens']} tokens" if q.get("micro_batch_tokens")
                 else f"mb {q['micro_batch_size']} x acc {q['grad_accum']}")
        table.add_row(c["card"], format_bytes(c["memory_bytes"]),
                      f"{q['method']} {batch}, ckpt {recompute_label(q['recompute'])}", format_bytes(q["peak_bytes"]),
                      format_bytes(c["calibrated_peak_bytes"]), f"{c['extrapolation']:.1f}")
    console.print(table)
    if m["extrapolation_range"]:
        lo, hi = m["extrapolation_range"]
        console.print(f"extrapolation: the card plans run micro-batches of {lo:.1f}x to {hi:.1f}x the probe's tokens; "
                      f"{m['accuracy']}; beyond about 4x, or on a device other than {m['probe']['device']}, treat "
                      f"the calibrated figure as an estimate")
    console.print(f"cheapest card that fits (calibrated): [bold]{m['cheapest_card'] or 'none'}[/bold]")


def _print_tables(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    s = report["settings"]
    console.print(f"[bold]{report['model']}[/bold]: {report['shape']['params'] / 1e9:.2f}B parameters, "
                  f"{s['method']}, {s['batch_size']} x {s['seq_len']} tokens, {s['dtype']}, loss {s['loss_mode']}")
    if report.get("vision"):
        v = report["vision"]
        trains = [n for n, k in (("tower", "tower_trains"), ("projector", "projector_trains")) if v[k]]
        console.print(f"images: {v['images_per_row']} per row of {v['image_width']}x{v['image_height']} pixels, "
                      f"{v['image_tokens']:,} image tokens ({v['tower_tokens']:,} in the tower)"
                      + (", the processor's fixed size" if v["fixed_size"] else "")
                      + f"; trained: language model{''.join(', ' + n for n in trains)}")
    if report.get("data_note"):
        console.print(f"note: {report['data_note']}")
    console.print(report["_requested"].table(title=f"requested setting (micro-batch {s['micro_batch']}, "
                                                   f"{s['checkpointing']} checkpointing)"))

    cards = Table(title="best plan per card; longest context: tokens per sequence that fit the card at micro-batch "
                        f"{report['longest_context_micro_batch']}")
    for col in ("card", "memory", "$/hour", "plan", "predicted peak", "tokens/s (guess)", "bound", "$/M tokens"):
        cards.add_column(col, justify="right" if col not in ("card", "plan") else "left")
    cards.add_column("longest context", justify="right", no_wrap=True)
    vision = report.get("vision")
    if vision:
        cards.add_column("largest image", justify="right", no_wrap=True)
    for c in report["cards"]:
        p = c["plan"]
        longest = [f"{c['longest_context_tokens']:,}" if c.get("longest_context_tokens") is not None else "-"]
        if vision:
            longest.append(_image_label(c.get("largest_image")))
        if p:
            cards.add_row(c["card"], format_bytes(c["memory_bytes"]), f"{c['price_per_hour']:.2f}", plan_summary(p),
                          format_bytes(p["peak_bytes"]), f"{c['tokens_per_s_guess'] or 0:.0f}", c.get("bound") or "-",
                          f"{c['usd_per_million_tokens']:.2f}" if c["usd_per_million_tokens"] else "-", *longest)
        else:
            cards.add_row(c["card"], format_bytes(c["memory_bytes"]), f"{c['price_per_hour']:.2f}",
                          "does not fit", "-", "-", "-", "-", *longest)
    console.print(cards)
    if report["cards"] and "longest_context_over_cards" in report["cards"][0]:
        degrees = list(report["cards"][0]["longest_context_over_cards"])
        over = Table(title=f"longest context over several cards (training.context_parallel, predicted); "
                           f"degree: the fewest cards for {s['seq_len']:,} tokens")
        for col in ("card", *(f"{n} card{'s' if n > 1 else ''}" for n in degrees), "degree"):
            over.add_column(col, justify="left" if col == "card" else "right", no_wrap=True)
        for c in report["cards"]:
            over.add_row(c["card"], *(f"{tokens:,}" for tokens in c["longest_context_over_cards"].values()),
                         str(c["context_parallel_for_seq"] or "-"))
        console.print(over)
    if report["cheapest_card"]:
        console.print(f"cheapest card that fits: [bold]{report['cheapest_card']}[/bold]")
    else:
        console.print("no listed card fits: use more GPUs (--world-size), method qlora, or a shorter --seq")
    if "budget" in report:
        b = report["budget"]
        if b["fits"]:
            console.print(report["_budget"].table())
        else:
            console.print(f"budget {format_bytes(b['budget_bytes'])}: {b['why_not']}")
    if "measure" in report:
        _print_measure(console, report["measure"])


def _image_label(image: dict | None) -> str:
    """`largest_image` in a few words: ``1288x1288 (2,116 tokens)``, ``fixed`` for a processor's one size."""
    if image is None:
        return "none fits"
    label = f"{image['width']}x{image['height']} ({image['image_tokens']:,} tokens)"
    return label + (", fixed" if image["fixed_size"] else "")


def plan_json(argv: list[str]) -> dict[str, Any]:
    """The object `maximus plan ARGV --json` prints (`maximus ui`'s planner page shows exactly this)."""
    args = _parser().parse_args(argv)
    return _public(_report(args))


def _report(args: argparse.Namespace) -> dict[str, Any]:
    """`plan_report` of the command line: with ``--config``, planned for the rows its data has."""
    from maximus.builtin import resolve

    written = _config(args)
    cfg = resolve(written)  # builtin: names (the embedded default), as maximus-train reads them
    if args.measure:
        if not args.config:
            raise ConfigError("maximus plan --measure needs --config (the probe trains the run it describes)",
                              "e.g. maximus plan --measure --config run.yaml")
        from maximus.train.order import read_lengths

        lengths, why = read_lengths(cfg, world_size=args.world_size), None  # the probe needs the data anyway
    else:
        lengths, why = data_lengths(cfg, args.world_size) if args.config else (None, None)
    report = plan_report(cfg, world_size=args.world_size, lengths=lengths, gpus=args.gpus)
    if args.measure:
        report["measure"] = measure_report(cfg, lengths, world_size=args.world_size, steps=args.probe_steps,
                                           micro_batch=args.probe_micro_batch)
    if why:
        report["notes"].append(why)
        report["data_note"] = why
    report["model"] = str(written.model)
    return report


def _public(report: dict[str, Any]) -> dict[str, Any]:
    """The report without the `Plan` objects kept for the tables."""
    return {k: v for k, v in report.items() if not k.startswith("_")}


def plan_main(argv: list[str]) -> int:
    """Entry point of `maximus plan`; returns the exit code. Raises MaximusError on bad input."""
    args = _parser().parse_args(argv)
    report = _report(args)
    if args.json:
        json.dump(_public(report), sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_tables(report)
    return 0
