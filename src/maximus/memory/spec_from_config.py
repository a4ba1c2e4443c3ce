"""From a `Config` to a `RunSpec` and a `Plan`: the config's one door into the estimator, the
planner and the kernels. No other module of memory/ reads the config.

`run_spec(cfg, ...)` resolves the run once; `plan_run(cfg, device=..., world_size=...)` (used by
`maximus-train`, `maximus plan` and every torchrun rank) resolves ``target_vram``, decides the
distributed strategy once (``single``, ``ddp`` or ``fsdp``: `fixed_strategy`) and asks the planner
(`plan_for_budget`) for the fastest plan that fits; the plan carries its spec, so re-plans in the
middle of a run (`maximus.memory.run_plan`) need the config no more.

Every technique decision the config makes for memory is read here:

* the dtype (`run_dtype`: bf16 weights with stochastic rounding compute in bf16; ``auto`` by the
  device, `maximus.device.dtype_name`);
* the kernels (`kernel_choices`: lean LoRA, lean norm, grouped experts, device included);
* the adapter (`lora_reaches_experts`, `lean_lora_applies`), the optimizer, the techniques
  (attention, objective and DPO reference, GRPO's completion tokens, Matryoshka, ghost candidates,
  parameter offload, a VLM's tower planned for the data's images);
* the planner's search space (fixed settings, ``auto`` ones; GRPO's rollout rows; one pass per
  step when the optimizer steps inside the backward; the host memory offloading may fill).
"""
from __future__ import annotations

import os
from typing import Any

from dataclasses import replace

from maximus.device import device_capacity_bytes, dtype_name, host_available_bytes
from maximus.device import device_type as _device_type
from maximus.errors import BudgetError, ConfigError, ModelError
from maximus.memory.lengths import RowLengths
from maximus.kernels.choices import KernelChoices
from maximus.memory.run_spec import (GrpoSettings, LoraSettings, OptimizerSettings, RunSpec, SearchSpace, Techniques,
                                     decide_kernels, kronecker_layout)
from maximus.memory.plan import Attention, Plan
from maximus.memory.planner import DEFAULT_ALLOW, plan_for_budget, resolve_budget, split_degree
from maximus.memory.shape import load_model_config, model_shape

__all__ = ["plan_run", "fixed_strategy", "QLORA_FSDP_NOTICE", "STRATEGY_CHOICES", "run_spec", "run_dtype", "kernel_choices", "lean_lora_applies", "lora_reaches_experts",
           "uses_bf16_weights", "search_space", "grpo_settings", "HOST_OFFLOAD_SHARE"]

#: Share of the available host RAM that offloaded state may fill (the rest: the process itself,
#: the data loader, the page cache the checkpoint writer needs).
HOST_OFFLOAD_SHARE = 0.9


def run_spec(cfg: Any, *, device: Any, world_size: int = 1, lengths: RowLengths | None = None,
             model_config: Any = None) -> RunSpec:
    """The `RunSpec` of the run `cfg` (a `maximus.Config`) on `device` with `world_size` ranks and
    the data's `lengths` (None: every row at ``seq_len``). `model_config`: the model's Transformers
    config when the caller has resolved its source (`maximus.model_source.ModelSource.config`, the
    trainer); else the model's config.json is read here once (no weights). Raises ModelError when
    it cannot be read as a decoder the estimator knows."""
    kind = _device_type(device)
    model_config = load_model_config(cfg.model if model_config is None else model_config)
    return RunSpec(shape=model_shape(model_config), dtype=run_dtype(cfg, kind), device=kind, world_size=world_size,
                   lora=_lora(cfg), optimizer=_optimizer(cfg), techniques=_techniques(cfg, model_config, lengths),
                   kernels=kernel_choices(cfg, kind), search=search_space(cfg, kind, world_size), lengths=lengths)


def run_dtype(cfg: Any, device_type: str) -> str:
    """The estimator's dtype name: bf16 weights with stochastic rounding compute in bf16 whatever
    `training.dtype` says; else `training.dtype` resolved for the device."""
    return "bf16" if uses_bf16_weights(cfg) else dtype_name(cfg.training.dtype, device_type)


