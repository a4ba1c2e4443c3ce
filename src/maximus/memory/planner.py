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

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from maximus.config import format_bytes, parse_bytes
from maximus.device import free_memory_bytes
from maximus.errors import BudgetError, ConfigError
from maximus.memory.estimate import Estimate, default_loss_chunk, estimate_step
from maximus.memory.lengths import RowLengths
from maximus.memory.plan import BREAKDOWN_ROWS, RECOMPUTE_WORDS, Plan
from maximus.memory.run_spec import DEFAULT_ALLOW, DEFAULT_MARGIN, Candidate, RunSpec, keyword_spec

__all__ = ["Plan", "plan_for_budget", "resolve_budget", "max_seq_len_for_budget", "DEFAULT_MARGIN", "DEFAULT_ALLOW",
           "BREAKDOWN_ROWS", "TILE_CHOICES", "check_batch_splits", "fits_at", "spec_of"]

#: Tile sizes (tokens) the planner tries for `optimization.tile_tokens: auto`, largest first.
TILE_CHOICES = (8192, 4096, 2048, 1024, 512, 256)

# ------------------------------------------------------------------------------------------------


def resolve_budget(value: Any, device: Any = "cuda") -> int | None:
    """A budget in bytes from a config value: a size (``16GB``), a card name, a number of bytes,
    ``auto`` (free memory of the device: `maximus.device.free_memory_bytes`) or None (no budget)."""
    parsed = parse_bytes(value, "optimization.target_vram") if not isinstance(value, int) or isinstance(value, bool) else value
    if parsed is None:
        return None
    if parsed != "auto":
        return int(parsed)
    return free_memory_bytes(device)


