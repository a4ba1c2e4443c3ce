"""From a `Config` to a `Plan`: the one translation, used by `maximus-train`, `maximus plan` and
every torchrun rank.

`plan_run(cfg, device=..., world_size=...)` reads the model's config.json (no weights), resolves
``target_vram``, decides the distributed strategy once (``single``, ``ddp`` or ``fsdp``), and asks
the planner (`plan_for_budget`) for the fastest plan that fits, with the run's techniques
(attention, loss, objective) passed to every estimate. `replan(cfg, plan, **changes)` is the
same plan with some settings changed and its prediction re-estimated: the trainer's re-plans
(out of memory, a measured peak over the budget, recompute chosen from measured costs) go
through it and never edit a plan in place.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from maximus.config import Config
from maximus.errors import BudgetError, ConfigError, ModelError
from maximus.memory.estimate import load_model_config, technique_kwargs
from maximus.memory.lengths import RowLengths
from maximus.memory.optimizer_state import uses_bf16_weights
from maximus.memory.plan import Attention, Plan
from maximus.memory.planner import DEFAULT_ALLOW, RunStep, plan_for_budget, resolve_budget

__all__ = ["plan_run", "replan", "plan_below_measured", "bf16_supported", "resolve_dtype", "fixed_strategy", "device_capacity_bytes", "QLORA_FSDP_NOTICE", "STRATEGY_CHOICES"]

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

    `lengths`: the run's tokenized rows in loader order (`maximus.train.order.run_lengths`; the
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
    device_type = str(getattr(device, "type", device)).split(":")[0]
    free_memory = budget_bytes == "config" and opt.target_vram is None
    if budget_bytes == "config":
        budget_bytes = _free_memory(device) if free_memory else resolve_budget(opt.target_vram, device)
    # bf16 weights with stochastic rounding compute in bf16 whatever the dtype says.
    dtype = "bf16" if uses_bf16_weights(cfg) else _dtype_name(t.dtype, device_type)
    try:  # the step every estimate of the run shares, read once (a VLM's tower must be one the estimator knows)
        step = run_step(cfg, dtype=dtype, device_type=device_type, world_size=world_size, lengths=lengths)
    except ModelError:
        if not free_memory:
            raise
        return _unplanned(cfg, device_type, world_size, dtype)  # an architecture the estimator cannot read
    # With a budget and no explicit method (the article's config), the planner may pick the method.
    bounded = budget_bytes is not None and not free_memory
    method = cfg.method if "method" in cfg.model_fields_set or not bounded else "auto"
    if method == "auto" and not bounded:
        method = "lora"
    kwargs = _search_kwargs(cfg, method=method, device_type=device_type, world_size=world_size,
                            gradient_checkpointing=opt.gradient_checkpointing, lengths=lengths)
    if step.settings.get("vision") is not None and lengths is None:  # rows at seq_len must hold their images
        from maximus.memory.vision_terms import check_row_fits

        check_row_fits(step.settings["vision"], kwargs["seq_len"])
    if budget_bytes is None:
        # No memory to fit: the run as configured (the planner only fills in what is auto).
        kwargs.update(allow=DEFAULT_ALLOW - {"micro_batch", "offload_activations", "offload_optimizer"})
    plan = None
    if method == "auto" and cfg.allow_full and bounded:
        try:  # allow_full: full fine-tuning whenever it fits, else the planner's adapter choice
            plan, notes = _plan_with_strategy(cfg, dict(kwargs, method="full"), budget_bytes, step, world_size,
                                              device, free_memory)
            notes.append("allow_full: full fine-tuning fits the budget")
        except BudgetError:
            plan = None
    if plan is None:
        plan, notes = _plan_with_strategy(cfg, kwargs, budget_bytes, step, world_size, device, free_memory)
    if plan.micro_batch_tokens and plan.strategy == "fsdp":  # FSDP2's collectives need as many micro-batches per rank
        raise ConfigError("training.micro_batch_tokens does not work with FSDP2 (ranks would run different numbers "
                          "of micro-batches)", "set training.distributed: ddp, or micro_batch_tokens: null")
    plan = replace(plan, budget_bytes=None if free_memory else plan.budget_bytes,
                   free_memory_bytes=budget_bytes if free_memory else None, **_from_config(cfg),
                   notes=plan.notes + tuple(notes))
    if cfg.objective == "grpo":  # sampling holds a KV cache beside the resident state
        from maximus.memory.generation import check_generation

        plan = replace(plan, generation=check_generation(step.shape, plan, cfg, budget=plan.budget_bytes))
    return plan


def _from_config(cfg: Config) -> dict[str, Any]:
    """The Plan fields the config decides alone (the search does not vary them)."""
    opt = cfg.optimization
    return dict(objective=cfg.objective, attention=_attention(cfg),
                ghost_candidates=opt.ghost_logit.candidates if opt.loss_mode == "ghost" else None)


def _free_memory(device: Any) -> int | None:
    """The device's free memory (`resolve_budget("auto")`); None for a GPU this machine lacks."""
    import torch

    if str(getattr(device, "type", device)).startswith("cuda") and not torch.cuda.is_available():
        return None
    return resolve_budget("auto", device)


