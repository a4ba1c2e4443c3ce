"""Plan a run into a memory budget: the fastest configuration whose predicted peak fits.

`plan_for_budget` searches, with the analytic estimator (`maximus.memory.estimate`):

* method (only when the user asked for ``auto``): qlora, lora, full;
* micro-batch (every divisor of the per-rank batch) with gradient accumulation making up the
  rest, so the effective batch (micro-batch x accumulation x world size) never changes;
* checkpointing: off, selective, full, or the first k layers fully checkpointed (the smallest k
  that fits: recompute only what the budget requires);
* activation offload (checkpointed layer inputs in host memory) and optimizer-state offload;
* the lean loss's chunk size (the loss mode itself is the user's: exact by default; ghost and
  naive only when asked for);
* the tile of the sequence-tiled MLP recompute in fully checkpointed layers (`TILE_CHOICES`,
  or untiled): tiles cost a little speed, so a plan tiles only when untiled plans do not fit.

Among the plans whose predicted peak is at most ``budget x (1 - margin)`` it keeps the one with
the highest predicted tokens/s (ties: the smaller peak). When none fits it raises `BudgetError`
naming the smallest budget that would work and the setting that needs it.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Iterable, Sequence

from maximus.config import format_bytes, parse_bytes
from maximus.errors import BudgetError, ConfigError
from maximus.memory.adapter_terms import HEAD_NAMES
from maximus.memory.estimate import Estimate, default_loss_chunk, estimate_peak, model_shape, DTYPE_BYTES
from maximus.memory.lengths import RowLengths
from maximus.memory.plan import BREAKDOWN_ROWS, Plan

__all__ = ["Plan", "plan_for_budget", "resolve_budget", "max_seq_len_for_budget", "DEFAULT_MARGIN", "DEFAULT_ALLOW",
           "BREAKDOWN_ROWS"]

#: Fraction of the budget kept free for what no estimate sees: allocator fragmentation,
#: kernels' scratch space, the odd long batch.
DEFAULT_MARGIN = 0.10

#: What the planner may change by default. Add ``"adamw_8bit"`` to let it switch to 8-bit AdamW
#: (a numerics change, hence opt-in).
#: ``checkpointing`` = full and per-layer (first k layers) recompute; ``selective`` = per-op.
DEFAULT_ALLOW = frozenset({"checkpointing", "selective", "offload_activations", "offload_optimizer", "micro_batch",
                           "loss_chunk", "tile_tokens"})

#: Tile sizes (tokens) the planner tries for `optimization.tile_tokens: auto`, largest first.
TILE_CHOICES = (8192, 4096, 2048, 1024, 512, 256)

# ------------------------------------------------------------------------------------------------


def resolve_budget(value: Any, device: Any = "cuda") -> int | None:
    """A budget in bytes from a config value: a size (``16GB``), a card name, a number of bytes,
    ``auto`` (free memory of the device: `torch.cuda.mem_get_info` on CUDA, available RAM on
    CPU) or None (no budget)."""
    parsed = parse_bytes(value, "optimization.target_vram") if not isinstance(value, int) or isinstance(value, bool) else value
    if parsed is None:
        return None
    if parsed != "auto":
        return int(parsed)
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "mps" and hasattr(torch, "mps") and hasattr(torch.mps, "recommended_max_memory"):
        return int(torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory())
    import psutil

    return int(psutil.virtual_memory().available)


def _divisors(n: int) -> list[int]:
    return sorted({d for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0 for d in (i, n // i)})


def _describe(plan_kwargs: dict, seq_len: int, num_layers: int) -> str:
    gc = plan_kwargs["checkpointing"]
    if isinstance(gc, int):
        gc_text = f"checkpointing {gc}/{num_layers} layers"
    else:
        gc_text = {"off": "no checkpointing", "full": "full checkpointing", "selective": "selective checkpointing"}[gc]
    parts = [plan_kwargs["method"], f"micro_batch {plan_kwargs['micro_batch']}", gc_text]
    if plan_kwargs.get("offload_activations"):
        parts.append("activation offload")
    if plan_kwargs.get("offload_optimizer"):
        parts.append("optimizer offload")
    if plan_kwargs.get("tile_tokens"):
        parts.append(f"MLP tiles of {plan_kwargs['tile_tokens']} tokens")
    parts.append(f"seq {seq_len}")
    return ", ".join(parts)


def _candidates(shape, *, methods, micro_batches, checkpointings, offload_act_options, offload_opt_options,
                optimizers, loss_mode, chunks_for, tiles_for):
    """Every combination the planner may pick, cheapest knobs first (see `plan_for_budget`)."""
    for method in methods:
        for mb in micro_batches:
            for gc in checkpointings:
                recomputes = gc != "off"
                for off_act in offload_act_options:
                    if off_act and (not recomputes or gc == "selective"):
                        continue  # only checkpointed layer inputs can be offloaded
                    for off_opt in offload_opt_options:
                        for opt in optimizers:
                            for chunk in chunks_for(mb, method):
                                # Only fully recomputed layers are tiled.
                                for tile in (tiles_for(mb) if gc == "full" else [None]):
                                    yield dict(method=method, micro_batch=mb, checkpointing=gc,
                                               offload_activations=off_act, offload_optimizer=off_opt, optimizer=opt,
                                               loss_mode=loss_mode, loss_chunk_tokens=chunk, tile_tokens=tile)


def plan_for_budget(model_config: Any, budget_bytes: int | None, *, method: str = "lora", batch_size: int = 8,
                    seq_len: int = 2048, world_size: int = 1, allow: Iterable[str] | None = None, dtype: str = "bf16",
                    optimizer: str = "adamw", lora_r: int = 16, lora_targets: str | Sequence[str] = "all-linear",
                    loss_mode: str = "exact", loss_chunk_size: int | str | None = "auto",
                    micro_batch_size: int | str = "auto", gradient_checkpointing: str = "auto",
                    offload_activations: str | bool = "auto", offload_optimizer: str | bool = "auto",
                    margin: float = DEFAULT_MARGIN, device: str = "cuda", sharded: bool | None = None,
                    free_memory: bool = False, tile_tokens: int | str | None = "auto", lean_lora: bool = True,
                    name_longest: bool = True, host_budget_bytes: int | None = None,
                    lengths: RowLengths | None = None, micro_batch_tokens: int | str | None = None,
                    **techniques: Any) -> Plan:
    """The fastest plan whose predicted peak is at most ``budget_bytes * (1 - margin)``.

    Fixed settings (an int micro-batch, ``gradient_checkpointing: full``, ``offload_*: on/off``,
    an int chunk) are honoured; ``auto`` ones are searched. ``allow`` limits what the planner may
    change (default `DEFAULT_ALLOW`). With ``budget_bytes=None`` the fastest plan is returned
    (no budget: the estimate is still recorded). ``sharded`` says whether the ``world_size`` ranks
    shard the model (FSDP2) or each hold all of it (DDP); None = `estimate_peak`'s default.
    ``techniques`` are `estimate_peak`'s technique keywords (attention, kronecker, objective,
    dpo_reference, matryoshka_*, offload_params, ghost_candidates), passed to every estimate:
    `maximus.memory.estimate.technique_kwargs(cfg)` reads them from a Config.
    On CPU nothing is offloaded unless asked: host and device memory are the same memory.

    ``tile_tokens``: ``auto`` (searched, `TILE_CHOICES`, when ``allow`` has ``tile_tokens``), ``off``
    / None, or a tile size (a tile of at least the micro-batch's tokens is one tile: untiled, noted).
    ``lean_lora``: adapters run as Maximus' lean projections (`optimization.lean_lora`), else PEFT's.
    ``name_longest``: when nothing fits, the error also names the longest sequence that would fit
    with the same settings (`max_seq_len_for_budget`, which turns it off for its own search).

    ``lengths``: the rows the run really has (`maximus.memory.lengths.RowLengths`): each micro-batch
    size is planned for the largest micro-batch the loader forms with it (its tokens, padding
    included), ``seq_len`` staying the cap; None plans every row at ``seq_len`` tokens.

    ``micro_batch_tokens`` (needs ``lengths``): split each step's rows into micro-batches by a
    token budget (`maximus.memory.lengths.split_by_tokens`) instead of a row count: an int is
    that budget, ``auto`` searches budgets from the longest row up to the whole step (doubling);
    each is planned for its largest micro-batch and for the most micro-batches a step has.

    ``host_budget_bytes``: the host memory offloading may fill (`plan_run` passes the available RAM when
    it plans for a real GPU of this machine); a plan
    whose offloaded state (`Estimate.host_bytes`) needs more is not chosen. None: not checked.

    ``free_memory=True`` says ``budget_bytes`` is not the user's budget but the device's free
    memory (no ``target_vram``): the fastest plan that fits it, and when none does, the plan that
    needs the least memory, with a note (a run the user did not bound is attempted, not refused).

    Raises:
        BudgetError: nothing fits (and not ``free_memory``); the message names the smallest
            budget that would work.
        ConfigError: the batch cannot be split evenly over the ranks, or a setting is unknown
            (a tile_tokens below 1); ``micro_batch_tokens`` below the longest row (named).
    """
    allow = DEFAULT_ALLOW if allow is None else frozenset(allow)
    if isinstance(tile_tokens, bool) or (isinstance(tile_tokens, int) and tile_tokens < 1) or (
            not isinstance(tile_tokens, int) and tile_tokens not in ("auto", "off", None)):
        raise ConfigError(f"optimization.tile_tokens must be a positive number of tokens, auto or off, got {tile_tokens!r}",
                          "use e.g. tile_tokens: 4096, or off")
    shape = model_shape(model_config)
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}", "use bf16, fp16 or fp32")
    if batch_size % world_size:
        raise ConfigError(f"training.batch_size {batch_size} is not a multiple of the {world_size} ranks",
                          f"use a batch_size divisible by {world_size}")
    per_rank = batch_size // world_size

    # `auto` chooses between the adapter methods (the product's promise: LoRA or QLoRA, an adapter per
    # task); full fine-tuning only when asked. On a tiny model full would rank fastest by a hair.
    methods = ["qlora", "lora"] if method == "auto" else [method]
    token_budgets = _token_budgets(micro_batch_tokens, lengths, per_rank)
    if token_budgets:
        micro_batches = token_budgets  # searched like micro-batch sizes: one key per budget
    elif isinstance(micro_batch_size, int):
        if per_rank % micro_batch_size:
            raise ConfigError(f"training.micro_batch_size {micro_batch_size} does not divide the per-rank batch {per_rank}",
                              "pick a divisor of batch_size / world size, or auto")
        micro_batches = [micro_batch_size]
    else:
        micro_batches = _divisors(per_rank) if "micro_batch" in allow else [min(per_rank, 4)]
    if gradient_checkpointing in ("off", "full", "selective"):
        checkpointings: list[Any] = [gradient_checkpointing]
    else:
        checkpointings = ["off"] + (["selective"] if "selective" in allow else []) + (
            ["full"] if "checkpointing" in allow else [])
    # On a CPU the host memory is the device memory: offloading to it frees nothing.
    host_is_device = str(device).split(":")[0] == "cpu"
    off_act = _switch(offload_activations, "offload_activations" in allow and not host_is_device)
    off_opt = _switch(offload_optimizer, "offload_optimizer" in allow and not host_is_device)
    optimizers = [optimizer] + (["adamw_8bit"] if "adamw_8bit" in allow and optimizer == "adamw" else [])
    b = DTYPE_BYTES[dtype]
    trains_head = bool({str(n).rsplit(".", 1)[-1] for n in techniques.get("modules_to_save") or ()} & HEAD_NAMES)

    def seq_for(mb: int) -> int:
        """Tokens per row the estimate of micro-batch key `mb` (rows, or a token budget) assumes."""
        if token_budgets:
            return lengths.token_split(mb).largest.row_tokens
        return lengths.largest_micro_batch(mb).row_tokens if lengths is not None else seq_len

    def rows_for(mb: int) -> int:
        """Rows of the largest micro-batch of key `mb`."""
        return lengths.token_split(mb).largest.rows if token_budgets else mb

    def accum_for(mb: int) -> int:
        """Micro-batches per step (the most of any step) for key `mb`."""
        return lengths.token_split(mb).micro_batches if token_budgets else per_rank // mb

    def chunks_for(mb: int, method: str) -> list[int | None]:
        if loss_mode == "naive":
            return [None]
        if loss_mode == "ghost":
            # The ghost loss's chunk is how many tokens share one candidate set: the trainer
            # passes only a chunk the user set, so the planner does not search it.
            return [loss_chunk_size if isinstance(loss_chunk_size, int) else None]
        if isinstance(loss_chunk_size, int):
            return [loss_chunk_size]
        tokens = rows_for(mb) * seq_for(mb)
        # Full fine-tuning trains the head: its chunks have a larger floor (the loss's own default).
        default = default_loss_chunk(tokens, shape.vocab_size, b, trainable_head=method == "full" or trains_head)
        if "loss_chunk" not in allow:
            return [default]
        smaller = [c for c in (1024, 512, 256, 128, 64, 32) if c < default]
        return [default] + smaller

    def tiles_for(mb: int) -> list[int | None]:
        if isinstance(tile_tokens, int):
            return [tile_tokens]
        if tile_tokens != "auto" or "tile_tokens" not in allow:
            return [None]
        return [None] + [t for t in TILE_CHOICES if t < rows_for(mb) * seq_for(mb)]

    usable = None if budget_bytes is None else int(budget_bytes * (1 - margin))
    common = dict(dtype=dtype, lora_r=lora_r, lora_targets=lora_targets, world_size=world_size,
                  device=device, sharded=sharded, lean_lora=lean_lora, **techniques)

    def masked_for(mb: int) -> bool:
        """Whether some micro-batch of key `mb` is attended with a document mask."""
        if lengths is None:
            return False
        return (lengths.token_split(mb).largest if token_budgets else lengths.largest_micro_batch(mb)).masked

    def est(kw: dict, mb: int) -> Estimate:
        return estimate_peak(shape, grad_accum=accum_for(mb), seq_len=seq_for(mb), masked_attention=masked_for(mb),
                             **common, **dict(kw, micro_batch=rows_for(mb)))

    def as_plan(kw: dict, e: Estimate) -> Plan:
        key = kw["micro_batch"]
        plan = _to_plan(dict(kw, micro_batch=rows_for(key)), e, shape, budget_bytes, margin, per_rank, world_size,
                        seq_for(key), dtype, lora_r, device)
        if token_budgets:
            split = lengths.token_split(key)
            notes = (f"micro-batches of up to {key:,} tokens (up to {split.rows} rows, up to {split.micro_batches} per "
                     f"step) keep the effective batch of {per_rank * world_size}",) + plan.notes[1:]
            plan = replace(plan, grad_accum=split.micro_batches, micro_batch_tokens=key, rows_per_step=per_rank,
                           notes=notes)
        return _with_lengths(plan, lengths)

    def describe(kw: dict) -> str:
        key = kw["micro_batch"]
        text = _describe(dict(kw, micro_batch=rows_for(key)), seq_for(key), shape.num_layers)
        return text + (f", micro-batches of up to {key:,} tokens" if token_budgets else "")

    best: tuple[float, int, dict, Estimate] | None = None
    smallest: tuple[int, dict, Estimate] | None = None
    host_short: Estimate | None = None  # the least host-hungry plan that fit the device but not the host
    for kw in _candidates(shape, methods=methods, micro_batches=micro_batches, checkpointings=checkpointings,
                          offload_act_options=off_act, offload_opt_options=off_opt, optimizers=optimizers,
                          loss_mode=loss_mode, chunks_for=chunks_for, tiles_for=tiles_for):
        mb = kw["micro_batch"]
        e = est(kw, mb)
        if usable is not None and e.peak_bytes > usable and kw["checkpointing"] == "off" and "checkpointing" in allow \
                and gradient_checkpointing == "auto":
            # Between off and full: checkpoint just enough layers (the fewest that fit).
            kw, e = _fewest_checkpointed_layers(kw, e, usable, shape.num_layers, lambda k: est(k, mb))
        if host_budget_bytes is not None and e.host_bytes > host_budget_bytes:
            if (usable is None or e.peak_bytes <= usable) and (host_short is None or e.host_bytes < host_short.host_bytes):
                host_short = e
            continue
        if smallest is None or e.peak_bytes < smallest[0]:
            smallest = (e.peak_bytes, kw, e)
        if usable is None or e.peak_bytes <= usable:
            key = (e.tokens_per_s_guess, -e.peak_bytes)
            if best is None or key > best[:2]:
                best = (e.tokens_per_s_guess, -e.peak_bytes, kw, e)
    if smallest is None:  # every plan needs more host memory than there is
        raise BudgetError(f"every plan that fits needs more host memory than the {format_bytes(host_budget_bytes)} "
                          f"available for offloaded state (the least: {format_bytes(host_short.host_bytes)})",
                          "free host RAM, lower training.seq_len, or raise target_vram so less is offloaded")
    if best is None and free_memory:
        _, kw, e = smallest
        plan = as_plan(kw, e)
        return replace(plan, notes=plan.notes + (f"no plan fits the {format_bytes(budget_bytes)} of free memory; "
                                                 f"running the smallest ({describe(kw)})",))
    if best is None:
        needed = math.ceil(smallest[0] / (1 - margin))
        hint = "raise target_vram, lower training.seq_len, or use method: qlora"
        if "qlora" in methods:
            hint = "raise target_vram or lower training.seq_len"
        longest = ""
        if name_longest and world_size == 1 and budget_bytes is not None and not token_budgets:
            mb = min(micro_batches)
            n = max_seq_len_for_budget(
                shape, budget_bytes, method=method, micro_batch=mb, dtype=dtype, optimizer=optimizer, lora_r=lora_r,
                lora_targets=lora_targets, loss_mode=loss_mode, allow=allow, margin=margin, device=device,
                limit=max(1, seq_len - 1), tile_tokens=tile_tokens, lean_lora=lean_lora,
                gradient_checkpointing=gradient_checkpointing, offload_activations=offload_activations,
                offload_optimizer=offload_optimizer, loss_chunk_size=loss_chunk_size,
                host_budget_bytes=host_budget_bytes, **techniques)
            longest = (f"; the longest sequence that fits is {n:,} tokens at micro-batch {mb}" if n
                       else "; not even one token fits")
        host = ""
        if host_short is not None:
            host = (f"; plans that offload more would fit but need {format_bytes(host_short.host_bytes)} of host "
                    f"memory, {format_bytes(host_budget_bytes)} available")
        raise BudgetError(f"nothing fits in {format_bytes(budget_bytes)}: the smallest plan needs "
                          f"{format_bytes(needed)} ({describe(smallest[1])}){longest}{host}",
                          hint)
    _, _, kw, e = best
    plan = as_plan(kw, e)
    if host_budget_bytes is not None:
        plan = replace(plan, host_budget_bytes=host_budget_bytes)
    if free_memory:
        plan = replace(plan, notes=plan.notes + (f"no target_vram: fitted to the {format_bytes(budget_bytes)} of free memory",))
    return plan


def _with_lengths(plan: Plan, lengths: RowLengths | None) -> Plan:
    """`plan` with the lengths it assumed (the longest row, the largest micro-batch's tokens) and
    the data's notes; unchanged when planned at seq_len."""
    if lengths is None:
        return plan
    mb = (lengths.token_split(plan.micro_batch_tokens).largest if plan.micro_batch_tokens
          else lengths.largest_micro_batch(plan.micro_batch_size))
    note = (f"planned for the data's rows: the longest has {lengths.longest:,} tokens (training.seq_len "
            f"{lengths.cap:,} is the cap), the largest micro-batch {mb.tokens:,} tokens ({mb.rows} rows"
            + (", unpadded)" if mb.tokens < mb.rows * mb.longest else f" of {mb.longest:,})"))
    return replace(plan, rows_tokens_max=lengths.longest, micro_batch_tokens_max=mb.tokens,
                   notes=plan.notes + (note,) + lengths.notes)


def _token_budgets(micro_batch_tokens: int | str | None, lengths: RowLengths | None, per_rank: int) -> list[int]:
    """The token budgets to search for ``training.micro_batch_tokens`` (empty: row-count micro-batches)."""
    if micro_batch_tokens is None:
        return []
    if lengths is None:
        raise ConfigError("training.micro_batch_tokens needs the data's row lengths, which were not read",
                          "make the dataset and the tokenizer readable here, or set micro_batch_tokens: null")
    longest = lengths.longest
    if isinstance(micro_batch_tokens, int):
        if micro_batch_tokens < longest:
            raise ConfigError(f"training.micro_batch_tokens {micro_batch_tokens} is below the longest training row "
                              f"({longest} tokens)", f"set micro_batch_tokens to at least {longest}, or auto")
        return [micro_batch_tokens]
    budgets, budget = [], longest
    while budget < per_rank * longest:
        budgets.append(budget)
        budget *= 2
    return budgets + [per_rank * longest]


def _switch(value: str | bool, allowed: bool) -> list[bool]:
    if value in (True, "on"):
        return [True]
    if value in (False, "off"):
        return [False]
    if value != "auto":
        raise ConfigError(f"offload setting must be auto, on or off, got {value!r}", "see optimization.offload")
    return [False, True] if allowed else [False]


def _fewest_checkpointed_layers(kw: dict, e_off: Estimate, usable: int, num_layers: int, estimate):
    """Binary search the smallest number of fully checkpointed layers whose peak fits."""
    lo, hi = 1, num_layers - 1
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = dict(kw, checkpointing=mid)
        e = estimate(trial)
        if e.peak_bytes <= usable:
            found = (trial, e)
            hi = mid - 1
        else:
            lo = mid + 1
    return found if found else (kw, e_off)


def _to_plan(kw: dict, e: Estimate, shape, budget: int | None, margin: float, per_rank: int, world_size: int,
             seq_len: int, dtype: str, lora_r: int, device: str) -> Plan:
    gc = kw["checkpointing"]
    L = shape.num_layers
    if isinstance(gc, int):
        recompute = ("full",) * gc + ("none",) * (L - gc)
    else:
        recompute = ({"off": "none"}.get(gc, gc),) * L
    mb = kw["micro_batch"]
    margin_bytes = int(budget * margin) if budget else 0
    notes = [f"micro-batch {mb} x gradient accumulation {per_rank // mb} x {world_size} rank(s) keeps the "
             f"effective batch of {per_rank * world_size}"]
    if budget:
        notes.append(f"predicted peak {format_bytes(e.peak_bytes)} of {format_bytes(budget)} "
                     f"({e.peak_bytes / budget:.0%}), {format_bytes(margin_bytes)} kept as margin")
    if isinstance(gc, int):
        notes.append(f"{gc} of {L} layers fully checkpointed: the fewest that fit")
    tile = kw.get("tile_tokens")
    if tile and tile >= mb * seq_len:
        notes.append(f"tile_tokens {tile} >= the micro-batch's {mb * seq_len} tokens: one tile (the MLP runs untiled)")
    elif tile:
        notes.append(f"the MLP of each fully recomputed layer runs over {math.ceil(mb * seq_len / tile)} tiles of "
                     f"{tile} tokens in backward")
    notes += [n for n in e.notes if n not in notes]
    sharded = bool(e.settings.get("sharded"))
    strategy = "single" if world_size == 1 else ("fsdp" if sharded else "ddp")
    return Plan(method=kw["method"], micro_batch_size=mb, grad_accum=per_rank // mb, recompute=recompute,
                offload_activations=kw["offload_activations"], offload_optimizer=kw["offload_optimizer"],
                optimizer=kw["optimizer"], loss_mode=kw["loss_mode"], loss_chunk_size=kw["loss_chunk_tokens"],
                peak_bytes=e.peak_bytes, breakdown=dict(e.breakdown), budget_bytes=budget, margin_bytes=margin_bytes,
                peak_phase=e.phase, seq_len=seq_len, world_size=world_size, dtype=dtype,
                lora_r=lora_r if kw["method"] != "full" else None, device=str(device).split(":")[0],
                strategy=strategy, tokens_per_s_guess=e.tokens_per_s_guess, notes=tuple(notes), tile_tokens=tile,
                host_bytes=e.host_bytes)


def max_seq_len_for_budget(model_config: Any, budget_bytes: int, *, method: str = "qlora", micro_batch: int = 1,
                           dtype: str = "bf16", optimizer: str = "adamw", lora_r: int = 16,
                           lora_targets: str | Sequence[str] = "all-linear", loss_mode: str = "exact",
                           allow: Iterable[str] | None = None, margin: float = DEFAULT_MARGIN, device: str = "cuda",
                           limit: int = 1 << 22, tile_tokens: int | str | None = "auto", lean_lora: bool = True,
                           **techniques: Any) -> int:
    """The longest sequence (tokens) for which some plan with this micro-batch fits the budget;
    0 if not even one token fits. Every knob in ``allow`` may be used (full checkpointing,
    activation offload, small loss chunks, the MLP tile: `plan_for_budget` searches it when
    ``tile_tokens`` is ``auto``); ``lean_lora`` and ``techniques`` (any other `plan_for_budget`
    keyword: fixed checkpointing, offload, loss chunk, Kronecker, ...) as in `plan_for_budget`."""

    def fits(seq: int) -> bool:
        try:
            plan_for_budget(model_config, budget_bytes, method=method, batch_size=micro_batch, seq_len=seq,
                            micro_batch_size=micro_batch, allow=allow, dtype=dtype, optimizer=optimizer,
                            lora_r=lora_r, lora_targets=lora_targets, loss_mode=loss_mode, margin=margin, device=device,
                            tile_tokens=tile_tokens, lean_lora=lean_lora, name_longest=False, **techniques)
            return True
        except BudgetError:
            return False

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
