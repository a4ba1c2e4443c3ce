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

import inspect
import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from maximus.config import format_bytes, parse_bytes
from maximus.errors import BudgetError, ConfigError
from maximus.memory.adapter_terms import HEAD_NAMES
from maximus.memory.estimate import (DTYPE_BYTES, Estimate, ModelShape, default_loss_chunk, estimate_step, model_shape,
                                     step_spec)
from maximus.memory.lengths import RowLengths
from maximus.memory.plan import BREAKDOWN_ROWS, Plan

__all__ = ["Plan", "RunStep", "plan_for_budget", "resolve_budget", "max_seq_len_for_budget", "DEFAULT_MARGIN", "DEFAULT_ALLOW",
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


@dataclass(frozen=True)
class RunStep:
    """What every estimate of one run shares, read once: the model's shape and the `estimate_peak`
    keywords the search never varies (dtype, adapter rank and targets, ranks, device, lean LoRA,
    the techniques). `plan_run` builds it from the config (`maximus.memory.run_plan.run_step`);
    the plan keeps it (`Plan.step`), so a re-plan re-estimates without reading the model again."""

    shape: ModelShape
    settings: Mapping[str, Any]

    @classmethod
    def of(cls, model_config: Any, *, dtype: str = "bf16", lora_r: int = 16,
           lora_targets: str | Sequence[str] = "all-linear", world_size: int = 1, device: str = "cuda",
           lean_lora: bool = True, **techniques: Any) -> "RunStep":
        """The step of `model_config` (anything `model_shape` reads) with these settings."""
        shape = model_shape(model_config)
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {dtype!r}", "use bf16, fp16 or fp32")
        return cls(shape, dict(dtype=dtype, lora_r=lora_r, lora_targets=lora_targets, world_size=world_size,
                               device=device, lean_lora=lean_lora, **techniques))

    dtype = property(lambda self: self.settings["dtype"], doc="The training dtype (bf16, fp16, fp32).")
    lora_r = property(lambda self: self.settings["lora_r"], doc="The adapter rank.")
    world_size = property(lambda self: self.settings["world_size"], doc="The ranks the run trains on.")
    device = property(lambda self: self.settings["device"], doc="The device type (cuda, cpu, mps).")

    @property
    def trains_head(self) -> bool:
        """`lora.modules_to_save` names the output head (the loss's chunks then have a larger floor)."""
        return bool({str(n).rsplit(".", 1)[-1] for n in self.settings.get("modules_to_save") or ()} & HEAD_NAMES)

    def estimate(self, **knobs: Any) -> Estimate:
        """The estimate of this step with the candidate's `knobs` (`estimate_peak` keywords)."""
        return estimate_step(step_spec(self.shape, **self.settings, **knobs))


@dataclass(frozen=True)
class _Space:
    """What `plan_for_budget` searches and how a candidate (a dict of `estimate_peak` knobs whose
    ``micro_batch`` is a key: rows, or a token budget) becomes an estimate and a plan."""

    step: RunStep
    budget: int | None
    margin: float
    seq_len: int
    per_rank: int
    methods: list[str]
    micro_batches: list[int]
    checkpointings: list[Any]
    offload_act: list[bool]
    offload_opt: list[bool]
    optimizers: list[str]
    loss_mode: str
    loss_chunk_size: int | str | None
    tile_tokens: int | str | None
    allow: frozenset
    lengths: RowLengths | None
    token_budgets: list[int]
    sharded: bool | None

    @property
    def usable(self) -> int | None:
        return None if self.budget is None else int(self.budget * (1 - self.margin))

    def seq_for(self, mb: int) -> int:
        """Tokens per row the estimate of micro-batch key `mb` (rows, or a token budget) assumes."""
        if self.token_budgets:
            return self.lengths.token_split(mb).largest.row_tokens
        return self.lengths.largest_micro_batch(mb).row_tokens if self.lengths is not None else self.seq_len

    def rows_for(self, mb: int) -> int:
        """Rows of the largest micro-batch of key `mb`."""
        return self.lengths.token_split(mb).largest.rows if self.token_budgets else mb

    def accum_for(self, mb: int) -> int:
        """Micro-batches per step (the most of any step) for key `mb`."""
        return self.lengths.token_split(mb).micro_batches if self.token_budgets else self.per_rank // mb

    def masked_for(self, mb: int) -> bool:
        """Whether some micro-batch of key `mb` is attended with a document mask."""
        if self.lengths is None:
            return False
        split = self.lengths.token_split(mb).largest if self.token_budgets else self.lengths.largest_micro_batch(mb)
        return split.masked

    def chunks_for(self, mb: int, method: str) -> list[int | None]:
        if self.loss_mode == "naive":
            return [None]
        if self.loss_mode == "ghost":
            # The ghost loss's chunk is how many tokens share one candidate set: the trainer
            # passes only a chunk the user set, so the planner does not search it.
            return [self.loss_chunk_size if isinstance(self.loss_chunk_size, int) else None]
        if isinstance(self.loss_chunk_size, int):
            return [self.loss_chunk_size]
        tokens = self.rows_for(mb) * self.seq_for(mb)
        # Full fine-tuning trains the head: its chunks have a larger floor (the loss's own default).
        default = default_loss_chunk(tokens, self.step.shape.vocab_size, DTYPE_BYTES[self.step.dtype],
                                     trainable_head=method == "full" or self.step.trains_head)
        if "loss_chunk" not in self.allow:
            return [default]
        return [default] + [c for c in (1024, 512, 256, 128, 64, 32) if c < default]

    def tiles_for(self, mb: int) -> list[int | None]:
        if isinstance(self.tile_tokens, int):
            return [self.tile_tokens]
        if self.tile_tokens != "auto" or "tile_tokens" not in self.allow:
            return [None]
        return [None] + [t for t in TILE_CHOICES if t < self.rows_for(mb) * self.seq_for(mb)]

    def candidates(self) -> Iterable[dict]:
        """Every combination the planner may pick, cheapest knobs first."""
        for method in self.methods:
            for mb in self.micro_batches:
                for gc in self.checkpointings:
                    for off_act in self.offload_act:
                        if off_act and gc in ("off", "selective"):
                            continue  # only checkpointed layer inputs can be offloaded
                        for off_opt, opt in itertools.product(self.offload_opt, self.optimizers):
                            for chunk in self.chunks_for(mb, method):
                                for tile in (self.tiles_for(mb) if gc == "full" else [None]):  # full layers only
                                    yield dict(method=method, micro_batch=mb, checkpointing=gc,
                                               offload_activations=off_act, offload_optimizer=off_opt, optimizer=opt,
                                               loss_mode=self.loss_mode, loss_chunk_tokens=chunk, tile_tokens=tile)

    def estimate(self, kw: dict) -> Estimate:
        mb = kw["micro_batch"]
        return self.step.estimate(grad_accum=self.accum_for(mb), seq_len=self.seq_for(mb), sharded=self.sharded,
                                  masked_attention=self.masked_for(mb), **dict(kw, micro_batch=self.rows_for(mb)))

    def as_plan(self, kw: dict, e: Estimate) -> Plan:
        key, step = kw["micro_batch"], self.step
        plan = _to_plan(dict(kw, micro_batch=self.rows_for(key)), e, step.shape, self.budget, self.margin, self.per_rank,
                        step.world_size, self.seq_for(key), step.dtype, step.lora_r, step.device)
        if self.token_budgets:
            split = self.lengths.token_split(key)
            notes = (f"micro-batches of up to {key:,} tokens (up to {split.rows} rows, up to {split.micro_batches} per "
                     f"step) keep the effective batch of {self.per_rank * step.world_size}",) + plan.notes[1:]
            plan = replace(plan, grad_accum=split.micro_batches, micro_batch_tokens=key, rows_per_step=self.per_rank,
                           notes=notes)
        return replace(_with_lengths(plan, self.lengths), step=step)

    def describe(self, kw: dict) -> str:
        key = kw["micro_batch"]
        text = _describe(dict(kw, micro_batch=self.rows_for(key)), self.seq_for(key), self.step.shape.num_layers)
        store = self.step.settings.get("offload_params")
        if store in (True, "on", "disk"):
            text += ", frozen weights streamed from " + ("disk" if store == "disk" else "host memory")
        return text + (f", micro-batches of up to {key:,} tokens" if self.token_budgets else "")


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
    _check_tile_tokens(tile_tokens)
    step = model_config if isinstance(model_config, RunStep) else RunStep.of(
        model_config, dtype=dtype, lora_r=lora_r, lora_targets=lora_targets, world_size=world_size, device=device,
        lean_lora=lean_lora, **techniques)
    space_kw = dict(method=method, batch_size=batch_size, seq_len=seq_len, allow=allow,
                    optimizer=optimizer, loss_mode=loss_mode, loss_chunk_size=loss_chunk_size,
                    micro_batch_size=micro_batch_size, gradient_checkpointing=gradient_checkpointing,
                    offload_activations=offload_activations, offload_optimizer=offload_optimizer,
                    margin=margin, sharded=sharded, tile_tokens=tile_tokens, lengths=lengths,
                    micro_batch_tokens=micro_batch_tokens)
    streaming = step.settings.get("offload_params", False)
    if streaming == "auto":
        step = RunStep(step.shape, {**step.settings, "offload_params": False})
    space = _search_space(step, budget_bytes, **space_kw)
    found = _search(space, gradient_checkpointing, host_budget_bytes)
    if streaming == "auto" and found.best is None and budget_bytes is not None and _can_stream(step, method):
        # Every cheaper lever was searched and nothing fits: stream the frozen weights, from host
        # memory when it has room for them, else from a file on disk.
        for store in ("on", "disk"):
            streamed = _search_space(RunStep(step.shape, {**step.settings, "offload_params": store}), budget_bytes,
                                     **space_kw)
            found_streamed = _search(streamed, gradient_checkpointing, host_budget_bytes)
            if found_streamed.best is not None or (store == "on" and found_streamed.smallest is not None):
                # The one that fits; else streaming from host memory names the smallest plan there is.
                space, found = streamed, found_streamed
            if found.best is not None:
                break
    if found.smallest is None:  # every plan needs more host memory than there is
        raise BudgetError(f"every plan that fits needs more host memory than the {format_bytes(host_budget_bytes)} "
                          f"available for offloaded state (the least: {format_bytes(found.host_short.host_bytes)})",
                          "free host RAM, lower training.seq_len, or raise target_vram so less is offloaded")
    if found.best is None and free_memory:
        _, kw, e = found.smallest
        plan = space.as_plan(kw, e)
        return replace(plan, notes=plan.notes + (f"no plan fits the {format_bytes(budget_bytes)} of free memory; "
                                                 f"running the smallest ({space.describe(kw)})",))
    if found.best is None:
        raise _nothing_fits(space, found, method=method, optimizer=optimizer, loss_mode=loss_mode,
                            name_longest=name_longest, seq_len=seq_len, tile_tokens=tile_tokens,
                            host_budget_bytes=host_budget_bytes,
                            fixed=dict(gradient_checkpointing=gradient_checkpointing,
                                       offload_activations=offload_activations, offload_optimizer=offload_optimizer,
                                       loss_chunk_size=loss_chunk_size))
    _, _, kw, e = found.best
    plan = space.as_plan(kw, e)
    if host_budget_bytes is not None:
        plan = replace(plan, host_budget_bytes=host_budget_bytes)
    if free_memory:
        plan = replace(plan, notes=plan.notes + (f"no target_vram: fitted to the {format_bytes(budget_bytes)} of free memory",))
    return plan


def _can_stream(step: RunStep, method: str) -> bool:
    """Whether streaming frozen weights can save device memory: a GPU (on a CPU the host is the
    device) and an adapter method (full fine-tuning has no frozen weights)."""
    return str(step.device).split(":")[0] != "cpu" and method != "full"


def _check_tile_tokens(tile_tokens: Any) -> None:
    if isinstance(tile_tokens, bool) or (isinstance(tile_tokens, int) and tile_tokens < 1) or (
            not isinstance(tile_tokens, int) and tile_tokens not in ("auto", "off", None)):
        raise ConfigError(f"optimization.tile_tokens must be a positive number of tokens, auto or off, got {tile_tokens!r}",
                          "use e.g. tile_tokens: 4096, or off")


def _search_space(step: RunStep, budget_bytes: int | None, *, method: str, batch_size: int, seq_len: int,
                  allow: Iterable[str] | None, optimizer: str, loss_mode: str, loss_chunk_size: int | str | None,
                  micro_batch_size: int | str, gradient_checkpointing: str, offload_activations: str | bool,
                  offload_optimizer: str | bool, margin: float, sharded: bool | None, tile_tokens: int | str | None,
                  lengths: RowLengths | None, micro_batch_tokens: int | str | None) -> _Space:
    """The candidates `plan_for_budget` may pick: fixed settings as given, `auto` ones searched."""
    allow = DEFAULT_ALLOW if allow is None else frozenset(allow)
    if batch_size % step.world_size:
        raise ConfigError(f"training.batch_size {batch_size} is not a multiple of the {step.world_size} ranks",
                          f"use a batch_size divisible by {step.world_size}")
    per_rank = batch_size // step.world_size
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
    host_is_device = str(step.device).split(":")[0] == "cpu"
    return _Space(
        step=step, budget=budget_bytes, margin=margin, seq_len=seq_len, per_rank=per_rank,
        # `auto` chooses between the adapter methods (the product's promise: LoRA or QLoRA, an adapter per
        # task); full fine-tuning only when asked. On a tiny model full would rank fastest by a hair.
        methods=["qlora", "lora"] if method == "auto" else [method], micro_batches=micro_batches,
        checkpointings=checkpointings,
        offload_act=_switch(offload_activations, "offload_activations" in allow and not host_is_device),
        offload_opt=_switch(offload_optimizer, "offload_optimizer" in allow and not host_is_device),
        optimizers=[optimizer] + (["adamw_8bit"] if "adamw_8bit" in allow and optimizer == "adamw" else []),
        loss_mode=loss_mode, loss_chunk_size=loss_chunk_size, tile_tokens=tile_tokens, allow=allow, lengths=lengths,
        token_budgets=token_budgets, sharded=sharded)


@dataclass
class _Found:
    """What the search kept: the fastest plan that fits, the smallest of all, and the least
    host-hungry plan that fit the device but not the host."""

    best: tuple[float, int, dict, Estimate] | None = None
    smallest: tuple[int, dict, Estimate] | None = None
    host_short: Estimate | None = None


def _estimated(space: _Space, candidates: Iterable[dict], gradient_checkpointing: str) -> Iterable[tuple[dict, Estimate]]:
    """Each candidate with its estimate; an ``off`` candidate over the budget becomes the fewest fully
    checkpointed layers that fit, when the planner may checkpoint (`_fewest_checkpointed_layers`)."""
    usable = space.usable
    for kw in candidates:
        e = space.estimate(kw)
        if usable is not None and e.peak_bytes > usable and kw["checkpointing"] == "off" \
                and "checkpointing" in space.allow and gradient_checkpointing == "auto":
            # Between off and full: checkpoint just enough layers (the fewest that fit).
            kw, e = _fewest_checkpointed_layers(kw, e, usable, space.step.shape.num_layers, space.estimate)
        yield kw, e


def _search(space: _Space, gradient_checkpointing: str, host_budget_bytes: int | None) -> _Found:
    """Estimate every candidate; keep the fastest that fits (ties: the smaller peak)."""
    found, usable = _Found(), space.usable
    for kw, e in _estimated(space, space.candidates(), gradient_checkpointing):
        if host_budget_bytes is not None and e.host_bytes > host_budget_bytes:
            if (usable is None or e.peak_bytes <= usable) and (
                    found.host_short is None or e.host_bytes < found.host_short.host_bytes):
                found.host_short = e
            continue
        if found.smallest is None or e.peak_bytes < found.smallest[0]:
            found.smallest = (e.peak_bytes, kw, e)
        if usable is None or e.peak_bytes <= usable:
            key = (e.tokens_per_s_guess, -e.peak_bytes)
            if found.best is None or key > found.best[:2]:
                found.best = (e.tokens_per_s_guess, -e.peak_bytes, kw, e)
    return found


def _some_plan_fits(space: _Space, gradient_checkpointing: str, host_budget_bytes: int | None) -> bool:
    """Whether `_search` would find a plan that fits (`plan_for_budget` would not raise `BudgetError`),
    without estimating every candidate: the most frugal knobs are tried first, and the first
    candidate that fits device and host ends the search."""
    usable = space.usable
    return any((usable is None or e.peak_bytes <= usable) and (host_budget_bytes is None or e.host_bytes <= host_budget_bytes)
               for _, e in _estimated(space, reversed(list(space.candidates())), gradient_checkpointing))


def _nothing_fits(space: _Space, found: _Found, *, method: str, optimizer: str, loss_mode: str, name_longest: bool,
                  seq_len: int, tile_tokens: int | str | None, host_budget_bytes: int | None,
                  fixed: dict[str, Any]) -> BudgetError:
    """The error naming the smallest budget that would work (and the longest sequence that fits,
    and the host memory offloading would need)."""
    needed = math.ceil(found.smallest[0] / (1 - space.margin))
    hint = "raise target_vram or lower training.seq_len" if "qlora" in space.methods else \
        "raise target_vram, lower training.seq_len, or use method: qlora"
    longest = ""
    if name_longest and space.step.world_size == 1 and space.budget is not None and not space.token_budgets:
        mb = min(space.micro_batches)
        n = max_seq_len_for_budget(space.step, space.budget, method=method, micro_batch=mb, optimizer=optimizer,
                                   loss_mode=loss_mode, allow=space.allow, margin=space.margin,
                                   limit=max(1, seq_len - 1), tile_tokens=tile_tokens,
                                   host_budget_bytes=host_budget_bytes, **fixed)
        longest = (f"; the longest sequence that fits is {n:,} tokens at micro-batch {mb}" if n
                   else "; not even one token fits")
    host = ""
    if found.host_short is not None:
        host = (f"; plans that offload more would fit but need {format_bytes(found.host_short.host_bytes)} of host "
                f"memory, {format_bytes(host_budget_bytes)} available")
    return BudgetError(f"nothing fits in {format_bytes(space.budget)}: the smallest plan needs "
                       f"{format_bytes(needed)} ({space.describe(found.smallest[1])}){longest}{host}", hint)


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
                host_bytes=e.host_bytes, **_streaming_fields(e))


