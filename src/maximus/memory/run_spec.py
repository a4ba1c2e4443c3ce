"""`RunSpec`: the run, described once, typed and frozen: the one door from the config into the
estimator, the planner and the kernels.

A `RunSpec` is resolved once from the config, the device, the world size and the data's lengths
(`maximus.memory.spec_from_config.run_spec`, the only reader of `Config` in memory/), or from
keywords (`keyword_spec`, for scripts and `estimate_peak`). It holds what no candidate plan
varies: the model's shape, the dtype and device, the LoRA settings, the optimizer, the techniques
(attention, objective, DPO reference, completion tokens, Matryoshka, ghost candidates, parameter
offload, a VLM's tower), the kernel decisions (lean LoRA, lean norm, grouped experts: each decided
once, device included) and the planner's search space (what is fixed, what is ``auto``).

A `Candidate` is what the planner varies: method, micro-batch, sequence, recompute, offloads,
loss chunk, MLP tile, accumulation, sharding. The estimator reads one spec and one candidate
(`maximus.memory.estimate.estimate_step`).

A new technique is one field here (on `Techniques`, or `KernelChoices` for a kernel), read by
the builder from the config, and one term in the estimator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from maximus.errors import ConfigError
from maximus.kernels.choices import KernelChoices, decide_kernels
from maximus.memory.adapter_terms import HEAD_NAMES
from maximus.memory.coefficients import DTYPE_BYTES
from maximus.memory.lengths import RowLengths
from maximus.memory.shape import ALL_LINEAR, ModelShape, model_shape

__all__ = ["Candidate", "GrpoSettings", "KernelChoices", "KroneckerLayout", "LoraSettings", "OptimizerSettings", "RunSpec", "SearchSpace",
           "Techniques", "decide_kernels", "keyword_spec", "kronecker_layout", "DEFAULT_ALLOW", "DEFAULT_MARGIN"]

#: Fraction of the budget kept free for what no estimate sees: allocator fragmentation,
#: kernels' scratch space, the odd long batch.
DEFAULT_MARGIN = 0.10

#: What the planner may change by default. Add ``"adamw_8bit"`` to let it switch to 8-bit AdamW
#: (a numerics change, hence opt-in).
#: ``checkpointing`` = full and per-layer (first k layers) recompute; ``selective`` = per-op.
DEFAULT_ALLOW = frozenset({"checkpointing", "selective", "offload_activations", "offload_optimizer", "micro_batch",
                           "loss_chunk", "tile_tokens"})



@dataclass(frozen=True)
class KroneckerLayout:
    """The shapes of Kronecker Sketching attention (`maximus.attention.sketch_module`)."""

    block: int
    local_blocks: int
    select_blocks: int
    sub_slots: int
    buckets: int

    @property
    def detail_tokens(self) -> int:
        return (self.local_blocks + self.select_blocks) * self.block

    @property
    def slots(self) -> int:
        return self.sub_slots * self.buckets

    @property
    def columns(self) -> int:
        """Keys each query's softmax spans: detail tokens plus sketch slots."""
        return self.detail_tokens + self.slots

    def params(self, head_dim: int) -> int:
        """Parameters of one layer's sketch (B factor, bucket scales, the block scorer)."""
        return self.sub_slots * self.block + self.buckets + 2 * head_dim * head_dim + head_dim

    def to_dict(self) -> dict[str, int]:
        return {"detail_tokens": self.detail_tokens, "sketch_slots": self.slots, "block": self.block}