def _unplanned(cfg: Config, device_type: str, world_size: int, dtype: str) -> Plan:
    """The configured run without a prediction: micro-batch ``min(per-rank batch, 4)`` when auto,
    offload only when asked, recompute left to the trainer (the config's policy on the model)."""
    opt, t = cfg.optimization, cfg.training
    rows = _search_kwargs(cfg, method="lora", device_type=device_type, world_size=world_size,
                          gradient_checkpointing="off")["batch_size"]
    per_rank = max(1, rows // world_size)
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else min(per_rank, 4)
    method = cfg.method if cfg.method != "auto" else "lora"
    strategy = fixed_strategy(cfg, method, world_size)[0] or "ddp"  # auto without a prediction: unsharded
    return Plan(method=method, micro_batch_size=micro, grad_accum=max(1, per_rank // micro), recompute=(),
                offload_activations=opt.offload.activations == "on", offload_optimizer=opt.offload.optimizer == "on",
                optimizer=t.optimizer, loss_mode=opt.loss_mode,
                loss_chunk_size=opt.loss_chunk_size if isinstance(opt.loss_chunk_size, int) else None,
                peak_bytes=None, breakdown={}, budget_bytes=None, margin_bytes=0, seq_len=t.seq_len,
                world_size=world_size, dtype=dtype, lora_r=cfg.lora.r if method != "full" else None,
                device=device_type, strategy=strategy, **_from_config(cfg),
                offload_params=opt.offload.params in ("on", "disk"),
                params_store="disk" if opt.offload.params == "disk" else "host",
                tile_tokens=opt.tile_tokens if isinstance(opt.tile_tokens, int) else None,
                micro_batch_tokens=t.micro_batch_tokens if isinstance(t.micro_batch_tokens, int) else None,
                rows_per_step=per_rank,
                notes=("the estimator cannot read this architecture's config.json: no prediction, the configured "
                       "settings run as they are",))


def plan_below_measured(cfg: Config, plan: Plan, measured_bytes: int, budget_bytes: int | None = None,
                        lengths: RowLengths | None = None) -> Plan | None:
    """A smaller plan after a step of `plan` measured `measured_bytes`, over its budget
    (`budget_bytes`, default the plan's: the meter's, which the trainer holds the run to).

    The planner's search runs again with every estimate scaled by measured / predicted (what the
    estimator missed, e.g. a module it does not know, is taken to grow with the rest), i.e. for
    the budget ``budget x predicted / measured``. What cannot change in the middle of a run stays:
    method, optimizer and its offload, distributed strategy; fixed settings of the config too.
    None when nothing fits that way."""
    budget_bytes = budget_bytes or plan.budget_bytes
    if not budget_bytes or not plan.peak_bytes:
        return None
    scaled = int(budget_bytes * plan.peak_bytes / measured_bytes)
    kwargs = _search_kwargs(cfg, method=plan.method, device_type=plan.device, world_size=plan.world_size,
                            gradient_checkpointing=cfg.optimization.gradient_checkpointing, lengths=lengths)
    kwargs.update(optimizer=plan.optimizer, offload_optimizer="on" if plan.offload_optimizer else "off")
    try:
        found = plan_for_budget(_step_of(cfg, plan, lengths), scaled, sharded=plan.strategy == "fsdp", **kwargs)
    except BudgetError:
        return None
    calibration = (f"re-planned after a measured peak of {measured_bytes:,} bytes against {plan.peak_bytes:,} "
                   f"predicted: planned for {scaled:,} bytes of estimate")
    return replace(found, budget_bytes=budget_bytes, margin_bytes=plan.margin_bytes, strategy=plan.strategy,
                   objective=plan.objective, attention=plan.attention, ghost_candidates=plan.ghost_candidates, notes=found.notes + (calibration,))


def replan(cfg: Config, plan: Plan, lengths: RowLengths | None = None, **changes: Any) -> Plan:
    """`plan` with `changes` (any `Plan` field: micro_batch_size, recompute, loss_chunk_size, ...)
    and its prediction (peak, breakdown, phase, tokens/s guess) re-estimated for them. The
    gradient accumulation follows a new micro-batch, so the effective batch stays; with the
    run's `lengths`, so does the largest micro-batch the loader forms with it."""
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
    if new.peak_bytes is None:  # an unplanned run stays unpredicted
        return new
    step = _step_of(cfg, new, lengths)
    e = step.estimate(method=new.method, micro_batch=new.micro_batch_size, seq_len=new.seq_len,
                      checkpointing=list(new.recompute), offload_activations=new.offload_activations,
                      offload_optimizer=new.offload_optimizer, loss_mode=new.loss_mode, optimizer=new.optimizer,
                      loss_chunk_tokens=new.loss_chunk_size, grad_accum=new.grad_accum,
                      sharded=new.strategy == "fsdp", tile_tokens=new.tile_tokens,
                      masked_attention=_masked(new, lengths))
    return replace(new, step=step, peak_bytes=e.peak_bytes, breakdown=dict(e.breakdown), peak_phase=e.phase,
                   tokens_per_s_guess=e.tokens_per_s_guess)


def run_step(cfg: Config, *, dtype: str, device_type: str, world_size: int,
             lengths: RowLengths | None = None) -> RunStep:
    """The `RunStep` of the run `cfg`: the model's shape, read once, and the estimate's settings
    the search never varies (dtype, the adapter's rank and targets, ranks, device, lean LoRA, the
    techniques: `_technique_kwargs`). Raises ModelError when the model's config cannot be read."""
    return RunStep.of(load_model_config(cfg.model), dtype=dtype, lora_r=cfg.lora.r,
                      lora_targets=cfg.lora.target_modules, world_size=world_size, device=device_type,
                      lean_lora=lean_lora_applies(cfg), **_technique_kwargs(cfg, lengths))


def _step_of(cfg: Config, plan: Plan, lengths: RowLengths | None) -> RunStep:
    """The step `plan` was estimated for; built from the config only for a plan that lacks it (one
    made by hand)."""
    if plan.step is not None:
        return plan.step
    return run_step(cfg, dtype=plan.dtype, device_type=plan.device, world_size=plan.world_size, lengths=lengths)


def _masked(plan: Plan, lengths: RowLengths | None) -> bool:
    """Whether some micro-batch of `plan` is attended with a document mask (`MicroBatch.masked`)."""
    if lengths is None:
        return False
    if plan.micro_batch_tokens:
        return lengths.token_split(plan.micro_batch_tokens).largest.masked
    return lengths.largest_micro_batch(plan.micro_batch_size).masked


def lean_lora_applies(cfg: Config) -> bool:
    """Whether the adapters' projections run as Maximus' lean ones (`maximus.kernels.lean_lora`),
    decided once for the kernels and the planner: `optimization.lean_lora` on, an adapter, no DoRA
    and no LoRA dropout (those take PEFT's own forward), and not under `kernels: compile`."""
    opt, lora = cfg.optimization, cfg.lora
    return (bool(opt.lean_lora) and cfg.method != "full" and not lora.use_dora and not lora.dropout
            and opt.kernels != "compile")


def _search_kwargs(cfg: Config, *, method: str, device_type: str, world_size: int,
                   gradient_checkpointing: str, lengths: RowLengths | None = None) -> dict[str, Any]:
    """`plan_for_budget` keywords for the run `cfg` beside its `run_step`: what the search varies
    or is told (the config's settings, auto where auto)."""
    opt, t = cfg.optimization, cfg.training
    rows, row_tokens = t.batch_size, t.seq_len
    if cfg.objective == "grpo":  # the backward trains on completions: batch_size x group_size rows
        from maximus.memory.generation import rollout_rows

        rows, row_tokens = rollout_rows(cfg)
    micro, offload_opt = t.micro_batch_size, opt.offload.optimizer
    if t.optimizer_in_backward:  # one pass per step (no accumulation), the step on the device
        micro, offload_opt = max(1, rows // world_size), "off"
    return dict(method=method, batch_size=rows, seq_len=row_tokens, optimizer=t.optimizer,
                micro_batch_size=micro, gradient_checkpointing=gradient_checkpointing,
                loss_mode=opt.loss_mode, loss_chunk_size=opt.loss_chunk_size,
                offload_activations=opt.offload.activations, offload_optimizer=offload_opt,
                tile_tokens=opt.tile_tokens, host_budget_bytes=_host_for_offload(device_type), lengths=lengths,
                micro_batch_tokens=t.micro_batch_tokens)


#: Share of the available host RAM that offloaded state may fill (the rest: the process itself,
#: the data loader, the page cache the checkpoint writer needs).
HOST_OFFLOAD_SHARE = 0.9


def _host_for_offload(device_type: str) -> int | None:
    """The host memory a plan for this machine's GPU may fill with offloaded state: 90 % of the
    available RAM, split between the processes of this node. None when the plan is not for a GPU
    of this machine (a CPU run offloads nothing; `maximus plan` for a card on a laptop)."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    import psutil

    per_process = psutil.virtual_memory().available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return int(per_process * HOST_OFFLOAD_SHARE)


# ---------------------------------------------------------------------------------- techniques
def _technique_kwargs(cfg: Config, lengths: RowLengths | None = None) -> dict[str, Any]:
    """THE place where the run's techniques (Kronecker attention, ghost candidates, DPO /
    contrastive rows, Matryoshka, parameter offload, a VLM's tower) reach the estimator: the
    `run_step` that `plan_run`, `replan` and `plan_below_measured` estimate with. With the data's
    `lengths`, a VLM's tower is planned for the most images a row has."""
    kwargs = technique_kwargs(cfg)
    if kwargs.get("vision") is not None and lengths is not None:
        kwargs["vision"] = kwargs["vision"].for_data(lengths.images_per_row, lengths.uneven)
    return kwargs


def _attention(cfg: Config) -> Attention:
    k = cfg.optimization.kronecker
    if k is None:
        return Attention("sdpa")
    return Attention("kronecker", detail_tokens=k.detail_tokens, sketch_slots=k.sketch_slots, block=k.block)


def bf16_supported(device) -> bool:
    """Whether `device` runs bf16 matmuls natively."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        # bf16 matmuls are fast only with native support (AVX512-BF16 / AMX); elsewhere they are emulated.
        try:
            return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except Exception:  # pragma: no cover - older builds
            return False
    return device.type == "mps"


def resolve_dtype(name: str, device):
    """Compute dtype (a torch.dtype): `auto` = bf16 where supported, else fp32 (fp16 only on request)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _dtype_name(name: str, device_type: str) -> str:
    """`training.dtype` resolved for `device_type` (``auto``: `resolve_dtype`), as the estimator
    names it. A CUDA plan made on a machine without a GPU (`maximus plan`) assumes bf16."""
    import torch

    if name != "auto":
        return name
    if device_type == "cuda" and not torch.cuda.is_available():
        return "bf16"
    dtype = resolve_dtype(name, torch.device(device_type))
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


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


def device_capacity_bytes(device: Any, budget_bytes: int | None = None) -> int | None:
    """Bytes one process may use: `target_vram` when set, else the GPU's memory, else the host's
    memory split between the processes of this node; None for a GPU this machine does not have
    (`maximus plan` planning for CUDA on a laptop)."""
    if budget_bytes:
        return int(budget_bytes)
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(dev).total_memory)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platforms without sysconf
        return 1 << 62
    return host // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _plan_with_strategy(cfg: Config, kwargs: dict, budget: int | None, step: RunStep, world_size: int,
                        device: Any, free_memory: bool) -> tuple[Plan, list[str]]:
    """The plan and the strategy, decided once. One rank: ``single``. Several: DDP or FSDP2 as
    asked; ``auto`` plans unsharded (every rank holds the model) and shards only when that does
    not fit the budget (or, without one, the device). QLoRA is never sharded (4-bit weights), nor
    a run whose optimizer FSDP2 cannot update (8-bit, offloaded)."""
    kwargs = dict(kwargs, free_memory=free_memory and budget is not None)
    strategy, notes = fixed_strategy(cfg, kwargs["method"], world_size)
    if strategy in ("single", "ddp"):
        return plan_for_budget(step, budget, sharded=False, **kwargs), notes
    fsdp_kwargs = dict(kwargs, offload_optimizer="off")  # FSDP2 updates its DTensor shards on the device
    if strategy == "fsdp":
        return plan_for_budget(step, budget, sharded=True, **fsdp_kwargs), []
    try:  # unsharded only when it really fits (also against free memory)
        unsharded = plan_for_budget(step, budget, sharded=False, **dict(kwargs, free_memory=False))
    except BudgetError:
        return plan_for_budget(step, budget, sharded=True, **fsdp_kwargs), []
    capacity = device_capacity_bytes(device) if budget is None else None
    if capacity is not None and unsharded.method != "qlora" and unsharded.peak_bytes > capacity:
        sharded = plan_for_budget(step, budget, sharded=True, **fsdp_kwargs)
        return sharded, [f"one device ({capacity:,} bytes) cannot hold the run unsharded "
                         f"({unsharded.peak_bytes:,} bytes predicted): FSDP2"]
    return unsharded, []