def _divisors(n: int) -> list[int]:
    return sorted({d for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0 for d in (i, n // i)})


#: One option of the search: the run (its optimizer may be the planner's alternative) and a
#: candidate whose ``micro_batch`` is a key (rows, or a token budget: `_Space.rows_for`).
Option = tuple[RunSpec, Candidate]


@dataclass(frozen=True)
class _Space:
    """What `plan_for_budget` searches for one `RunSpec`, and how an option becomes an estimate
    and a plan."""

    spec: RunSpec
    budget: int | None
    per_rank: int
    methods: list[str]
    micro_batches: list[int]
    checkpointings: list[Any]
    offload_act: list[bool]
    offload_opt: list[bool]
    optimizers: list[str]
    token_budgets: list[int]

    @property
    def lengths(self) -> RowLengths | None:
        return self.spec.lengths

    @property
    def margin(self) -> float:
        return self.spec.search.margin

    @property
    def usable(self) -> int | None:
        return None if self.budget is None else int(self.budget * (1 - self.margin))

    def seq_for(self, mb: int) -> int:
        """Tokens per row the estimate of micro-batch key `mb` (rows, or a token budget) assumes."""
        if self.token_budgets:
            return self.lengths.token_split(mb).largest.row_tokens
        return self.lengths.largest_micro_batch(mb).row_tokens if self.lengths is not None else self.spec.search.seq_len

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
        loss_mode, size = self.spec.techniques.loss_mode, self.spec.search.loss_chunk_size
        if loss_mode == "naive":
            return [None]
        if loss_mode == "ghost":
            # The ghost loss's chunk is how many tokens share one candidate set: the trainer
            # passes only a chunk the user set, so the planner does not search it.
            return [size if isinstance(size, int) else None]
        if isinstance(size, int):
            return [size]
        tokens = self.rows_for(mb) * self.seq_for(mb)
        # Full fine-tuning trains the head: its chunks have a larger floor (the loss's own default).
        default = default_loss_chunk(tokens, self.spec.shape.vocab_size, self.spec.dtype_bytes,
                                     trainable_head=method == "full" or self.spec.lora.trains_head)
        if "loss_chunk" not in self.spec.search.allow:
            return [default]
        return [default] + [c for c in (1024, 512, 256, 128, 64, 32) if c < default]

    def tiles_for(self, mb: int) -> list[int | None]:
        tile_tokens = self.spec.search.tile_tokens
        if isinstance(tile_tokens, int):
            return [tile_tokens]
        if tile_tokens != "auto" or "tile_tokens" not in self.spec.search.allow:
            return [None]
        return [None] + [t for t in TILE_CHOICES if t < self.rows_for(mb) * self.seq_for(mb)]

    def options(self) -> Iterable[Option]:
        """Every combination the planner may pick, cheapest knobs first."""
        specs = {name: self.spec.with_optimizer(name) for name in self.optimizers}
        for method, mb, gc in itertools.product(self.methods, self.micro_batches, self.checkpointings):
            for off_act in self.offload_act:
                if off_act and gc in ("none", "selective"):
                    continue  # only checkpointed layer inputs can be offloaded
                for off_opt, opt in itertools.product(self.offload_opt, self.optimizers):
                    for chunk in self.chunks_for(mb, method):
                        for tile in (self.tiles_for(mb) if gc == "full" else [None]):  # full layers only
                            yield specs[opt], Candidate(
                                method=method, micro_batch=mb, checkpointing=gc, offload_activations=off_act,
                                offload_optimizer=off_opt, loss_chunk_tokens=chunk, tile_tokens=tile)

    def candidate(self, cand: Candidate) -> Candidate:
        """The candidate the estimator reads for a search candidate (whose micro-batch is a key)."""
        mb = cand.micro_batch
        return replace(cand, micro_batch=self.rows_for(mb), seq_len=self.seq_for(mb), grad_accum=self.accum_for(mb),
                       sharded=self.spec.search.sharded, masked_attention=self.masked_for(mb),
                       context_parallel=split_degree(self.spec))

    def estimate(self, option: Option) -> Estimate:
        spec, cand = option
        return estimate_step(spec, self.candidate(cand))

    def as_plan(self, option: Option, e: Estimate) -> Plan:
        spec, cand = option
        key = cand.micro_batch
        plan = _to_plan(spec, self.candidate(cand), e, self.budget, self.per_rank)
        if self.token_budgets:
            split = self.lengths.token_split(key)
            notes = (f"micro-batches of up to {key:,} tokens (up to {split.rows} rows, up to {split.micro_batches} per "
                     f"step) keep the effective batch of {self.per_rank * spec.world_size}",) + plan.notes[1:]
            plan = replace(plan, grad_accum=split.micro_batches, micro_batch_tokens=key, rows_per_step=self.per_rank,
                           notes=notes)
        return replace(_with_lengths(plan, self.lengths), spec=spec)

    def describe(self, option: Option) -> str:
        key = option[1].micro_batch
        text = _describe(self.candidate(option[1]), self.spec.shape.num_layers)
        tech = option[0].techniques
        if tech.streams_params:
            text += ", frozen weights streamed from " + ("disk" if tech.params_store == "disk" else "host memory")
        return text + (f", micro-batches of up to {key:,} tokens" if self.token_budgets else "")


def _describe(cand: Candidate, num_layers: int) -> str:
    gc = cand.checkpointing
    if isinstance(gc, int):
        gc_text = f"checkpointing {gc}/{num_layers} layers"
    else:
        gc_text = {"none": "no checkpointing", "full": "full checkpointing", "selective": "selective checkpointing"}[gc]
    parts = [cand.method, f"micro_batch {cand.micro_batch}", gc_text]
    if cand.offload_activations:
        parts.append("activation offload")
    if cand.offload_optimizer:
        parts.append("optimizer offload")
    if cand.tile_tokens:
        parts.append(f"MLP tiles of {cand.tile_tokens} tokens")
    parts.append(f"seq {cand.seq_len}")
    return ", ".join(parts)


def plan_for_budget(spec: Any, budget_bytes: int | None, *, free_memory: bool = False, name_longest: bool = True,
                    **settings: Any) -> Plan:
    """The fastest plan for the run `spec` (a `RunSpec`) whose predicted peak is at most
    ``budget_bytes * (1 - margin)``.

    `spec.search` says what may be chosen: fixed settings (an int micro-batch,
    ``gradient_checkpointing: full``, ``offload_*: on/off``, an int chunk) are honoured; ``auto``
    ones are searched; ``allow`` limits what the planner may change (default `DEFAULT_ALLOW`).
    With ``budget_bytes=None`` the fastest plan is returned (no budget: the estimate is still
    recorded). On CPU nothing is offloaded unless asked: host and device memory are the same memory.

    For scripts, `spec` may be anything `model_shape` reads, with the run described by keywords
    (`maximus.memory.run_spec.keyword_spec`: ``method``, ``batch_size``, ``seq_len``, ``world_size``,
    ``dtype``, ``optimizer``, ``lora_r``, ``lora_targets``, ``loss_mode``, ``micro_batch_size``,
    ``gradient_checkpointing``, ``offload_*``, ``tile_tokens``, ``lean_lora`` (default on), the
    techniques of `estimate_peak`, ...); keywords given with a `RunSpec` change it.

    The search space (`SearchSpace`): ``tile_tokens`` ``auto`` (searched, `TILE_CHOICES`, when
    ``allow`` has ``tile_tokens``), ``off`` / None, or a tile size (a tile of at least the
    micro-batch's tokens is one tile: untiled, noted). ``lengths`` (the spec's): each micro-batch
    size is planned for the largest micro-batch the loader forms with it (its tokens, padding
    included), ``seq_len`` staying the cap. ``micro_batch_tokens`` (needs ``lengths``): split each
    step's rows into micro-batches by a token budget (`maximus.memory.lengths.split_by_tokens`):
    an int is that budget, ``auto`` searches budgets from the longest row up to the whole step
    (doubling). ``host_budget_bytes``: the host memory offloading may fill; a plan whose offloaded
    state (`Estimate.host_bytes`) needs more is not chosen. ``sharded``: the ranks shard the model
    (FSDP2) or each hold all of it (DDP); None = `estimate_peak`'s default.

    ``name_longest``: when nothing fits, the error also names the longest sequence that would fit
    with the same settings (`max_seq_len_for_budget`, which turns it off for its own search).
    ``free_memory=True`` says ``budget_bytes`` is not the user's budget but the device's free
    memory (no ``target_vram``): the fastest plan that fits it, and when none does, the plan that
    needs the least memory, with a note (a run the user did not bound is attempted, not refused).

    Raises:
        BudgetError: nothing fits (and not ``free_memory``); the message names the smallest
            budget that would work.
        ConfigError: the batch cannot be split evenly over the ranks, or a setting is unknown
            (a tile_tokens below 1); ``micro_batch_tokens`` below the longest row (named).
    """
    spec = spec_of(spec, settings)
    _check_tile_tokens(spec.search.tile_tokens)
    if spec.search.context_parallel == "auto":
        return _plan_context_parallel(spec, budget_bytes, free_memory=free_memory)
    if spec.techniques.objective != "grpo":  # the trainer pads rollout rows to the split's multiple
        check_row_splits(spec.search.seq_len, split_degree(spec))
    space, found = _search_streaming(spec, budget_bytes)
    host_budget = spec.search.host_budget_bytes
    if found.smallest is None:  # every plan needs more host memory than there is
        raise BudgetError(f"every plan that fits needs more host memory than the {format_bytes(host_budget)} "
                          f"available for offloaded state (the least: {format_bytes(found.host_short.host_bytes)})",
                          "free host RAM, lower training.seq_len, or raise target_vram so less is offloaded")
    if found.best is None and free_memory:
        _, option, e = found.smallest
        plan = space.as_plan(option, e)
        return replace(plan, notes=plan.notes + (f"no plan fits the {format_bytes(budget_bytes)} of free memory; "
                                                 f"running the smallest ({space.describe(option)})",))
    if found.best is None:
        raise _nothing_fits(space, found, name_longest=name_longest)
    _, _, option, e = found.best
    plan = space.as_plan(option, e)
    if host_budget is not None:
        plan = replace(plan, host_budget_bytes=host_budget)
    if free_memory:
        plan = replace(plan, notes=plan.notes + (f"no target_vram: fitted to the {format_bytes(budget_bytes)} of free memory",))
    return plan


def split_degree(spec: RunSpec) -> int:
    """The ranks that share each row in `spec` (its fixed ``context_parallel``; 1 under ``auto``,
    which `plan_for_budget` resolves first)."""
    degree = spec.search.context_parallel
    return degree if isinstance(degree, int) else 1


def check_row_splits(seq_len: int, degree: int) -> None:
    """ConfigError when rows of `seq_len` tokens cannot be cut into the ``2 * degree`` equal
    chunks of the zigzag split (`attention.context_split`)."""
    if degree > 1 and seq_len % (2 * degree):
        raise ConfigError(f"training.seq_len {seq_len} cannot be split evenly over training.context_parallel "
                          f"{degree} ranks (it must be a multiple of {2 * degree} tokens)",
                          f"use a training.seq_len divisible by {2 * degree}")


def context_degrees(spec: RunSpec) -> list[int]:
    """The degrees ``context_parallel: auto`` may pick, smallest first: divisors of the spec's
    processes (`RunSpec.world_size`) whose zigzag split cuts the rows evenly. GRPO's rollout rows
    (prompt + completion, of any length) are padded to the split's multiple by the trainer, and
    its rollouts run whole on every process: all of them split, or one."""
    seq_len = spec.search.seq_len
    if spec.techniques.objective == "grpo":
        return _divisors(spec.world_size)[-1:]
    return [d for d in _divisors(spec.world_size) if d == 1 or seq_len % (2 * d) == 0]


def _plan_context_parallel(spec: RunSpec, budget_bytes: int | None, *, free_memory: bool) -> Plan:
    """``context_parallel: auto``: the plan of the smallest degree (`context_degrees`) for which
    some plan fits `budget_bytes`, the rest of the run (micro-batch, recompute, offloads, tiles)
    planned around it; the remaining processes split the batch. Without a budget, degree 1."""
    processes, seq_len = spec.world_size, spec.search.seq_len
    degrees = context_degrees(spec) if budget_bytes is not None else [1]

    def split(degree: int) -> RunSpec:
        return replace(spec, world_size=processes // degree, search=replace(spec.search, context_parallel=degree))

    for degree in degrees:
        try:
            plan = plan_for_budget(split(degree), budget_bytes, name_longest=False)
        except BudgetError:
            continue
        if degree == 1:
            return plan
        return replace(plan, notes=plan.notes + (f"context_parallel auto: {degree} of the {processes} processes share "
                                                 f"each row (the fewest whose share fits)",))
    if free_memory:
        return plan_for_budget(split(degrees[-1]), budget_bytes, free_memory=True)
    raise BudgetError(f"training.context_parallel auto: no split of rows of {seq_len:,} tokens over "
                      f"{' / '.join(map(str, degrees))} of the {processes} processes fits "
                      f"{format_bytes(budget_bytes)} per process",
                      "launch more processes (torchrun --nproc_per_node), raise optimization.target_vram, or "
                      "lower training.seq_len")


def _search_streaming(spec: RunSpec, budget_bytes: int | None) -> tuple[_Space, _Found]:
    """The search of `spec`; with ``offload.params: auto``, first without streamed weights, and
    only when nothing fits (every cheaper lever searched) streaming them, from host memory when it
    has room for them, else from a file on disk."""
    if spec.techniques.offload_params != "auto":
        space = _search_space(spec, budget_bytes)
        return space, _search(space)
    space = _search_space(_streaming(spec, "off"), budget_bytes)
    found = _search(space)
    if found.best is not None or budget_bytes is None or not _can_stream(spec):
        return space, found
    for store in ("on", "disk"):
        streamed = _search_space(_streaming(spec, store), budget_bytes)
        found_streamed = _search(streamed)
        if found_streamed.best is not None or (store == "on" and found_streamed.smallest is not None):
            # The one that fits; else streaming from host memory names the smallest plan there is.
            space, found = streamed, found_streamed
        if found.best is not None:
            break
    return space, found


def _streaming(spec: RunSpec, store: str) -> RunSpec:
    """`spec` with `optimization.offload.params` set to `store` (``off``, ``on`` or ``disk``)."""
    return replace(spec, techniques=replace(spec.techniques, offload_params=store))


def _can_stream(spec: RunSpec) -> bool:
    """Whether streaming frozen weights can save device memory: a GPU (on a CPU the host is the
    device) and an adapter method (full fine-tuning has no frozen weights), unsharded (FSDP2 cannot
    shard the weights the streamer releases between uses)."""
    return spec.device != "cpu" and spec.search.method != "full" and not spec.search.sharded


def spec_of(spec: Any, settings: dict[str, Any], **defaults: Any) -> RunSpec:
    """`spec` as is, or the `RunSpec` that keywords describe (`keyword_spec`; lean LoRA on by default)."""
    if isinstance(spec, RunSpec) and not settings:
        return spec
    if not isinstance(spec, RunSpec):
        settings = {**defaults, **settings}
    return keyword_spec(spec, settings, lean_lora=True)


def _check_tile_tokens(tile_tokens: Any) -> None:
    if isinstance(tile_tokens, bool) or (isinstance(tile_tokens, int) and tile_tokens < 1) or (
            not isinstance(tile_tokens, int) and tile_tokens not in ("auto", "off", None)):
        raise ConfigError(f"optimization.tile_tokens must be a positive number of tokens, auto or off, got {tile_tokens!r}",
                          "use e.g. tile_tokens: 4096, or off")


def check_batch_splits(batch_size: int, world_size: int) -> int:
    """The rows per rank of a step of `batch_size` rows over `world_size` ranks; ConfigError when
    they do not split evenly."""
    if batch_size % world_size:
        raise ConfigError(f"training.batch_size {batch_size} is not a multiple of the {world_size} ranks",
                          f"use a batch_size divisible by {world_size}")
    return batch_size // world_size


def _search_space(spec: RunSpec, budget_bytes: int | None) -> _Space:
    """The options `plan_for_budget` may pick: fixed settings as given, `auto` ones searched."""
    search, world_size = spec.search, spec.world_size
    allow = search.allow
    per_rank = check_batch_splits(search.batch_size, world_size)
    token_budgets = _token_budgets(search.micro_batch_tokens, spec.lengths, per_rank)
    if token_budgets:
        micro_batches = token_budgets  # searched like micro-batch sizes: one key per budget
    elif isinstance(search.micro_batch_size, int):
        if per_rank % search.micro_batch_size:
            raise ConfigError(f"training.micro_batch_size {search.micro_batch_size} does not divide the per-rank "
                              f"batch {per_rank}", "pick a divisor of batch_size / world size, or auto")
        micro_batches = [search.micro_batch_size]
    else:
        micro_batches = _divisors(per_rank) if "micro_batch" in allow else [min(per_rank, 4)]
    if search.gradient_checkpointing in RECOMPUTE_WORDS:
        checkpointings: list[Any] = [RECOMPUTE_WORDS[search.gradient_checkpointing]]
    else:
        checkpointings = ["none"] + (["selective"] if "selective" in allow else []) + (
            ["full"] if "checkpointing" in allow else [])
    # On a CPU the host memory is the device memory: offloading to it frees nothing.
    host_is_device = spec.device == "cpu"
    optimizer = spec.optimizer.name
    return _Space(
        spec=spec, budget=budget_bytes, per_rank=per_rank,
        # `auto` chooses between the adapter methods (the product's promise: LoRA or QLoRA, an adapter per
        # task); full fine-tuning only when asked. On a tiny model full would rank fastest by a hair.
        methods=["qlora", "lora"] if search.method == "auto" else [search.method], micro_batches=micro_batches,
        checkpointings=checkpointings,
        offload_act=_switch(search.offload_activations, "offload_activations" in allow and not host_is_device),
        offload_opt=_switch(search.offload_optimizer, "offload_optimizer" in allow and not host_is_device),
        optimizers=[optimizer] + (["adamw_8bit"] if "adamw_8bit" in allow and optimizer == "adamw" else []),
        token_budgets=token_budgets)


@dataclass
class _Found:
    """What the search kept: the fastest plan that fits, the smallest of all, and the least
    host-hungry plan that fit the device but not the host."""

    best: tuple[float, int, Option, Estimate] | None = None
    smallest: tuple[int, Option, Estimate] | None = None
    host_short: Estimate | None = None


def _estimated(space: _Space, options: Iterable[Option]) -> Iterable[tuple[Option, Estimate]]:
    """Each option with its estimate; an ``off`` candidate over the budget becomes the fewest fully
    checkpointed layers that fit, when the planner may checkpoint (`_fewest_checkpointed_layers`)."""
    usable = space.usable
    for option in options:
        e = space.estimate(option)
        if usable is not None and e.peak_bytes > usable and option[1].checkpointing == "none" \
                and "checkpointing" in space.spec.search.allow and space.spec.search.gradient_checkpointing == "auto":
            # Between off and full: checkpoint just enough layers (the fewest that fit).
            option, e = _fewest_checkpointed_layers(option, e, usable, space)
        yield option, e


def _search(space: _Space) -> _Found:
    """Estimate every option; keep the fastest that fits (ties: the smaller peak)."""
    found, usable, host_budget = _Found(), space.usable, space.spec.search.host_budget_bytes
    for option, e in _estimated(space, space.options()):
        if host_budget is not None and e.host_bytes > host_budget:
            if (usable is None or e.peak_bytes <= usable) and (
                    found.host_short is None or e.host_bytes < found.host_short.host_bytes):
                found.host_short = e
            continue
        if found.smallest is None or e.peak_bytes < found.smallest[0]:
            found.smallest = (e.peak_bytes, option, e)
        if usable is None or e.peak_bytes <= usable:
            key = (e.tokens_per_s_guess, -e.peak_bytes)
            if found.best is None or key > found.best[:2]:
                found.best = (e.tokens_per_s_guess, -e.peak_bytes, option, e)
    return found


def _some_plan_fits(space: _Space) -> bool:
    """Whether `_search` would find a plan that fits (`plan_for_budget` would not raise `BudgetError`),
    without estimating every option: the most frugal knobs are tried first, and the first
    option that fits device and host ends the search."""
    usable, host_budget = space.usable, space.spec.search.host_budget_bytes
    return any((usable is None or e.peak_bytes <= usable) and (host_budget is None or e.host_bytes <= host_budget)
               for _, e in _estimated(space, reversed(list(space.options()))))


def _nothing_fits(space: _Space, found: _Found, *, name_longest: bool) -> BudgetError:
    """The error naming the smallest budget that would work (and the longest sequence that fits,
    and the host memory offloading would need)."""
    spec, host_budget = space.spec, space.spec.search.host_budget_bytes
    needed = math.ceil(found.smallest[0] / (1 - space.margin))
    hint = "raise target_vram or lower training.seq_len" if "qlora" in space.methods else \
        "raise target_vram, lower training.seq_len, or use method: qlora"
    longest = ""
    if name_longest and spec.world_size == 1 and space.budget is not None and not space.token_budgets:
        mb = min(space.micro_batches)
        n = max_seq_len_for_budget(replace(spec, lengths=None), space.budget, micro_batch=mb, limit=max(1, spec.search.seq_len - 1))
        longest = (f"; the longest sequence that fits is {n:,} tokens at micro-batch {mb}" if n
                   else "; not even one token fits")
    host = ""
    if found.host_short is not None:
        host = (f"; plans that offload more would fit but need {format_bytes(found.host_short.host_bytes)} of host "
                f"memory, {format_bytes(host_budget)} available")
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


def _fewest_checkpointed_layers(option: Option, e_off: Estimate, usable: int, space: _Space) -> tuple[Option, Estimate]:
    """Binary search the smallest number of fully checkpointed layers whose peak fits."""
    spec, cand = option
    lo, hi = 1, spec.shape.num_layers - 1
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = (spec, replace(cand, checkpointing=mid))
        e = space.estimate(trial)
        if e.peak_bytes <= usable:
            found = (trial, e)
            hi = mid - 1
        else:
            lo = mid + 1
    return found if found else (option, e_off)


def _to_plan(spec: RunSpec, cand: Candidate, e: Estimate, budget: int | None, per_rank: int) -> Plan:
    gc, L, world_size = cand.checkpointing, spec.shape.num_layers, spec.world_size
    if isinstance(gc, int):
        recompute = ("full",) * gc + ("none",) * (L - gc)
    else:
        recompute = (gc,) * L
    mb, seq_len = cand.micro_batch, cand.seq_len
    margin_bytes = int(budget * spec.search.margin) if budget else 0
    notes = [f"micro-batch {mb} x gradient accumulation {per_rank // mb} x {world_size} rank(s) keeps the "
             f"effective batch of {per_rank * world_size}"]
    if budget:
        notes.append(f"predicted peak {format_bytes(e.peak_bytes)} of {format_bytes(budget)} "
                     f"({e.peak_bytes / budget:.0%}), {format_bytes(margin_bytes)} kept as margin")
    if isinstance(gc, int):
        notes.append(f"{gc} of {L} layers fully checkpointed: the fewest that fit")
    tile = cand.tile_tokens
    if tile and tile >= mb * seq_len:
        notes.append(f"tile_tokens {tile} >= the micro-batch's {mb * seq_len} tokens: one tile (the MLP runs untiled)")
    elif tile:
        notes.append(f"the MLP of each fully recomputed layer runs over {math.ceil(mb * seq_len / tile)} tiles of "
                     f"{tile} tokens in backward")
    notes += [n for n in e.notes if n not in notes]
    sharded = bool(e.settings.get("sharded"))
    # the processes: the batch ranks times the ranks that share each row
    strategy = "single" if world_size * cand.context_parallel == 1 else ("fsdp" if sharded else "ddp")
    return Plan(method=cand.method, micro_batch_size=mb, grad_accum=per_rank // mb, recompute=recompute,
                offload_activations=cand.offload_activations, offload_optimizer=cand.offload_optimizer,
                optimizer=spec.optimizer.name, loss_mode=spec.techniques.loss_mode,
                loss_chunk_size=cand.loss_chunk_tokens, peak_bytes=e.peak_bytes, breakdown=dict(e.breakdown),
                budget_bytes=budget, margin_bytes=margin_bytes, peak_phase=e.phase, seq_len=seq_len,
                world_size=world_size, dtype=spec.dtype, lora_r=spec.lora.r if cand.method != "full" else None,
                device=spec.device, strategy=strategy, tokens_per_s_guess=e.tokens_per_s_guess, notes=tuple(notes),
                tile_tokens=tile, host_bytes=e.host_bytes, context_parallel=cand.context_parallel,
                **_streaming_fields(e))


def _streaming_fields(e: Estimate) -> dict[str, Any]:
    """The plan's streamed-weights fields from its estimate (`optimization.offload.params`)."""
    store = e.settings.get("offload_params")
    return dict(offload_params=bool(store), params_store=store or "host", disk_bytes=e.disk_bytes,
                streamed_bytes_per_step=e.streamed_bytes_per_step, compute_tokens_per_s=e.compute_tokens_per_s)


def max_seq_len_for_budget(spec: Any, budget_bytes: int, *, micro_batch: int = 1, limit: int = 1 << 22,
                           **settings: Any) -> int:
    """The longest sequence (tokens) for which some plan of the run `spec` with this micro-batch
    fits the budget; 0 if not even one token fits. Every knob in the spec's ``allow`` may be used
    (full checkpointing, activation offload, small loss chunks, the MLP tile when ``tile_tokens``
    is ``auto``). `spec` and `settings` as in `plan_for_budget` (with keywords the method
    defaults to ``qlora``)."""
    fits = fits_at(spec_of(spec, settings, method="qlora"), budget_bytes, micro_batch)
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


def fits_at(spec: RunSpec, budget_bytes: int | None, micro_batch: int) -> Callable[[int], bool]:
    """``fits(seq)``: whether `plan_for_budget` would return a plan for `spec` at ``seq`` tokens
    per row and one step of `micro_batch` rows, rather than raise `BudgetError` (its other errors
    are raised). A probe stops at the first option that fits (`_some_plan_fits`)."""
    _check_tile_tokens(spec.search.tile_tokens)
    at = spec.searching(batch_size=micro_batch, micro_batch_size=micro_batch)
    variants = [at]
    if at.techniques.offload_params == "auto":  # streaming only where nothing else fits (plan_for_budget)
        variants = [_streaming(at, store) for store in ("off", "on", "disk")][:3 if _can_stream(at) else 1]

    def fits(seq: int) -> bool:
        return any(_some_plan_fits(_search_space(v.searching(seq_len=seq), budget_bytes)) for v in variants)
    return fits