def kronecker_layout(kronecker: Any = None) -> KroneckerLayout:
    """The layout a `KroneckerConfig` (or a dict of its fields; None = defaults) builds, by the
    rules of `KroneckerSketch`: detail_tokens // block blocks (two local), sub_slots =
    min(block, isqrt(sketch_slots)), buckets = sketch_slots // sub_slots."""
    get = (lambda k, d: kronecker.get(k, d)) if isinstance(kronecker, dict) else (lambda k, d: getattr(kronecker, k, d))
    if kronecker is None or kronecker is True:
        get = lambda k, d: d  # noqa: E731
    detail, slots, block = int(get("detail_tokens", 256)), int(get("sketch_slots", 64)), int(get("block", 64))
    if detail < block:
        raise ConfigError(f"optimization.kronecker_sketching.detail_tokens ({detail}) must be at least block ({block})",
                          "raise detail_tokens or lower block; detail_tokens is rounded down to whole blocks")
    blocks = detail // block
    sub = max(1, min(block, math.isqrt(slots)))
    return KroneckerLayout(block=block, local_blocks=min(2, blocks), select_blocks=blocks - min(2, blocks),
                           sub_slots=sub, buckets=max(1, slots // sub))


@dataclass(frozen=True)
class LoraSettings:
    """The adapter's settings (`lora.*`); the method itself is the candidate's."""

    r: int = 16
    #: ``all-linear`` or the targeted linear layers' names.
    target_modules: str | tuple[str, ...] = "all-linear"
    #: A mixture of experts' MLP adapters reach every expert (`lora.experts`).
    experts: bool = True
    modules_to_save: tuple[str, ...] = ()
    use_dora: bool = False
    dropout: float = 0.0

    @property
    def trains_head(self) -> bool:
        """`lora.modules_to_save` names the output head (the loss's chunks then have a larger floor)."""
        return bool({str(n).rsplit(".", 1)[-1] for n in self.modules_to_save} & HEAD_NAMES)

    def targets(self, shape: ModelShape) -> tuple[str, ...]:
        """The targeted linear layers of a Llama-style decoder layer; ConfigError when none is one."""
        if self.target_modules == "all-linear" or self.target_modules is None:
            return ALL_LINEAR
        names = [self.target_modules] if isinstance(self.target_modules, str) else list(self.target_modules)
        known = tuple(n for n in names if n in ALL_LINEAR)
        if not known:
            raise ConfigError(f"lora.target_modules {names} names no linear layer of a Llama-style decoder",
                              f"use all-linear or some of {', '.join(ALL_LINEAR)}")
        return known


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer (`training.optimizer` and its settings)."""

    name: str = "adamw"
    #: Projection rank of apollo / apollo_mini / galore (None: their default).
    rank: int | None = None
    #: Each parameter steps inside the backward and its gradient is freed.
    in_backward: bool = False
    #: ``fp32`` master weights for 16-bit full fine-tuning, or ``bf16`` (stochastic rounding).
    master_weights: str = "fp32"
    #: The embedding's and head's moments under apollo / apollo_mini / galore / muon.
    embedding: str = "adamw"


@dataclass(frozen=True)
class GrpoSettings:
    """GRPO's sampling, as memory reads it (`grpo.*` and the step's prompts)."""

    #: Prompts per optimizer step (`training.batch_size`) and their token cap (`training.seq_len`).
    prompts: int
    prompt_tokens: int
    group_size: int
    max_completion_tokens: int
    steps_per_generation: int = 1
    updates_per_generation: int = 1
    async_generation: bool = False
    #: ``batched`` (the KV-cached sampler) or ``vllm``.
    sampler: str = "batched"
    top_p: float = 1.0
    #: The run's method as configured (sampling merges LoRA only for ``lora``; vLLM needs an adapter).
    method: str = "lora"


@dataclass(frozen=True)
class Techniques:
    """What the run does beyond plain SFT on SDPA with the exact loss."""

    #: ``naive`` (Transformers' loss), ``exact`` (chunked linear cross-entropy) or ``ghost``.
    loss_mode: str = "exact"
    ghost_candidates: int = 1024
    #: ``sdpa`` or ``kronecker`` (then `kronecker` is its layout).
    attention: str = "sdpa"
    kronecker: KroneckerLayout | None = None
    #: ``sft``, ``dpo``, ``contrastive`` or ``grpo``.
    objective: str = "sft"
    #: ``adapter_off``, ``precomputed`` or ``none`` (DPO only).
    dpo_reference: str = "adapter_off"
    #: GRPO: the completion tokens of a row (the labelled ones: the head runs over them only).
    completion_tokens: int | None = None
    matryoshka_dims: tuple[int, ...] | None = None
    matryoshka_token_fraction: float = 0.0625
    #: Frozen decoder weights (4-bit ones too) stream to the device one layer ahead
    #: (`optimization.offload.params`): ``off``, ``on`` (from pinned host memory), ``disk`` (from a
    #: memory-mapped file) or ``auto`` (the planner streams only when nothing else fits).
    offload_params: str = "off"
    #: `training.qat`: ``off`` or the deployed format the forward rounds to (its cache is counted).
    qat: str = "off"
    #: `training.qat_float_weight`: with it each micro-batch runs twice (rounded, then float), so
    #: its gradients are alive during the second pass, as across micro-steps (`passes`).
    qat_float_weight: float = 0.0
    #: `training.qat_adapter`: ``separate`` rounds a LoRA layer's frozen base alone, once for the
    #: run (the adapter stays float), so no step rounds again.
    qat_adapter: str = "merged"
    #: A vision-language model's tower and projector (`maximus.memory.vision_terms.VisionSpec`).
    vision: Any = None
    #: GRPO's sampling (None for the other objectives).
    grpo: GrpoSettings | None = None

    @property
    def passes(self) -> int:
        """Forward + backward passes of each micro-batch: 2 under training.qat_float_weight."""
        return 2 if self.qat != "off" and self.qat_float_weight else 1

    def __post_init__(self):
        if isinstance(self.offload_params, bool):  # the keyword door's True / False
            object.__setattr__(self, "offload_params", "on" if self.offload_params else "off")

    @property
    def streams_params(self) -> bool:
        """Whether frozen weights stream (``on`` or ``disk``; ``auto`` is the planner's to decide)."""
        return self.offload_params in ("on", "disk")

    @property
    def params_store(self) -> str:
        """Where streamed layers live: ``host`` (pinned memory) or ``disk`` (a memory-mapped file)."""
        return "disk" if self.offload_params == "disk" else "host"

    @property
    def rows_per_example(self) -> int:
        """Rows one example adds to a forward: DPO pairs run chosen + rejected, contrastive pairs
        query + positive, in one forward of 2N rows (both padded to the same length)."""
        return 2 if self.objective in ("dpo", "contrastive") else 1


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose: fixed settings as the config gives them, ``auto`` ones searched."""

    #: ``full``, ``lora``, ``qlora`` or ``auto`` (the planner picks qlora or lora).
    method: str = "lora"
    #: Rows per optimizer step over all ranks, and the tokens per row (the cap with `lengths`).
    batch_size: int = 8
    seq_len: int = 2048
    micro_batch_size: int | str = "auto"
    #: Token-budget micro-batches (an int, ``auto``) or None (row counts).
    micro_batch_tokens: int | str | None = None
    gradient_checkpointing: str = "auto"
    offload_activations: str | bool = "auto"
    offload_optimizer: str | bool = "auto"
    loss_chunk_size: int | str | None = "auto"
    tile_tokens: int | str | None = "auto"
    allow: frozenset = DEFAULT_ALLOW
    margin: float = DEFAULT_MARGIN
    #: The host memory offloaded state may fill (None: not checked).
    host_budget_bytes: int | None = None
    #: Whether the ranks shard the model (FSDP2); None: the estimator's default (yes when several).
    sharded: bool | None = None
    #: Ranks that share each row (``training.context_parallel``): a degree, whose ranks the
    #: spec's ``world_size`` does not count (it counts the ranks that split the batch), or
    #: ``auto``: the planner picks the smallest divisor of ``world_size`` (then every process)
    #: whose split of the longest row fits the budget (`memory.planner.plan_for_budget`).
    context_parallel: int | str = 1


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved once (see the module docstring). `replace` it to change a setting."""

    shape: ModelShape
    dtype: str = "bf16"
    #: The device type: ``cuda``, ``cpu`` or ``mps``.
    device: str = "cuda"
    world_size: int = 1
    lora: LoraSettings = field(default_factory=LoraSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    techniques: Techniques = field(default_factory=Techniques)
    kernels: KernelChoices = field(default_factory=KernelChoices)
    search: SearchSpace = field(default_factory=SearchSpace)
    #: The run's tokenized rows in loader order (None: every row at ``search.seq_len``).
    lengths: RowLengths | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {self.dtype!r}", "use bf16, fp16 or fp32")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_BYTES[self.dtype]

    def searching(self, **changes: Any) -> "RunSpec":
        """This spec with some search settings changed (`SearchSpace` fields)."""
        return replace(self, search=replace(self.search, **changes))

    def strategy(self, sharded: bool) -> "RunSpec":
        """This spec searched under FSDP2 (``sharded``: its optimizer never offloaded, since FSDP2
        updates its DTensor shards on the device) or unsharded (DDP or one rank)."""
        return self.searching(sharded=True, offload_optimizer="off") if sharded else self.searching(sharded=False)

    def with_optimizer(self, name: str) -> "RunSpec":
        """This spec with another optimizer (the planner's ``adamw_8bit`` alternative)."""
        return replace(self, optimizer=replace(self.optimizer, name=name))


@dataclass(frozen=True)
class Candidate:
    """What the planner varies: one plan's settings, as the estimator reads them."""

    method: str = "lora"
    #: Rows of one micro-batch (sequences; DPO and contrastive: pairs) and tokens per row.
    micro_batch: int = 1
    seq_len: int = 2048
    #: ``none`` / ``full`` / ``selective`` (``off``: the former word for ``none``); or per layer a list of recompute modes (``none`` |
    #: ``selective`` | ``full``, as `Plan.recompute`) or booleans (True = full); or an int = how
    #: many layers (the first ones) are fully checkpointed.
    checkpointing: Any = "none"
    offload_activations: bool = False
    offload_optimizer: bool = False
    #: Tokens per chunk of the exact / ghost loss (None: the loss's own default).
    loss_chunk_tokens: int | None = None
    #: The MLP of each fully recomputed layer runs over tiles of this many tokens (None: untiled).
    tile_tokens: int | None = None
    grad_accum: int = 1
    #: FSDP2 shards the model over the ranks; None: yes when there are several (QLoRA never).
    sharded: bool | None = None
    #: Ranks that share each row (context parallelism): the estimate is one rank's, holding
    #: ``seq_len / context_parallel`` tokens of each row plus the attention exchange's buffers.
    context_parallel: int = 1
    #: SDPA gets a document mask (many short packed documents: `MicroBatch.masked`).
    masked_attention: bool = False


# ------------------------------------------------------------------------------------------------
# Keywords -> spec: the door for scripts (`estimate_peak`, `plan_for_budget` with keywords)

_LORA = {"lora_r": "r", "lora_targets": "target_modules", "lora_experts": "experts",
         "modules_to_save": "modules_to_save", "use_dora": "use_dora", "lora_dropout": "dropout"}
_OPTIMIZER = {"optimizer": "name", "optimizer_rank": "rank", "optimizer_in_backward": "in_backward",
              "master_weights": "master_weights", "embedding_optimizer": "embedding"}
_TECHNIQUES = {"loss_mode": "loss_mode", "ghost_candidates": "ghost_candidates", "attention": "attention",
               "objective": "objective", "dpo_reference": "dpo_reference", "completion_tokens": "completion_tokens",
               "matryoshka_dims": "matryoshka_dims", "matryoshka_token_fraction": "matryoshka_token_fraction",
               "offload_params": "offload_params", "vision": "vision", "qat": "qat",
               "qat_float_weight": "qat_float_weight", "qat_adapter": "qat_adapter"}
_SEARCH = {"method": "method", "batch_size": "batch_size", "seq_len": "seq_len", "micro_batch_size": "micro_batch_size",
           "micro_batch_tokens": "micro_batch_tokens", "gradient_checkpointing": "gradient_checkpointing",
           "offload_activations": "offload_activations", "offload_optimizer": "offload_optimizer",
           "loss_chunk_size": "loss_chunk_size", "tile_tokens": "tile_tokens", "margin": "margin",
           "host_budget_bytes": "host_budget_bytes", "sharded": "sharded",
           "context_parallel": "context_parallel"}
_KERNELS = ("lean_lora", "lean_norm", "grouped_experts")
_SPEC = ("dtype", "device", "world_size", "lengths", "kronecker", "allow")
#: `estimate_peak` keywords that only the candidate reads (`candidate_of`).
_CANDIDATE_ONLY = ("micro_batch", "checkpointing", "loss_chunk_tokens", "grad_accum", "masked_attention")


def keyword_spec(model_config: Any, settings: Mapping[str, Any], *, lean_lora: bool = True) -> RunSpec:
    """The `RunSpec` that `estimate_peak` / `plan_for_budget` keywords describe (their documented
    names: ``lora_r``, ``optimizer``, ``attention``, ``batch_size``, ...), for `model_config`
    (anything `model_shape` reads, or a `RunSpec`, whose settings the keywords then change).
    `lean_lora` is the default of the keyword of that name. TypeError for an unknown keyword."""
    unknown = (set(settings) - set(_LORA) - set(_OPTIMIZER) - set(_TECHNIQUES) - set(_SEARCH) - set(_KERNELS)
               - set(_SPEC) - set(_CANDIDATE_ONLY))
    if unknown:
        raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
    base = model_config if isinstance(model_config, RunSpec) else RunSpec(shape=model_shape(model_config))
    pick = lambda names: {field_: settings[k] for k, field_ in names.items() if k in settings}  # noqa: E731
    techniques = pick(_TECHNIQUES)
    if "matryoshka_dims" in techniques and techniques["matryoshka_dims"] is not None:
        techniques["matryoshka_dims"] = tuple(techniques["matryoshka_dims"])
    attention = settings.get("attention", base.techniques.attention)
    if "kronecker" in settings or "attention" in settings:
        techniques["kronecker"] = kronecker_layout(settings.get("kronecker")) if attention == "kronecker" else None
    lora = pick(_LORA)
    if "modules_to_save" in lora:
        lora["modules_to_save"] = tuple(lora["modules_to_save"] or ())
    if isinstance(lora.get("target_modules"), list):
        lora["target_modules"] = tuple(lora["target_modules"])
    search = pick(_SEARCH)
    if "allow" in settings:
        search["allow"] = DEFAULT_ALLOW if settings["allow"] is None else frozenset(settings["allow"])
    top = {k: settings[k] for k in ("dtype", "world_size", "lengths") if k in settings}
    if "device" in settings:
        top["device"] = str(settings["device"]).split(":")[0]
    spec = replace(base, **top, lora=replace(base.lora, **lora), optimizer=replace(base.optimizer, **pick(_OPTIMIZER)),
                   techniques=replace(base.techniques, **techniques), search=replace(base.search, **search))
    if isinstance(model_config, RunSpec) and not set(_KERNELS) & set(settings) and "device" not in settings:
        return spec  # the spec's kernels, decided already
    return replace(spec, kernels=decide_kernels(mode="eager", device_type=spec.device,
                                                lean_lora=settings.get("lean_lora", lean_lora),
                                                lean_norm=settings.get("lean_norm", True),
                                                grouped_experts=settings.get("grouped_experts", True)))


def candidate_of(settings: Mapping[str, Any]) -> Candidate:
    """The `Candidate` that `estimate_peak`'s per-step keywords describe (the rest are the spec's)."""
    names = {"method", "micro_batch", "seq_len", "checkpointing", "offload_activations", "offload_optimizer",
             "loss_chunk_tokens", "tile_tokens", "grad_accum", "sharded", "masked_attention"}
    return Candidate(**{k: v for k, v in settings.items() if k in names})

