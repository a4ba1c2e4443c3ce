"""From a `Config` to a `RunSpec`: the config's one door into the estimator, the planner and the
kernels (`run_spec`). Every technique decision the config makes for memory is read here:

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

from maximus.device import device_type as _device_type
from maximus.device import dtype_name, host_available_bytes
from maximus.memory.lengths import RowLengths
from maximus.kernels.choices import KernelChoices
from maximus.memory.run_spec import (GrpoSettings, LoraSettings, OptimizerSettings, RunSpec, SearchSpace, Techniques,
                                     decide_kernels, kronecker_layout)
from maximus.memory.shape import load_model_config, model_shape

__all__ = ["run_spec", "run_dtype", "kernel_choices", "lean_lora_applies", "lora_reaches_experts",
           "uses_bf16_weights", "search_space", "grpo_settings", "HOST_OFFLOAD_SHARE"]

#: Share of the available host RAM that offloaded state may fill (the rest: the process itself,
#: the data loader, the page cache the checkpoint writer needs).
HOST_OFFLOAD_SHARE = 0.9


def run_spec(cfg: Any, *, device: Any, world_size: int = 1, lengths: RowLengths | None = None) -> RunSpec:
    """The `RunSpec` of the run `cfg` (a `maximus.Config`) on `device` with `world_size` ranks and
    the data's `lengths` (None: every row at ``seq_len``). The model's config.json is read once
    (no weights); raises ModelError when it cannot be read as a decoder the estimator knows."""
    kind = _device_type(device)
    model_config = load_model_config(cfg.model)
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
        offload_params=opt.offload.params, qat=cfg.training.qat, vision=_vision(cfg, model_config, lengths),
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
                       host_budget_bytes=host_for_offload(device_type))


def host_for_offload(device_type: str) -> int | None:
    """The host memory a plan for this machine's GPU may fill with offloaded state: 90 % of the
    available RAM, split between the processes of this node. None when the plan is not for a GPU
    of this machine (a CPU run offloads nothing; `maximus plan` for a card on a laptop)."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    per_process = host_available_bytes() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return int(per_process * HOST_OFFLOAD_SHARE)