def _streaming_fields(e: Estimate) -> dict[str, Any]:
    """The plan's streamed-weights fields from its estimate (`optimization.offload.params`)."""
    store = e.settings.get("offload_params")
    return dict(offload_params=bool(store), params_store=store or "host", disk_bytes=e.disk_bytes,
                streamed_bytes_per_step=e.streamed_bytes_per_step, compute_tokens_per_s=e.compute_tokens_per_s)


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

    fits = _fits_at(model_config, budget_bytes, method=method, batch_size=micro_batch, micro_batch_size=micro_batch,
                    allow=allow, dtype=dtype, optimizer=optimizer, lora_r=lora_r, lora_targets=lora_targets,
                    loss_mode=loss_mode, margin=margin, device=device, tile_tokens=tile_tokens, lean_lora=lean_lora,
                    name_longest=False, **techniques)
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


def _fits_at(model_config: Any, budget_bytes: int | None, **plan_kw: Any) -> Callable[[int], bool]:
    """``fits(seq)``: whether ``plan_for_budget(model_config, budget_bytes, seq_len=seq, **plan_kw)``
    returns a plan rather than raise `BudgetError` (its other errors are raised). The model is read
    once, and a probe stops at the first candidate that fits (`_some_plan_fits`)."""
    bound = inspect.signature(plan_for_budget).bind(model_config, budget_bytes, **plan_kw)
    bound.apply_defaults()
    a = bound.arguments
    if a["free_memory"]:  # a plan is returned even when none fits: only the host can refuse
        def fits_slowly(seq: int) -> bool:
            try:
                plan_for_budget(model_config, budget_bytes, seq_len=seq, **plan_kw)
                return True
            except BudgetError:
                return False
        return fits_slowly
    _check_tile_tokens(a["tile_tokens"])
    step = model_config if isinstance(model_config, RunStep) else RunStep.of(
        model_config, dtype=a["dtype"], lora_r=a["lora_r"], lora_targets=a["lora_targets"], world_size=a["world_size"],
        device=a["device"], lean_lora=a["lean_lora"], **a["techniques"])
    space_kw = {k: a[k] for k in inspect.signature(_search_space).parameters if k not in ("step", "budget_bytes", "seq_len")}
    steps = [step]
    if step.settings.get("offload_params") == "auto":  # streaming only where nothing else fits (plan_for_budget)
        steps = [RunStep(step.shape, {**step.settings, "offload_params": store}) for store in (False, "on", "disk")]
        if not _can_stream(step, a["method"]):
            steps = steps[:1]

    def fits(seq: int) -> bool:
        return any(_some_plan_fits(_search_space(s, budget_bytes, seq_len=seq, **space_kw), a["gradient_checkpointing"],
                                   a["host_budget_bytes"]) for s in steps)
    return fits