def uses_bf16_weights(cfg: Any) -> bool:
    """Full fine-tuning with bf16 weights and stochastic rounding (`training.master_weights: bf16`)."""
    return cfg.method == "full" and cfg.training.master_weights == "bf16"


def kernel_choices(cfg: Any, device_type: str, method: str | None = None) -> KernelChoices:
    """The kernels the run's step uses (`maximus.kernels.choices.decide_kernels`), for the planner
    and for `maximus.kernels.apply_kernels` alike; `method`: the planned one (default the config's)."""
    opt = cfg.optimization
    return decide_kernels(mode=opt.kernels, device_type=device_type, lean_lora=lean_lora_applies(cfg, method),
                          lean_norm=opt.lean_norm, grouped_experts=opt.grouped_experts)


def lean_lora_applies(cfg: Any, method: str | None = None) -> bool:
    """Whether the adapters' projections run as Maximus' lean ones (`maximus.kernels.lean_lora`):
    `optimization.lean_lora` on, an adapter, no DoRA and no LoRA dropout (those take PEFT's own
    forward), not under `kernels: compile`, and not a QAT QLoRA base (its layer dequantizes and
    rounds in its own forward, which the lean kernel would skip). `method`: the planned method
    (default the config's)."""
    opt, lora = cfg.optimization, cfg.lora
    method = method or cfg.method
    return (bool(opt.lean_lora) and method != "full" and not lora.use_dora and not lora.dropout
            and opt.kernels != "compile" and not (cfg.training.qat != "off" and method == "qlora"))


def lora_reaches_experts(cfg: Any) -> bool:
    """Whether LoRA adapts a mixture of experts' experts: `lora.experts` when set, else with
    ``target_modules: all-linear`` (as `maximus.models.lora_targets` resolves it)."""
    return cfg.lora.experts if cfg.lora.experts is not None else cfg.lora.target_modules == "all-linear"


def _lora(cfg: Any) -> LoraSettings:
    targets = cfg.lora.target_modules
    return LoraSettings(r=cfg.lora.r, target_modules=targets if isinstance(targets, str) else tuple(targets),
                    experts=lora_reaches_experts(cfg), modules_to_save=tuple(cfg.lora.modules_to_save),
                    use_dora=cfg.lora.use_dora, dropout=cfg.lora.dropout)


def _optimizer(cfg: Any) -> OptimizerSettings:
    t = cfg.training
    return OptimizerSettings(name=t.optimizer, rank=t.optimizer_rank, in_backward=t.optimizer_in_backward,
                         master_weights="bf16" if uses_bf16_weights(cfg) else "fp32", embedding=t.embedding_optimizer)


def _techniques(cfg: Any, model_config: Any, lengths: RowLengths | None) -> Techniques:
    opt = cfg.optimization
    kron, mat = opt.kronecker, opt.matryoshka
    dpo_reference = "none"
    if cfg.objective == "dpo":
        from maximus.losses.preference import needs_reference

        dpo_reference = cfg.dpo.reference if needs_reference(cfg.dpo.loss) else "none"
    return Techniques(
        loss_mode=opt.loss_mode, ghost_candidates=opt.ghost_logit.candidates,
        attention="kronecker" if kron is not None else "sdpa", kronecker=None if kron is None else kronecker_layout(kron),
        # GRPO's backward is an SFT-shaped step over completion rows whose head runs over the
        # completion tokens only (completion_loss_bytes)
        objective=cfg.objective, dpo_reference=dpo_reference,
        completion_tokens=cfg.grpo.max_completion_tokens if cfg.objective == "grpo" else None,
        matryoshka_dims=None if mat is None else tuple(mat.dims),
        matryoshka_token_fraction=0.0625 if mat is None else mat.token_fraction,
        offload_params=opt.offload.params, qat=cfg.training.qat,
        qat_float_weight=cfg.training.qat_float_weight, qat_adapter=cfg.training.qat_adapter, vision=_vision(cfg, model_config, lengths),
        grpo=grpo_settings(cfg) if cfg.objective == "grpo" else None)


