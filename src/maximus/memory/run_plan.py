"""From a `Config` to a `Plan`, used by `maximus-train`, `maximus plan` and every torchrun rank.

`plan_run(cfg, device=..., world_size=...)` resolves the run once into a `RunSpec`
(`maximus.memory.spec_from_config.run_spec`: the model's config.json, no weights), resolves
``target_vram``, decides the distributed strategy once (``single``, ``ddp`` or ``fsdp``), and asks
the planner (`plan_for_budget`) for the fastest plan that fits. The plan carries its spec, so
`replan(plan, lengths, **changes)` (the same plan with some settings changed and its prediction
re-estimated) and `plan_below_measured(plan, lengths, measured)` need neither the config nor the
model again: the trainer's re-plans (out of memory, a measured peak over the budget, recompute
chosen from measured costs) go through them and never edit a plan in place.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from maximus.config import Config
from maximus.device import device_capacity_bytes, device_type
from maximus.errors import BudgetError, ConfigError, ModelError
from maximus.memory.lengths import RowLengths
from maximus.memory.plan import Attention, Plan
from maximus.memory.planner import DEFAULT_ALLOW, plan_for_budget, resolve_budget
from maximus.memory.run_spec import Candidate, RunSpec
from maximus.memory.spec_from_config import run_dtype, run_spec, search_space

__all__ = ["plan_run", "replan", "plan_below_measured", "fixed_strategy", "QLORA_FSDP_NOTICE", "STRATEGY_CHOICES"]

#: `training.distributed` values.
STRATEGY_CHOICES = ("auto", "ddp", "fsdp")

QLORA_FSDP_NOTICE = ("notice: FSDP2 cannot shard bitsandbytes 4-bit weights; QLoRA runs with DDP "
                     "(each process holds the whole NF4 base)")


def plan_run(cfg: Config, *, device: Any, world_size: int = 1, budget_bytes: int | None | str = "config",
             lengths: RowLengths | None = None) -> Plan:
    """The plan of the run `cfg` on `device` (``cuda``, ``cpu``, a torch.device) with
    `world_size` data-parallel ranks.

    `budget_bytes`: ``"config"`` (default) reads ``optimization.target_vram``: the fastest plan
    that fits it, which the run is then held to; without ``target_vram`` the plan is fitted to
    the device's free memory (read as ``target_vram: auto`` reads it; `Plan.free_memory_bytes`)
    but the run is not held to it, and the smallest plan is attempted when none fits. An int or
    None overrides the config (`maximus plan` plans one config per card; None: the run exactly as
    configured, the fastest plan).

    `lengths`: the run's tokenized rows in loader order (`maximus.data.lengths.run_lengths`; the
    trainer reads the data before planning): the plan is for the largest micro-batch the loader
    really forms, and records the lengths it assumed (`Plan.rows_tokens_max`,
    `Plan.micro_batch_tokens_max`). None (`maximus plan --model`): every row at ``seq_len``.

    Raises:
        BudgetError: nothing fits ``target_vram`` (names the smallest budget that would).
        ConfigError: the batch does not split over the ranks; FSDP2 with optimizer offload or an
            8-bit optimizer.
        ModelError: the model's config.json cannot be found offline, or (with a budget) cannot
            be read as a decoder the estimator knows.
    """
    opt, t = cfg.optimization, cfg.training
    if t.micro_batch_tokens is not None and cfg.objective == "grpo":
        raise ConfigError("training.micro_batch_tokens does not apply to objective grpo (its micro-batches are "
                          "completions of one length bound)", "set training.micro_batch_size instead")
    kind = device_type(device)
    free_memory = budget_bytes == "config" and opt.target_vram is None
    if budget_bytes == "config":
        budget_bytes = _free_memory(device) if free_memory else resolve_budget(opt.target_vram, device)
    try:  # the run, resolved once (a VLM's tower must be one the estimator knows)
        spec = run_spec(cfg, device=kind, world_size=world_size, lengths=lengths)
    except ModelError:
        if not free_memory:
            raise
        return _unplanned(cfg, kind, world_size)  # an architecture the estimator cannot read
    # With a budget and no explicit method (the article's config), the planner may pick the method.
    bounded = budget_bytes is not None and not free_memory
    method = cfg.method if "method" in cfg.model_fields_set or not bounded else "auto"
    if method == "auto" and not bounded:
        method = "lora"
    spec = spec.searching(method=method)
    if spec.techniques.vision is not None and lengths is None:  # rows at seq_len must hold their images
        from maximus.memory.vision_terms import check_row_fits

        check_row_fits(spec.techniques.vision, spec.search.seq_len)
    if budget_bytes is None:
        # No memory to fit: the run as configured (the planner only fills in what is auto).
        spec = spec.searching(allow=DEFAULT_ALLOW - {"micro_batch", "offload_activations", "offload_optimizer"})
    plan = None
    if method == "auto" and cfg.allow_full and bounded:
        try:  # allow_full: full fine-tuning whenever it fits, else the planner's adapter choice
            plan, notes = _plan_with_strategy(cfg, spec.searching(method="full"), budget_bytes, device, free_memory)
            notes.append("allow_full: full fine-tuning fits the budget")
        except BudgetError:
            plan = None
    if plan is None:
        plan, notes = _plan_with_strategy(cfg, spec, budget_bytes, device, free_memory)
    if plan.micro_batch_tokens and plan.strategy == "fsdp":  # FSDP2's collectives need as many micro-batches per rank
        raise ConfigError("training.micro_batch_tokens does not work with FSDP2 (ranks would run different numbers "
                          "of micro-batches)", "set training.distributed: ddp, or micro_batch_tokens: null")
    plan = replace(plan, budget_bytes=None if free_memory else plan.budget_bytes,
                   free_memory_bytes=budget_bytes if free_memory else None, **_from_config(cfg),
                   notes=plan.notes + tuple(notes))
    if cfg.objective == "grpo":  # sampling holds a KV cache beside the resident state
        from maximus.memory.generation import check_generation

        plan = replace(plan, generation=check_generation(spec.shape, plan, spec.techniques.grpo,
                                                               budget=plan.budget_bytes))
    return plan


def _from_config(cfg: Config) -> dict[str, Any]:
    """The Plan fields the config decides alone (the search does not vary them)."""
    opt = cfg.optimization
    return dict(objective=cfg.objective, attention=_attention(cfg),
                ghost_candidates=opt.ghost_logit.candidates if opt.loss_mode == "ghost" else None)


def _free_memory(device: Any) -> int | None:
    """The device's free memory (`resolve_budget("auto")`); None for a GPU this machine lacks."""
    import torch

    if device_type(device) == "cuda" and not torch.cuda.is_available():
        return None
    return resolve_budget("auto", device)