def grpo_settings(cfg: Any) -> GrpoSettings:
    """GRPO's sampling settings of the run `cfg` (`grpo.*`, the step's prompts and their cap)."""
    g = cfg.grpo
    return GrpoSettings(prompts=cfg.training.batch_size, prompt_tokens=cfg.training.seq_len, group_size=g.group_size,
                        max_completion_tokens=g.max_completion_tokens, steps_per_generation=g.steps_per_generation,
                        updates_per_generation=g.updates_per_generation, async_generation=g.async_generation,
                        sampler=g.generation, top_p=g.top_p, method=cfg.method)


def _vision(cfg: Any, model_config: Any, lengths: RowLengths | None):
    """A VLM's tower and projector, planned for the most images a row of the data has; None for text."""
    from maximus.memory.vision_terms import vision_spec

    # ModelError for a tower the estimator does not know
    vision = vision_spec(cfg.model, model_config, max_pixels=cfg.vision.max_pixels, lora_vision=cfg.lora.vision,
                         lora_projector=cfg.lora.projector, target_modules=cfg.lora.target_modules)
    if vision is not None and lengths is not None:
        vision = vision.for_data(lengths.images_per_row, lengths.uneven)
    return vision


def search_space(cfg: Any, device_type: str, world_size: int) -> SearchSpace:
    """What the planner may choose for the run: the config's settings, auto where auto."""
    opt, t = cfg.optimization, cfg.training
    rows, row_tokens = t.batch_size, t.seq_len
    if cfg.objective == "grpo":  # the backward trains on completions: batch_size x group_size rows
        from maximus.memory.generation import rollout_rows

        rows, row_tokens = rollout_rows(grpo_settings(cfg))
    micro, offload_opt = t.micro_batch_size, opt.offload.optimizer
    if t.optimizer_in_backward:  # one pass per step (no accumulation), the step on the device
        micro, offload_opt = max(1, rows // world_size), "off"
    return SearchSpace(method=cfg.method, batch_size=rows, seq_len=row_tokens, micro_batch_size=micro,
                       micro_batch_tokens=t.micro_batch_tokens, gradient_checkpointing=opt.gradient_checkpointing,
                       offload_activations=opt.offload.activations, offload_optimizer=offload_opt,
                       loss_chunk_size=opt.loss_chunk_size, tile_tokens=opt.tile_tokens,
                       host_budget_bytes=host_for_offload(device_type), context_parallel=context_parallel_setting(cfg))


def context_parallel_setting(cfg: Any) -> int | str:
    """``training.context_parallel`` as the planner searches it: the configured degree, or
    ``auto`` for a run the split can train (else 1: the config refuses those at a fixed degree)."""
    t = cfg.training
    if t.context_parallel != "auto":
        return t.context_parallel
    splittable = (cfg.optimization.kronecker is None and cfg.objective in ("sft", "dpo", "grpo")
                  and not (cfg.objective == "grpo" and cfg.grpo.async_generation))
    return "auto" if splittable else 1


def host_for_offload(device_type: str) -> int | None:
    """The host memory a plan for this machine's GPU may fill with offloaded state: 90 % of the
    available RAM, split between the processes of this node. None when the plan is not for a GPU
    of this machine (a CPU run offloads nothing; `maximus plan` for a card on a laptop)."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    per_process = host_available_bytes() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return int(per_process * HOST_OFFLOAD_SHARE)


# ------------------------------------------------------------------------------------------------
# The run's plan

#: `training.distributed` values.
STRATEGY_CHOICES = ("auto", "ddp", "fsdp")


QLORA_FSDP_NOTICE = ("notice: FSDP2 cannot shard bitsandbytes 4-bit weights; QLoRA runs with DDP "
                     "(each process holds the whole NF4 base)")


def plan_run(cfg: Any, *, device: Any, world_size: int = 1, budget_bytes: int | None | str = "config",
             lengths: RowLengths | None = None, model_config: Any = None) -> Plan:
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

    `model_config`: the model's Transformers config, already read (`run_spec`); None reads `cfg.model`.

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
    kind = _device_type(device)
    free_memory = budget_bytes == "config" and opt.target_vram is None
    if budget_bytes == "config":
        budget_bytes = _free_memory(device) if free_memory else resolve_budget(opt.target_vram, device)
    try:  # the run, resolved once (a VLM's tower must be one the estimator knows)
        spec = run_spec(cfg, device=kind, world_size=world_size, lengths=lengths, model_config=model_config)
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


def _from_config(cfg: Any) -> dict[str, Any]:
    """The Plan fields the config decides alone (the search does not vary them)."""
    opt = cfg.optimization
    return dict(objective=cfg.objective, attention=_attention(cfg),
                ghost_candidates=opt.ghost_logit.candidates if opt.loss_mode == "ghost" else None)


def _free_memory(device: Any) -> int | None:
    """The device's free memory (`resolve_budget("auto")`); None for a GPU this machine lacks."""
    import torch

    if _device_type(device) == "cuda" and not torch.cuda.is_available():
        return None
    return resolve_budget("auto", device)


def _unplanned(cfg: Any, kind: str, world_size: int) -> Plan:
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


def _attention(cfg: Any) -> Attention:
    k = cfg.optimization.kronecker
    if k is None:
        return Attention("sdpa")
    return Attention("kronecker", detail_tokens=k.detail_tokens, sketch_slots=k.sketch_slots, block=k.block)


# ---------------------------------------------------------------------------------- strategy
def fixed_strategy(cfg: Any, method: str, world_size: int) -> tuple[str | None, list[str]]:
    """The one place DDP vs FSDP2 is decided from the config: (``single`` | ``ddp`` | ``fsdp``, or
    None when ``auto`` must size it against the memory; notes). One rank: ``single``. QLoRA is
    never sharded (`fully_shard` cannot split bitsandbytes' packed 4-bit weights), nor a run whose
    optimizer FSDP2 cannot update (8-bit, offloaded: ConfigError when fsdp is asked for), nor a run
    whose frozen weights stream (``optimization.offload.params: on | disk``: ConfigError for fsdp).
    `world_size`: every process, the ranks that share rows included. GRPO under ``auto`` is DDP
    (its rollouts run whole on every rank; ``fsdp`` asked for is refused by the trainer)."""
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
    # fully_shard cannot split weights the streamer has released (their storage is empty between uses).
    streams = cfg.optimization.offload.params in ("on", "disk") and method not in ("qlora", "full")
    if requested == "fsdp" and streams:
        raise ConfigError(f"training.distributed: fsdp cannot shard streamed weights "
                          f"(optimization.offload.params: {cfg.optimization.offload.params})",
                          "set training.distributed: ddp to stream on every rank, or "
                          "optimization.offload.params: off to shard the weights instead")
    grpo_auto = cfg.objective == "grpo" and requested == "auto"
    if requested == "ddp" or method == "qlora" or not fsdp_ok or streams or grpo_auto:
        return "ddp", [QLORA_FSDP_NOTICE.removeprefix("notice: ")] if requested == "fsdp" else []
    return ("fsdp", []) if requested == "fsdp" else (None, [])


def _plan_with_strategy(cfg: Any, spec: RunSpec, budget: int | None, device: Any,
                        free_memory: bool) -> tuple[Plan, list[str]]:
    """The plan and the strategy, decided once. One rank: ``single``. Several: DDP or FSDP2 as
    asked; ``auto`` plans unsharded (every rank holds the model) and shards only when that does
    not fit the budget (or, without one, the device). QLoRA is never sharded (4-bit weights), nor
    a run whose optimizer FSDP2 cannot update (8-bit, offloaded). The processes counted are the
    whole world: the spec's batch ranks times the ranks that share each row (FSDP2 shards over all)."""
    free = free_memory and budget is not None
    strategy, notes = fixed_strategy(cfg, spec.search.method, spec.world_size * split_degree(spec))
    unsharded_spec = spec.strategy(sharded=False)
    if strategy in ("single", "ddp"):
        return plan_for_budget(unsharded_spec, budget, free_memory=free), notes
    fsdp_spec = spec.strategy(sharded=True)
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