def _unplanned(cfg: Config, kind: str, world_size: int) -> Plan:
    """The configured run without a prediction: micro-batch ``min(per-rank batch, 4)`` when auto,
    offload only when asked, recompute left to the trainer (the config's policy on the model)."""
    opt, t = cfg.optimization, cfg.training
    rows = search_space(cfg, kind, world_size).batch_size
    per_rank = max(1, rows // world_size)
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else min(per_rank, 4)
    method = cfg.method if cfg.method != "auto" else "lora"
    strategy = fixed_strategy(cfg, method, world_size)[0] or "ddp"  # auto without a prediction: unsharded
    return Plan(method=method, micro_batch_size=micro, grad_accum=max(1, per_rank // micro), recompute=(),
                offload_activations=opt.offload.activations == "on", offload_optimizer=opt.offload.optimizer == "on",
                optimizer=t.optimizer, loss_mode=opt.loss_mode,
                loss_chunk_size=opt.loss_chunk_size if isinstance(opt.loss_chunk_size, int) else None,
                peak_bytes=None, breakdown={}, budget_bytes=None, margin_bytes=0, seq_len=t.seq_len,
                world_size=world_size, dtype=run_dtype(cfg, kind), lora_r=cfg.lora.r if method != "full" else None,
                device=kind, strategy=strategy, **_from_config(cfg),
                offload_params=opt.offload.params in ("on", "disk"),
                params_store="disk" if opt.offload.params == "disk" else "host",
                tile_tokens=opt.tile_tokens if isinstance(opt.tile_tokens, int) else None,
                micro_batch_tokens=t.micro_batch_tokens if isinstance(t.micro_batch_tokens, int) else None,
                rows_per_step=per_rank,
                notes=("the estimator cannot read this architecture's config.json: no prediction, the configured "
                       "settings run as they are",))


def plan_below_measured(plan: Plan, lengths: RowLengths | None, measured_bytes: int,
                        budget_bytes: int | None = None) -> Plan | None:
    """A smaller plan after a step of `plan` measured `measured_bytes`, over its budget
    (`budget_bytes`, default the plan's: the meter's, which the trainer holds the run to).

    The planner's search runs again over the plan's spec with every estimate scaled by measured /
    predicted (what the estimator missed, e.g. a module it does not know, is taken to grow with
    the rest), i.e. for the budget ``budget x predicted / measured``. What cannot change in the
    middle of a run stays: method, optimizer and its offload, distributed strategy; fixed
    settings of the config too. None when nothing fits that way."""
    budget_bytes = budget_bytes or plan.budget_bytes
    if not budget_bytes or not plan.peak_bytes or plan.spec is None:
        return None
    scaled = int(budget_bytes * plan.peak_bytes / measured_bytes)
    spec = replace(plan.spec, lengths=lengths).with_optimizer(plan.optimizer).searching(
        method=plan.method, allow=DEFAULT_ALLOW, offload_optimizer="on" if plan.offload_optimizer else "off",
        sharded=plan.strategy == "fsdp")
    try:
        found = plan_for_budget(spec, scaled)
    except BudgetError:
        return None
    calibration = (f"re-planned after a measured peak of {measured_bytes:,} bytes against {plan.peak_bytes:,} "
                   f"predicted: planned for {scaled:,} bytes of estimate")
    return replace(found, budget_bytes=budget_bytes, margin_bytes=plan.margin_bytes, strategy=plan.strategy,
                   objective=plan.objective, attention=plan.attention, ghost_candidates=plan.ghost_candidates, notes=found.notes + (calibration,))


def replan(plan: Plan, lengths: RowLengths | None = None, **changes: Any) -> Plan:
    """`plan` with `changes` (any `Plan` field: micro_batch_size, recompute, loss_chunk_size, ...)
    and its prediction (peak, breakdown, phase, tokens/s guess) re-estimated for them with the
    plan's spec. The gradient accumulation follows a new micro-batch, so the effective batch
    stays; with the run's `lengths`, so does the largest micro-batch the loader forms with it."""
    new = replace(plan, **changes)
    if "micro_batch_size" in changes and "grad_accum" not in changes:
        per_rank = plan.micro_batch_size * plan.grad_accum
        new = replace(new, grad_accum=max(1, per_rank // new.micro_batch_size))
    if lengths is not None and new.micro_batch_tokens and "micro_batch_tokens" in changes:
        split = lengths.token_split(new.micro_batch_tokens)
        new = replace(new, micro_batch_size=split.rows, grad_accum=split.micro_batches,
                      seq_len=split.largest.row_tokens, micro_batch_tokens_max=split.largest.tokens)
    elif lengths is not None and "micro_batch_size" in changes:
        largest = lengths.largest_micro_batch(new.micro_batch_size)
        new = replace(new, seq_len=largest.row_tokens, micro_batch_tokens_max=largest.tokens)
    if new.peak_bytes is None or new.spec is None:  # an unplanned run stays unpredicted
        return new
    from maximus.memory.estimate import estimate_step

    e = estimate_step(new.spec, _candidate(new, lengths))
    return replace(new, peak_bytes=e.peak_bytes, breakdown=dict(e.breakdown), peak_phase=e.phase,
                   tokens_per_s_guess=e.tokens_per_s_guess)


def _candidate(plan: Plan, lengths: RowLengths | None) -> Candidate:
    """The estimator's candidate for `plan` (its settings as chosen)."""
    return Candidate(method=plan.method, micro_batch=plan.micro_batch_size, seq_len=plan.seq_len,
                     checkpointing=list(plan.recompute), offload_activations=plan.offload_activations,
                     offload_optimizer=plan.offload_optimizer, loss_chunk_tokens=plan.loss_chunk_size,
                     grad_accum=plan.grad_accum, sharded=plan.strategy == "fsdp", tile_tokens=plan.tile_tokens,
                     masked_attention=_masked(plan, lengths))


def _masked(plan: Plan, lengths: RowLengths | None) -> bool:
    """Whether some micro-batch of `plan` is attended with a document mask (`MicroBatch.masked`)."""
    if lengths is None:
        return False
    if plan.micro_batch_tokens:
        return lengths.token_split(plan.micro_batch_tokens).largest.masked
    return lengths.largest_micro_batch(plan.micro_batch_size).masked


def _attention(cfg: Config) -> Attention:
    k = cfg.optimization.kronecker
    if k is None:
        return Attention("sdpa")
    return Attention("kronecker", detail_tokens=k.detail_tokens, sketch_slots=k.sketch_slots, block=k.block)


# ---------------------------------------------------------------------------------- strategy
def fixed_strategy(cfg: Config, method: str, world_size: int) -> tuple[str | None, list[str]]:
    """The one place DDP vs FSDP2 is decided from the config: (``single`` | ``ddp`` | ``fsdp``, or
    None when ``auto`` must size it against the memory; notes). One rank: ``single``. QLoRA is
    never sharded (`fully_shard` cannot split bitsandbytes' packed 4-bit weights), nor a run whose
    optimizer FSDP2 cannot update (8-bit, offloaded: ConfigError when fsdp is asked for)."""
    if world_size == 1:
        return "single", []
    requested = cfg.training.distributed
    if requested not in STRATEGY_CHOICES:  # pragma: no cover - the schema allows only these
        raise ConfigError(f"training.distributed must be one of {', '.join(STRATEGY_CHOICES)}, got {requested!r}")
    fsdp_ok = cfg.training.optimizer == "adamw" and cfg.optimization.offload.optimizer != "on"
    if requested == "fsdp" and not fsdp_ok:
        raise ConfigError("training.distributed: fsdp supports the torch AdamW optimizer without offload only",
                          "set training.optimizer: adamw and optimization.offload.optimizer: off, "
                          "or training.distributed: ddp")
    if requested == "ddp" or method == "qlora" or not fsdp_ok or cfg.training.context_parallel > 1:
        return "ddp", [QLORA_FSDP_NOTICE.removeprefix("notice: ")] if requested == "fsdp" else []
    return ("fsdp", []) if requested == "fsdp" else (None, [])


def _plan_with_strategy(cfg: Config, spec: RunSpec, budget: int | None, device: Any,
                        free_memory: bool) -> tuple[Plan, list[str]]:
    """The plan and the strategy, decided once. One rank: ``single``. Several: DDP or FSDP2 as
    asked; ``auto`` plans unsharded (every rank holds the model) and shards only when that does
    not fit the budget (or, without one, the device). QLoRA is never sharded (4-bit weights), nor
    a run whose optimizer FSDP2 cannot update (8-bit, offloaded)."""
    free = free_memory and budget is not None
    strategy, notes = fixed_strategy(cfg, spec.search.method, spec.world_size)
    unsharded_spec = spec.searching(sharded=False)
    if strategy in ("single", "ddp"):
        return plan_for_budget(unsharded_spec, budget, free_memory=free), notes
    # FSDP2 updates its DTensor shards on the device
    fsdp_spec = spec.searching(sharded=True, offload_optimizer="off")
    if strategy == "fsdp":
        return plan_for_budget(fsdp_spec, budget, free_memory=free), []
    try:  # unsharded only when it really fits (also against free memory)
        unsharded = plan_for_budget(unsharded_spec, budget)
    except BudgetError:
        return plan_for_budget(fsdp_spec, budget, free_memory=free), []
    capacity = device_capacity_bytes(device) if budget is None else None
    if capacity is not None and unsharded.method != "qlora" and unsharded.peak_bytes > capacity:
        sharded = plan_for_budget(fsdp_spec, budget, free_memory=free)
        return sharded, [f"one device ({capacity:,} bytes) cannot hold the run unsharded "
                         f"({unsharded.peak_bytes:,} bytes predicted): FSDP2"]
    return unsharded, []
