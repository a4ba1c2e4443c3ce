"""The config schema: every knob once, with its default, unit and doc.

`Config.from_yaml(path, overrides)` and `Config.from_dict(d)` validate strictly: unknown keys are
errors with a "did you mean" hint, wrong types name the key and the value, and YAML syntax errors
name the line. `docs/config.md` is generated from this module (`python -m maximus.config`).
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from maximus.errors import ConfigError

# --------------------------------------------------------------------------------------------
# Memory sizes

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}

# Memory a card offers to one process, in bytes (what torch.cuda.mem_get_info reports when empty,
# rounded down). Prices are indicative on-demand US$/hour from public cloud lists (2025-2026). The
# third figure is the host-to-device copy rate from pinned memory, bytes/s, that streamed weights
# (`optimization.offload.params`) get: about 80 % of the card's PCIe link (T4: PCIe 3.0 x16; L4,
# A10, RTX 3090/4090, A100: PCIe 4.0 x16; H100 / H200: PCIe 5.0 x16). Data-sheet figures, not measured.
GPU_CARDS: dict[str, tuple[int, float, float]] = {
    "T4": (15 * 2**30, 0.35, 12e9),
    "L4": (22 * 2**30, 0.70, 25e9),
    "A10": (22 * 2**30, 1.00, 25e9),
    "RTX3090": (23 * 2**30, 0.45, 25e9),
    "RTX4090": (23 * 2**30, 0.70, 25e9),
    "A100-40GB": (39 * 2**30, 1.80, 25e9),
    "A100-80GB": (79 * 2**30, 2.50, 25e9),
    "H100": (79 * 2**30, 3.50, 50e9),
    "H200": (139 * 2**30, 4.50, 50e9),
}
#: The host-to-device rate assumed where the card is not known (a PCIe 4.0 x16 link), bytes/s.
DEFAULT_H2D_BYTES_PER_S = 25e9


def _card_key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).upper()


_CARD_LOOKUP = {_card_key(k): k for k in GPU_CARDS}
_CARD_LOOKUP.update({"A100": "A100-80GB", "A10G": "A10", "H10080GB": "H100", "GEFORCERTX4090": "RTX4090",
                     "GEFORCERTX3090": "RTX3090", "TESLAT4": "T4"})


def parse_bytes(value: Any, key: str = "target_vram") -> int | Literal["auto"] | None:
    """Parse a memory size: ``16GB`` (10^9), ``16 GiB`` (2^30), ``16000MB``, a number of bytes,
    a card name (``T4``, ``RTX4090``, ``A100-40GB``), ``auto`` or null."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a memory size, got {value!r}", "write e.g. 16GB, 24GiB, T4 or auto")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ConfigError(f"{key}: memory size must be positive, got {value!r}", "write e.g. 16GB")
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("auto",):
            return "auto"
        if text.lower() in ("null", "none", ""):
            return None
        card = _CARD_LOOKUP.get(_card_key(text))
        if card:
            return GPU_CARDS[card][0]
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)", text)
        if m and m.group(2).lower() in _UNITS:
            number = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if number <= 0:
                raise ConfigError(f"{key}: memory size must be positive, got {value!r}", "write e.g. 16GB")
            return int(number)
    cards = ", ".join(GPU_CARDS)
    raise ConfigError(f"{key}: cannot parse {value!r} as a memory size",
                      f"write e.g. 16GB, 16 GiB, 16000MB, a number of bytes, auto, or a card name ({cards})")


def format_bytes(n: float | int | None) -> str:
    """Human-readable size in binary units (GiB), as the progress bar and plan tables show it."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


# --------------------------------------------------------------------------------------------
# Sections


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


DataFormat = Literal["auto", "text", "alpaca", "sharegpt", "chat", "prompt_completion", "preference", "pairs", "prompt"]


class DatasetSpec(_Section):
    """One data source. A bare string in the config is shorthand for `{path: <string>}`."""

    path: str = Field(description="Local file or folder (jsonl, json, csv, parquet, txt) or a Hugging Face dataset name.")
    format: DataFormat = Field("auto", description="Record shape; `auto` detects it from the fields of the first record (`prompt` under `objective: grpo`).")
    split: str = Field("train", description="Split to read when `path` is a Hugging Face dataset or a folder of splits.")
    name: str | None = Field(None, description="Hugging Face dataset configuration name, if any.")
    text_field: str = Field("text", description="Field holding the text for `format: text`.")
    prompt_field: str = Field("prompt", description="Prompt field for `prompt_completion`, `preference` and `prompt` records.")
    completion_field: str = Field("completion", description="Completion field for `prompt_completion` records.")
    messages_field: str | None = Field(None, description="Field holding a chat (`messages` for chat, `conversations` for sharegpt); default by format.")
    chosen_field: str = Field("chosen", description="Preferred answer field for `preference` records (DPO).")
    rejected_field: str = Field("rejected", description="Rejected answer field for `preference` records (DPO).")
    query_field: str = Field("query", description="Query field for `pairs` records (objective contrastive).")
    positive_field: str = Field("positive", description="Matching document field for `pairs` records (objective contrastive).")
    images_field: str = Field("images", description="Vision-language models: field listing a record's image files (relative to the data file), placed at the `<image>` placeholders of the messages.")
    max_samples: int | None = Field(None, ge=1, description="Read at most this many records (after shuffling); null = all.")
    on_error: Literal["error", "skip"] = Field("error", description="A record that fails to parse: stop with file and line (`error`) or skip and count it (`skip`).")


class DataConfig(_Section):
    """What the data check (`maximus data check`, and the start of every run) does about what it finds; see docs/data_check.md."""

    dedupe: Literal["off", "exact", "near"] = Field("off", description="Drop duplicate training records before the split, keeping the first in file order: `exact` = equal after normalisation (Unicode NFKC, case folded, whitespace collapsed), `near` = those and near-duplicates (word-bigram Jaccard similarity >= 0.7, found with MinHash); `off` = keep every record (the check still reports them). Each source (`dataset`, `eval.dataset`) is deduplicated on its own; eval rows that copy training rows are reported as leakage, never dropped.")
    drop_untrainable: bool = Field(False, description="Also drop documents whose trained tokens all lie past `training.seq_len` (packing keeps them otherwise, as context-only tokens). Records with no trained token at all (an empty answer, a template that masks everything) are never trained either way.")
    on_problem: Literal["warn", "error"] = Field("warn", description="A check over its threshold (docs/data_check.md): print a warning and train (`warn`), or stop with one line naming the check, its share and its first row before the model loads (`error`, exit 2).")

    @field_validator("dedupe", mode="before")
    @classmethod
    def _yaml_boolean_dedupe(cls, v):
        return _yaml_switch(v, on="exact")  # unquoted YAML off arrives as False


class LoraConfig(_Section):
    """LoRA / DoRA adapter settings (PEFT)."""

    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float = Field(32, gt=0, description="Scaling numerator: the update is scaled by alpha / r (alpha / sqrt(r) with rsLoRA).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: Union[Literal["all-linear"], list[str], str] = Field("all-linear", description="`all-linear` (every linear layer except the output head) or a list of module names, e.g. [q_proj, v_proj].")
    use_dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA).")
    use_rslora: bool = Field(False, description="Rank-stabilised scaling alpha / sqrt(r).")
    modules_to_save: list[str] = Field(default_factory=list, description="Extra modules trained in full and saved with the adapter (e.g. [lm_head]).")
    experts: Union[bool, None] = Field(None, description="Mixture-of-experts models: whether the adapter reaches the experts (fused 3-D expert weights through PEFT `target_parameters`, per-expert linears by name). Unset = yes with `target_modules: all-linear`. The router stays frozen either way. `true` on a dense model is an error.")
    vision: bool = Field(False, description="Vision-language models: also put LoRA on the vision tower's linears (default: the language model only; the tower stays frozen).")
    projector: bool = Field(False, description="Vision-language models: also train the projector (image features -> text embeddings) in full, saved with the adapter.")


def _share(fraction: float, count: int) -> int:
    """round(fraction x count), halves up, at least 1: how many of `count` a QAT fraction picks."""
    return max(1, int(fraction * count + 0.5))


def _yaml_switch(value: Any, *, on: str) -> Any:
    """A YAML boolean as the word it was written as: False -> ``off``, True -> `on`."""
    if value is True:
        return on
    if value is False:
        return "off"
    return value


class OffloadConfig(_Section):
    """Smart Memory: what may move between device and host memory."""

    activations: Literal["auto", "on", "off"] = Field("auto", description="Checkpointed layer inputs to host memory, prefetched one layer ahead in backward.")
    optimizer: Literal["auto", "on", "off"] = Field("auto", description="Optimizer state in host memory (or 8-bit/paged), chosen by the planner when `auto`.")
    params: Literal["auto", "on", "off", "disk"] = Field("auto", description="Stream frozen base-model layers (4-bit ones too) to the device one ahead of use: `on` keeps them in host memory (pinned), `disk` in a memory-mapped file under $MAXIMUS_CACHE/streamed-weights (written once per model and quantization, read ahead by a background thread); `auto` streams only when no plan without it fits target_vram (from host memory when it has room, else from disk).")

    @field_validator("activations", "optimizer", "params", mode="before")
    @classmethod
    def _yaml_boolean_switch(cls, v):
        return _yaml_switch(v, on="on")  # unquoted YAML on / off arrive as True / False


class GhostLogitConfig(_Section):
    """Ghost Logit loss details (used when `optimization.use_ghost_logit` is true)."""

    candidates: int = Field(1024, ge=1, description="Number of hard-negative vocabulary rows per chunk of tokens, besides the targets.")
    prefix_dims: int = Field(64, ge=1, description="Leading hidden dimensions used for the cheap scan that finds hard negatives.")


class KroneckerConfig(_Section):
    """Kronecker Sketching attention details."""

    detail_tokens: int = Field(256, ge=1, description="Exact-attention budget per query: local window plus selected past tokens.")
    sketch_slots: int = Field(64, ge=1, description="Number of compressed slots summarising the rest of the past.")
    block: int = Field(64, ge=1, description="Query block size; slots seen by a block summarise only earlier blocks.")


class MatryoshkaConfig(_Section):
    """Nested-dimension (Matryoshka) loss: an auxiliary next-token loss for `sft`; for `contrastive`, the InfoNCE loss repeated on each prefix."""

    dims: list[int] = Field(default_factory=lambda: [64, 128, 256], description="Prefix sizes of the final hidden state that must work on their own (predict the next token for sft; retrieve for contrastive); sizes >= the hidden size are skipped.")
    weight: float | None = Field(None, ge=0.0, description="Weight of the mean over dims of the prefix losses, added to the full loss; null = 0.2 for `objective: sft` (an auxiliary next-token loss that should not pull the full-width loss) and 1.0 for `objective: contrastive` (the nested embeddings are the point).")
    token_fraction: float = Field(0.0625, gt=0.0, le=1.0, description="sft: share of the target tokens the prefix losses see, a seeded uniform sample of each group of 64 tokens, scaled by 1/fraction so the loss stays unbiased; 1 = every token. The prefix softmaxes are the auxiliary loss's cost (docs/benchmarks/matryoshka.md).")

    def weight_for(self, objective: str) -> float:
        """`weight`, or the objective's default when it is null (`MATRYOSHKA_DEFAULT_WEIGHTS`)."""
        return float(self.weight) if self.weight is not None else MATRYOSHKA_DEFAULT_WEIGHTS[objective]


#: `optimization.matryoshka.weight` when it is null, per objective.
MATRYOSHKA_DEFAULT_WEIGHTS = {"sft": 0.2, "contrastive": 1.0}


class OptimizationConfig(_Section):
    """How Maximus fits the job into memory."""

    target_vram: Any = Field(None, description="Memory budget: `16GB`, `16 GiB`, `16000MB`, bytes, a card name (`T4`, `RTX4090`, `A100-40GB`, ...), `auto` (free memory of the device) or null (no budget: the plan is still fitted to the device's free memory, read as `auto` reads it, but the run is not held to it).")
    use_ghost_logit: bool = Field(False, description="Train with the Ghost Logit sampled loss (evaluation always uses the exact loss): the article's spelling of `loss: ghost` (an error together with `loss: naive`).")
    ghost_logit: GhostLogitConfig = Field(default_factory=GhostLogitConfig, description="Ghost Logit loss details.")
    kronecker_sketching: Union[bool, KroneckerConfig] = Field(False, description="Kronecker Sketching attention: `true` for defaults or a mapping of its settings.")
    gradient_checkpointing: Literal["none", "full", "selective", "auto"] = Field("auto", description="Activation recomputation: `none`, every layer (`full`), per-op `selective`, or `auto`: the fastest plan that fits `target_vram` (no budget: the free memory of the device), which recomputes only what that memory requires. The same words as the plan's per-layer `recompute` in run.json. `off` (the former word) and unquoted YAML `false` mean `none`; `on` / `true` mean `full`.")
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description="Smart Memory offload settings.")
    loss: Literal["exact", "naive", "ghost"] = Field("exact", description="`exact`: chunked cross-entropy that never holds tokens x vocabulary logits; `naive`: full logits (reference); `ghost`: the Ghost Logit sampled loss (`use_ghost_logit: true` is the article's spelling of the same).")
    loss_chunk_size: Union[Literal["auto"], int] = Field("auto", description="Tokens per chunk in the lean loss; `auto` = 256 tokens in bf16 / fp16 and 512 in fp32 (fewer when that passes 192 / 256 MiB of logits; measured per dtype, docs/benchmarks/planner.md), smaller chunks when the planner needs the memory for `target_vram`.")
    kernels: Literal["auto", "triton", "compile", "eager"] = Field("auto", description="How the step runs: `triton` = fused Triton kernels (RMSNorm, RoPE, SwiGLU, QLoRA projection with NF4 dequantisation; CUDA only), `compile` = torch.compile of each decoder layer, `eager` = plain PyTorch, `auto` = triton on CUDA when available, else eager. Unavailable choices fall back to eager with a notice. Every mode uses padding-free attention over packed documents.")
    matryoshka: MatryoshkaConfig | None = Field(None, description="Matryoshka auxiliary loss; null = off.")
    tile_tokens: Union[Literal["auto", "off"], int] = Field("auto", description="Sequence-tiled recompute: in the backward of a fully checkpointed layer the MLP (with its LoRA projections) runs over tiles of this many tokens, so its intermediate-size tensors exist for one tile at a time (exact result). `auto` = the planner tiles only when `target_vram` needs it and picks the tile (no budget: off); `off` = never; a tile at least the micro-batch's tokens is one tile, i.e. untiled.")

    lean_norm: bool = Field(True, description="Lean RMSNorm (Llama, Mistral, Qwen2, Gemma): one autograd node that keeps the norm's input once and one float32 per token, and works in float32 over blocks of 1,024 tokens, where Transformers' norm saves a float32 copy of the input and holds five float32 tokens x hidden temporaries in backward. Same output bitwise, same gradients to float32 rounding. On CUDA the Triton RMSNorm (`kernels: triton`) does the same; not with `kernels: compile`.")
    grouped_experts: bool = Field(True, description="Grouped expert forward for Transformers' fused mixture-of-experts layers (Mixtral, Qwen3-MoE, gpt-oss), on CPU: the routed tokens sorted by expert once, one grouped matmul per projection over every expert's rows (`torch._grouped_mm`, the weights as stored; a loop over the experts where it does not take the shapes), the expert LoRA kept factored (no merged copy of the expert weights, no weight-sized gradient in backward). Same loss and gradients as Transformers' experts forward to float32 rounding; at each family's own routing and 1,024 tokens the whole LoRA step runs 2.3x (Mixtral, 8 experts top-2), 6.0x (gpt-oss, 32 top-4) and 25x (Qwen3-MoE, 128 top-8) Transformers' eager experts, 1.7x / 4.3x / 13x at 2,048 tokens (docs/benchmarks/moe.md). On CUDA Transformers' grouped_mm forward stays; not with `kernels: compile`.")
    lean_lora: bool = Field(True, description="Lean LoRA projections: each PEFT LoRA linear (dense or 4-bit) runs as one autograd node with a hand-written backward that keeps the layer input once, in the compute dtype (q/k/v share one, gate/up share one; no float32 copies). Same math and PEFT modules; DoRA, LoRA dropout and multi-adapter cases take PEFT's own forward. Not with `kernels: compile`.")

    @field_validator("tile_tokens")
    @classmethod
    def _positive_tile(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be a positive number of tokens, auto or off")
        return v

    @field_validator("target_vram", mode="before")
    @classmethod
    def _parse_vram(cls, v):
        return parse_bytes(v, "optimization.target_vram")

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _yaml_boolean_checkpointing(cls, v):
        # YAML 1.1 reads unquoted off / no / false as False and on / yes / true as True; `off` is
        # the former word for `none` (configs written with it keep working).
        v = _yaml_switch(v, on="full")
        return "none" if v == "off" else v

    @field_validator("loss_chunk_size")
    @classmethod
    def _positive_chunk(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be a positive integer or auto")
        return v

    @model_validator(mode="after")
    def _one_loss(self):
        # `use_ghost_logit: true` is the article's spelling of `loss: ghost`; beside `loss: naive`
        # it is a contradiction, not something for one key to win silently. `loss: exact` is the
        # default (and what an older run.json holds beside it): the article's key names the loss.
        if self.use_ghost_logit and self.loss == "naive":
            raise ConfigError("optimization.use_ghost_logit: true contradicts optimization.loss: naive",
                              "keep one of them: loss: ghost (or use_ghost_logit: true) for the Ghost Logit loss, "
                              "or use_ghost_logit: false for loss: naive")
        if self.use_ghost_logit:
            object.__setattr__(self, "loss", "ghost")  # one spelling from here on (run.json, model_dump)
        return self

    @property
    def loss_mode(self) -> Literal["exact", "naive", "ghost"]:
        """The training loss, whichever key named it: ``ghost`` when `use_ghost_logit` is true."""
        return "ghost" if self.use_ghost_logit else self.loss

    @property
    def kronecker(self) -> KroneckerConfig | None:
        """The sketching settings when enabled, else None."""
        if self.kronecker_sketching is True:
            return KroneckerConfig()
        if isinstance(self.kronecker_sketching, KroneckerConfig):
            return self.kronecker_sketching
        return None


class TrainingConfig(_Section):
    """The optimisation loop."""

    batch_size: int = Field(8, ge=1, description="Effective batch in sequences per optimizer step (micro_batch_size x gradient accumulation x world size).")
    micro_batch_size: Union[Literal["auto"], int] = Field("auto", description="Sequences per forward pass; `auto` lets the planner choose (the fastest that fits the budget, or without one the free memory).")
    micro_batch_tokens: Union[Literal["auto"], int, None] = Field(None, description="Split each optimizer step's rows into micro-batches by a token budget instead of a row count (longest rows first, a micro-batch holds rows while rows x its longest row fit), so a few long rows do not set the peak for all the others; `auto` lets the planner pick the budget from the data's lengths; null = micro_batch_size rows per micro-batch. Not for objective grpo. See docs/planner.md.")
    epochs: float = Field(1, gt=0, description="Passes over the training data (fractions allowed).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    warmup_steps: Union[int, float] = Field(0.03, ge=0, description="Linear warmup: a number of steps, or a fraction (< 1) of the total.")
    scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a fraction of the peak.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    max_grad_norm: float | None = Field(1.0, description="Clip the global gradient norm; null = no clipping.")
    seq_len: int = Field(2048, ge=8, description="Tokens per sequence (packed, or truncated when packing is off).")
    packing: bool = Field(True, description="Pack documents into seq_len rows with per-document positions and no attention across documents.")
    train_on_inputs: bool = Field(False, description="Also compute the loss on prompt / user tokens (default: completion / assistant tokens only).")
    seed: int = Field(0, description="Seed for initialisation, shuffling and dropout.")
    save_every: int | None = Field(None, ge=1, description="Write a checkpoint every N optimizer steps (and always at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Keep the newest K checkpoints.")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "adamw_4bit", "adamw_8bit_torchao", "apollo", "apollo_mini", "galore", "adam_mini", "muon"] = Field("adamw", description="torch AdamW; bitsandbytes 8-bit / paged 8-bit AdamW; torchao 4-bit AdamW (`adamw_4bit`) and 8-bit AdamW (`adamw_8bit_torchao`: inside the backward its embedding and head step row block by row block, so their whole gradients never exist); APOLLO, APOLLO-Mini (apollo-torch) and GaLore (galore-torch), full fine-tuning only; Adam-mini (adam-mini); `muon`: torch.optim.Muon on the 2-D decoder weights with AdamW on embedding, head and norms. Each needs its package (extra of the same name); see docs/optimizers.md.")
    optimizer_rank: int | None = Field(None, ge=1, description="apollo / apollo_mini / galore: directions each 2-D decoder weight's gradient is projected onto; null = the optimizer's default (apollo 256, apollo_mini 1, galore 128). At most the weight's smaller side.")
    optimizer_update_gap: int = Field(200, ge=1, description="apollo / apollo_mini / galore: optimizer steps between two new projections.")
    optimizer_scale: float | None = Field(None, gt=0, description="apollo / apollo_mini / galore: scale of the projected update; null = the optimizer's default (apollo 1, apollo_mini 128, galore 0.25).")
    optimizer_in_backward: bool = Field(False, description="Step each parameter inside the backward, as soon as its gradient is ready, and free that gradient: the full set of gradients never exists at once. Needs one pass per step (no gradient accumulation) and one process. With training.max_grad_norm set, each step runs its backward twice (the first measures the global norm, the second steps on clipped gradients: exact clipping, one more forward and backward); with max_grad_norm: null, one backward and no clipping (a non-finite gradient then skips that parameter's update only).")
    embedding_optimizer: Literal["adamw", "adamw_4bit"] = Field("adamw", description="apollo / apollo_mini / galore / muon, full fine-tuning: the optimizer of the embedding and the output head, which these leave to AdamW. `adamw`: float32 moments (their authors' recipe); `adamw_4bit`: torchao's 4-bit moments (~1.06 bytes per value instead of 8), for the 128k-row embedding and head that otherwise hold most of the state. See docs/optimizers.md.")
    master_weights: Literal["fp32", "bf16"] = Field("fp32", description="Full fine-tuning: float32 master weights (`fp32`), or bf16 weights updated with stochastic rounding (`bf16`, torchao; optimizer adamw, adamw_4bit or adamw_8bit_torchao): half the weight and gradient memory.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description="Compute dtype: `auto` = bf16 where the device supports it, else fp32.")
    max_bad_steps: int = Field(5, ge=1, description="Stop after this many consecutive steps with a non-finite loss or gradient (each is skipped).")
    distributed: Literal["auto", "ddp", "fsdp"] = Field("auto", description="Under torchrun: FSDP2 when the model does not fit one device, else DDP.")
    context_parallel: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = Field(1, description="Under torchrun: split each row's tokens over this many processes (context parallelism), so a row longer than one device holds can train; it must divide the world size, the remaining factor splits the batch (a 2-D device mesh, shard x context; DDP, or FSDP2 sharding over the whole world). Attention sees the whole causal row through Ulysses (an all-to-all, when the query heads divide by it) or else ring attention; positions and packed documents are the whole row's; the loss is normalised by the whole step's token count, so the update equals one process's. Objectives sft, dpo (chosen and rejected rows split alike) and grpo (its training pass; generation runs whole rows on every rank, and context_parallel must then equal the world size, under DDP); 1 = off. `auto`: the planner picks the smallest divisor of the number of processes (whose split cuts training.seq_len into equal chunks) at which the longest row fits optimization.target_vram after the one-device levers (recompute, offload, MLP tiles, micro-batch 1), and plans the rest of the run around it; the plan records the degree (run.json `plan.context_parallel`) and the trainer joins at it; one process, no budget, or a run the split cannot train (Kronecker Sketching, objectives other than sft/dpo/grpo, grpo.async_generation) plans degree 1. The default stays 1 so a torchrun launch splits the batch unless asked. See docs/distributed.md.")
    log_every: int = Field(1, ge=1, description="Print/log every N optimizer steps (metrics.jsonl always gets every step).")
    qat: Literal["off", "q8_0", "q4_0", "q4_k_m", "int4"] = Field("off", description="Quantization-aware training for the file you deploy: in training mode every forward sees the weights rounded as the export will round them (a straight-through gradient; with LoRA / QLoRA the quantized merged weight base + adapter). `q8_0`, `q4_0`, `q4_k_m`: the GGUF types of `maximus export --format gguf | ollama --quant` (which then defaults to this), rounded exactly as the gguf package and llama.cpp's quantiser round each tensor (llama.cpp's own Q4_K_M mixture and fallbacks); `int4`: torchao's symmetric int4 in groups of 32 on the decoder's linears (no GGUF export holds it). Held-out evaluation scores the float model; `maximus eval --gguf FILE` scores the export in llama.cpp. Costs one fake-quantized copy of the quantized weights and their rounding each step (docs/benchmarks/qat.md). Not with DoRA, mixture-of-experts models or Kronecker sketching.")
    qat_start: float = Field(0.0, ge=0, lt=1, description="With training.qat: the fraction of the optimizer steps trained without the rounding before it starts (0 = from the first step; 0.5 = the second half of the steps see the rounded weights): the model first learns the task in float, then adapts to the rounding. The planner counts the rounded copies for the whole run. See docs/benchmarks/qat.md.")
    qat_fraction: float = Field(1.0, gt=0, le=1, description="With training.qat: the share of the rounding each optimizer step (from training.qat_start on) sees, as quantization noise (Fan et al. 2020): the rest trains on the float weights. Under training.qat_noise `matrices`, each step's forward rounds exactly round(fraction x N) of the N quantized matrices (at least one), drawn anew each step; under `steps`, exactly round(fraction x steps) of the steps round every matrix and the others none. Draws are seeded (training.seed, the step), so a resumed run makes the same. 1 = every matrix, every step. See docs/benchmarks/qat.md.")
    qat_noise: Literal["matrices", "steps"] = Field("matrices", description="With training.qat_fraction below 1: what the fraction draws, the matrices rounded within each step (`matrices`) or the steps rounding every matrix (`steps`).")
    qat_float_weight: float = Field(0.0, ge=0, lt=1, description="With training.qat: the weight w of the float weights' loss in each rounding step's loss, (1 - w) x the loss on the rounded weights + w x the loss on the weights as they are: every micro-batch runs its forward and backward twice (about twice the step time; one pass's activations at a time, but the first pass's gradients stay alive through the second, as across micro-steps, which the planner counts), so the run trains the float model it keeps beside the file it deploys. metrics.jsonl logs both losses (qat_rounded_loss, qat_float_loss). 0 = the rounded loss alone. Not with training.optimizer_in_backward (it steps inside the first backward). See docs/benchmarks/qat.md.")
    qat_adapter: Literal["merged", "separate"] = Field("merged", description="With training.qat (a GGUF target) and a LoRA / QLoRA adapter: how the deployed file holds the adapter, and so what the forward trains against. `merged`: the export merges the adapter into the base and rounds the sum (`maximus export --format gguf | ollama`): the forward sees the quantized merged weight Q(W + s B A). `separate`: the export writes the base quantized alone and the adapter beside it as a float llama.cpp LoRA file (`maximus export --format gguf-lora`; llama.cpp applies it as `-m base.gguf --lora adapter.gguf`): the forward sees Q(W) + s B A, so the adapter trains exactly as it is served and can make up for the base's rounding, which a merged adapter, far smaller than the rounding step, mostly cannot (docs/benchmarks/qat.md). Each export warns when its format is not the one the run trained for.")
    memory_meter: Literal["auto", "every_step", "sampled"] = Field("auto", description="Which steps run under the memory meter. `every_step`: all of them. `sampled`: on the CPU, where the meter sees every op and can nearly double a small model's step, only the steps that can set a new peak (the first two, a step with longer rows or more tokens than every metered one, the first after a re-plan, every 25th and the last; GRPO decides on its sampled rows, and its sampling is always metered); the others log no memory. `auto`: every step on CUDA (the allocator's counters cost nothing), `sampled` elsewhere.")

    qat_correction_rank: int = Field(0, ge=0, description="With training.qat_adapter: separate: the rank N of a frozen correction of the base's own rounding, served beside the adapter. Before the first step the run computes, for every adapted matrix, the rank-N matrix closest to W - Q(W) in the metric of the inputs it sees over the first 64 training rows (as EoRA does); the adapter then trains against Q(W) + the correction, and `maximus export --format gguf-lora` writes both as one llama.cpp LoRA of rank lora.r + N. The run's float model (adapter/) does not include it (adapter/qat_correction.safetensors holds it). Costs one pass over the 64 rows and a factorisation per matrix at the start, and in the file N x (rows + columns) float32 numbers per matrix; nothing per step. 0 = none. See docs/benchmarks/qat.md.")

    @field_validator("qat", mode="before")
    @classmethod
    def _yaml_boolean_qat(cls, v):
        return _yaml_switch(v, on="on")  # unquoted YAML off arrives as False; `on` names no target

    @model_validator(mode="after")
    def _qat_start_needs_qat(self):
        if self.qat_start and self.qat == "off":
            raise ConfigError(f"training.qat_start {self.qat_start} has no rounding to start: training.qat is off",
                              "set training.qat (e.g. q4_0) or remove training.qat_start")
        if self.qat_fraction != 1 and self.qat == "off":
            raise ConfigError(f"training.qat_fraction {self.qat_fraction} has no rounding to share out: training.qat "
                              "is off", "set training.qat (e.g. q4_0) or remove training.qat_fraction")
        if self.qat_float_weight and self.qat == "off":
            raise ConfigError(f"training.qat_float_weight {self.qat_float_weight} has no rounded loss to mix with: "
                              "training.qat is off", "set training.qat (e.g. q4_0) or remove training.qat_float_weight")
        if self.qat_adapter != "merged" and self.qat not in ("q8_0", "q4_0", "q4_k_m"):
            raise ConfigError(f"training.qat_adapter {self.qat_adapter} keeps the adapter beside a GGUF base file, and "
                              f"training.qat is {self.qat}", "set training.qat to a GGUF target (q8_0, q4_0, q4_k_m) "
                              "or remove training.qat_adapter")
        if self.qat_correction_rank and self.qat_adapter != "separate":
            raise ConfigError(f"training.qat_correction_rank {self.qat_correction_rank} corrects the rounded base beside "
                              f"the adapter, and training.qat_adapter is {self.qat_adapter}",
                              "set training.qat_adapter: separate (with training.qat a GGUF target) or remove "
                              "training.qat_correction_rank")
        if self.qat_float_weight and self.optimizer_in_backward:
            raise ConfigError(f"training.qat_float_weight {self.qat_float_weight} runs two backward passes per step, "
                              "and training.optimizer_in_backward steps the weights inside the first",
                              "set training.optimizer_in_backward: false or remove training.qat_float_weight")
        return self

    def qat_first_step(self, total_steps: int) -> int:
        """The first optimizer step (1-based) whose forward sees the rounded weights (`qat_start`)."""
        return int(self.qat_start * total_steps) + 1

    def qat_steps(self, total_steps: int) -> frozenset[int]:
        """The optimizer steps (1-based) whose forward sees the rounded weights: of the steps from
        `qat_first_step` on, all (`qat_fraction` 1, or qat_noise `matrices`: each rounds a share of
        the matrices) or, under qat_noise `steps`, exactly round(qat_fraction x their number), at
        least one, drawn with `seed` (a function of the config alone, so a resumed run agrees)."""
        import random

        steps = list(range(self.qat_first_step(total_steps), total_steps + 1))
        if self.qat_fraction == 1 or not steps or self.qat_noise == "matrices":
            return frozenset(steps)
        random.Random(self.seed).shuffle(steps)
        return frozenset(steps[:_share(self.qat_fraction, len(steps))])

    def qat_matrices(self, step: int, matrices: int) -> list[bool]:
        """Which of `matrices` quantized matrices optimizer step `step` (one of `qat_steps`) rounds:
        all, or under qat_noise `matrices` exactly round(qat_fraction x matrices), drawn with
        (`seed`, `step`)."""
        import random

        if self.qat_fraction == 1 or self.qat_noise == "steps":
            return [True] * matrices
        chosen = set(random.Random(f"{self.seed}:{step}").sample(range(matrices), _share(self.qat_fraction, matrices)))
        return [i in chosen for i in range(matrices)]

    @field_validator("micro_batch_size", "micro_batch_tokens")
    @classmethod
    def _positive_micro(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be a positive integer or auto")
        return v


class VisionConfig(_Section):
    """Images for vision-language models (docs/vision.md)."""

    max_pixels: int | None = Field(None, ge=64, description="Cap on an image's area in pixels: a larger image is resized (aspect kept) before the processor sees it, which bounds its image tokens and the tower's memory for processors that keep the resolution (Qwen2-VL, Idefics3); null = the processor's own limit.")
    image_root: str | None = Field(None, description="A folder every image must lie in: the images of data rows and of eval.prompts are resolved (links followed) and one outside it is an error naming it; null = anywhere. `maximus ui` sets it to its --data-root for every run it starts.")


class ImagePrompt(_Section):
    """An `eval.prompts` entry for a vision-language model: a user turn with images."""

    text: str = Field(description="The user's text, after the images.")
    image: Union[str, list[str]] = Field(description="Image file(s) shown before the text, relative to the working directory.")

    @property
    def images(self) -> list[str]:
        return [self.image] if isinstance(self.image, str) else list(self.image)

    def __str__(self) -> str:
        return f"[{', '.join(self.images)}] {self.text}"


class EvalConfig(_Section):
    """Held-out evaluation against the base model."""

    enabled: bool = Field(True, description="Evaluate held-out loss and perplexity.")
    split: float = Field(0.05, ge=0, lt=1, description="Fraction of the data held out for evaluation.")
    every: int | None = Field(None, ge=1, description="Also evaluate every N optimizer steps.")
    before: bool = Field(True, description="Evaluate the base model before training, for the before/after table.")
    max_batches: int | None = Field(None, ge=1, description="Cap on evaluation batches; null = the whole held-out split.")
    exact_match: int = Field(0, ge=0, description="Shorthand: N > 0 adds `exact_match` to `eval.metrics` and scores it on up to N held-out examples (instead of `max_examples`); 0 = off. With no example that has a prompt (plain text), run.json has exact_match: null and exact_match_note.")
    prompts: list[Union[str, ImagePrompt]] = Field(default_factory=list, description="Prompts to generate from before and after training (objectives sft, dpo and grpo). For a vision-language model an entry may be `{text: ..., image: file.png}` (or a list of files): the images, then the text, in one user turn.")
    max_new_tokens: int = Field(32, ge=1, description="Tokens generated per prompt, and at most per held-out example for `eval.metrics` (greedy, stopping at EOS).")
    dataset: Union[str, DatasetSpec, list[Union[str, DatasetSpec]], None] = Field(None, description="Your own held-out data, in the same forms as `dataset` (a path, a mapping with `format`, or a list). When set, the training data is not split (`eval.split` is unused) and every held-out row comes from it; missing or empty after filtering is an error naming it, before training.")
    metrics: list[str] = Field(default_factory=list, description="Task metrics of greedy completions (chat template for chat data, the format's prompt otherwise) against the held-out answers: `exact_match` (equal after stripping surrounding whitespace), `rouge_l` (ROUGE-L F1, `rouge-score`), `chrf` (chrF, `sacrebleu`, 0-100), or `module:function` / `path/file.py:function` called as f(predictions, references, **columns) -> float, each column a list with one value per example. A metric that raises is recorded as failed (eval.<when>.metrics_failed); training is kept. Objective sft only.")
    max_examples: int = Field(50, ge=1, description="Held-out examples (those with a prompt and an answer) that `eval.metrics` generate for; the first N in the held-out order.")
    few_shot: int = Field(0, ge=0, description="Prompting baseline: the base model also scored with K solved training examples in front of each held-out prompt (chat turns for chat data; the format's own prompt, blocks separated by a blank line, for prompt/completion and alpaca), same loss and metrics; run.json eval.prompted. The K are fixed by `training.seed` and never held-out rows; 0 = off. Objective sft only.")
    system_prompt: str | None = Field(None, description="A system prompt for the prompting baseline (a system turn for chat data, text before the prompt otherwise); alone (few_shot: 0) it makes a zero-shot prompted baseline. Objective sft only.")

    @field_validator("dataset")
    @classmethod
    def _dataset_specs(cls, v):
        if v is None:
            return None
        items = v if isinstance(v, list) else [v]
        if not items:
            raise ValueError("the list is empty; leave eval.dataset out to hold out eval.split of the training data")
        return [DatasetSpec(path=i) if isinstance(i, str) else i for i in items]

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v):
        for name in v:
            if ":" not in name and name not in TASK_METRICS:
                close = difflib.get_close_matches(name, TASK_METRICS, n=1, cutoff=0.5)
                hint = f"did you mean '{close[0]}'?" if close else (
                    f"built-in metrics: {', '.join(TASK_METRICS)}, or module:function for your own")
                raise ConfigError(f"eval.metrics: unknown metric {name!r}", hint)
        return v

    @property
    def prompted(self) -> bool:
        """Whether the prompting baseline runs (`few_shot` or `system_prompt`)."""
        return bool(self.few_shot or self.system_prompt)


#: The built-in `eval.metrics` (`maximus.evaluate.metrics`).
TASK_METRICS = ("exact_match", "rouge_l", "chrf")


class DpoConfig(_Section):
    """Preference tuning (used when `objective: dpo`)."""

    beta: float = Field(0.1, gt=0, description="Strength of the KL-style penalty (inverse temperature).")
    loss: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = Field("sigmoid", description="Preference loss.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Conservative DPO: assumed label noise.")
    reference: Literal["adapter_off", "precomputed"] = Field("adapter_off", description="Reference log-probs from the base with the adapter disabled, or computed once and cached.")
    simpo_gamma: float = Field(0.5, description="SimPO target margin (gamma / beta ratio as in the paper).")
    orpo_alpha: float = Field(1.0, description="ORPO weight of the odds-ratio term.")


class ContrastiveConfig(_Section):
    """Embedding training (used when `objective: contrastive`): InfoNCE with in-batch negatives on
    pooled final hidden states; with `optimization.matryoshka`, also on each nested prefix."""

    temperature: float = Field(0.05, gt=0, description="Softmax temperature of the cosine similarities (InfoNCE).")
    pooling: Literal["mean", "last"] = Field("mean", description="Text embedding: mean of the final hidden states over the text's tokens, or the last token's state (as in `maximus.embed`).")


class GrpoConfig(_Section):
    """Reinforcement learning from rewards (used when `objective: grpo`; see docs/grpo.md). Each
    optimizer step samples `group_size` completions for each of `training.batch_size` prompts from
    the policy, scores them with the reward functions and trains on the group-relative advantages;
    `training.micro_batch_size` counts completions per backward."""

    group_size: int = Field(8, ge=2, description="Completions sampled per prompt (the group whose mean reward is the baseline).")
    max_completion_tokens: int = Field(256, ge=1, description="Tokens generated per completion at most (generation stops earlier at EOS); Dr. GRPO's constant L_max.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the log-probs of the loss are taken at the same temperature (as TRL does).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p (1 = off).")
    beta: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference (the model with the adapter switched off); 0 = no reference pass at all.")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clipping: the ratio to the sampling policy is clipped to [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clipping bound (DAPO's clip-higher, e.g. 0.28); null = epsilon.")
    kl_ratio_correction: bool = Field(True, description="Weight the KL term by the importance ratio to the sampling policy: an unbiased estimate of KL(policy || reference) from samples of the old policy (DeepSeek-V3.2; TRL's use_bias_correction_kl, on by default); false = the GRPO paper's plain k3 term.")
    updates_per_generation: int = Field(1, ge=1, description="Optimizer steps on each generation's completions (TRL's num_iterations); the sampling policy's log-probs are kept from generation time, not recomputed.")
    steps_per_generation: int = Field(1, ge=1, description="Optimizer steps that share one generation batch (TRL's name): the `training.batch_size` prompts x `group_size` completions are sampled at once and split into this many steps, each on its share; the sampling policy's log-probs are kept and the clipped ratio corrects the later steps. Must divide batch_size x group_size.")
    async_generation: bool = Field(False, description="Sample the next generation batch while the current step's forward and backward run (a second thread), with the weights before this step's update: one step off-policy, corrected by the clipped ratio against the kept sampling log-probs (as TRL's async GRPO). Needs grpo.beta: 0 or an adapter.")
    generation: Literal["batched", "vllm"] = Field("batched", description="Sampler: `batched` (all prompts x group in one KV-cached decode loop, prefilling each prompt once) or `vllm` (CUDA only, the `vllm` package: a colocated vLLM engine that receives the adapter after each update).")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field("dapo", description="Normalisation of the token losses: `grpo` = mean of per-completion token means, `dr_grpo` = sum / (completions x max_completion_tokens), `dapo` = sum / completion tokens (TRL's default).")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="Advantages are reward - group mean, divided by the group's standard deviation (`group`), the batch's (`batch`), or not divided (`none`, Dr. GRPO).")
    rewards: list[str] = Field(default_factory=list, description="Reward functions, each `module:function` (an importable module or a .py file path) or a built-in name (`exact_answer`, `regex_format`); called as f(prompts, completions, completion_ids, **columns) -> list of float or None (TRL's convention).")
    reward_weights: list[float] | None = Field(None, description="Weight of each reward function in the summed reward; null = 1 each.")
    answer_field: str = Field("answer", description="Column holding the reference answer for the built-in `exact_answer` reward.")
    format_pattern: str | None = Field(None, description="Regular expression the built-in `regex_format` reward matches against the whole completion (1.0 if it matches, else 0.0).")


class LoggingConfig(_Section):
    """Where progress goes besides the terminal and metrics.jsonl."""

    tensorboard: bool = Field(False, description="Also write TensorBoard events under `<output_dir>/tensorboard`: loss, lr, tokens/s, memory and budget per step, held-out metrics before / during / after training (extra `tensorboard`).")
    wandb: bool = Field(False, description="Also log the same to Weights & Biases, project `maximus`, files under `<output_dir>/wandb` (`WANDB_MODE=offline` keeps it local; extra `wandb`).")
    mlflow: bool = Field(False, description="Also log the same to MLflow, experiment `maximus` (extra `mlflow`).")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI for `logging.mlflow`; default a local SQLite store `sqlite:///<output_dir>/mlflow.db`.")
    progress: Literal["auto", "rich", "plain", "none"] = Field("auto", description="Progress display: rich bar on a terminal, plain lines otherwise.")


class Config(_Section):
    """A Maximus run."""

    model: str = Field(description="Hugging Face hub id or local model directory.")
    dataset: Union[str, DatasetSpec, list[Union[str, DatasetSpec]]] = Field(description="A path, a hub name, a mapping ({path:, format:, split:, ...}) or a list of those.")
    method: Literal["full", "lora", "qlora", "auto"] = Field("lora", description="Full fine-tune, LoRA, QLoRA (4-bit NF4 base), or `auto` (the planner picks LoRA or QLoRA from target_vram; full fine-tuning only when asked).")
    allow_full: bool = Field(False, description="With `method: auto` and a target_vram: choose full fine-tuning whenever a full plan fits the budget (with the configured optimizer), else LoRA / QLoRA.")
    objective: Literal["sft", "dpo", "contrastive", "grpo"] = Field("sft", description="Supervised fine-tuning, preference tuning on (prompt, chosen, rejected), embedding training on (query, positive) pairs, or reinforcement learning from reward functions on prompts (GRPO).")
    output_dir: str | None = Field(None, description="Run directory; default runs/<model name>. New, empty, or a run of ours (marked by `.maximus-run.json` at its start: the same command again resumes it); a directory holding other files is refused before anything loads (docs/run_directory.md).")
    tokenizer: str | None = Field(None, description="Tokenizer id or directory; default: the model's.")
    init_adapter: str | None = Field(None, description="Start from an existing PEFT LoRA adapter directory (e.g. DPO on top of an SFT run). LoRA / QLoRA train it further: `lora.*` keys not written in the config come from the adapter, a written shape key (`r`, `alpha`, `target_modules`, `use_dora`, `use_rslora`) must match it, a written `lora.dropout` applies, and `lora.modules_to_save` and the Kronecker sketches are trained besides its own modules. `method: full` merges it into the base and trains every weight.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off unless you trust it).")
    allow_pickle: bool = Field(False, description="Allow loading .bin/.pt (pickle) weights; safetensors only by default.")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field("auto", description="Training device: `auto` = cuda, then mps, then cpu.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Adapter settings.")
    optimization: OptimizationConfig = Field(default_factory=OptimizationConfig, description="Memory techniques and budget.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="The optimisation loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation against the base model.")
    vision: VisionConfig = Field(default_factory=VisionConfig, description="Image settings for vision-language models.")
    dpo: DpoConfig = Field(default_factory=DpoConfig, description="Preference tuning settings.")
    contrastive: ContrastiveConfig = Field(default_factory=ContrastiveConfig, description="Embedding training settings.")
    grpo: GrpoConfig = Field(default_factory=GrpoConfig, description="Reinforcement learning from rewards (GRPO) settings.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Extra logging sinks.")
    data: DataConfig = Field(default_factory=DataConfig, description="What the data check does about duplicates, untrainable records and problems over their thresholds.")

    @model_validator(mode="after")
    def _eval_fits_objective(self):
        """Evaluation keys that an objective cannot honour are refused by name, never ignored."""
        e = self.eval
        if self.objective == "sft":
            return self
        used = [k for k, on in (("eval.metrics", e.metrics), ("eval.exact_match", e.exact_match),
                                ("eval.few_shot", e.few_shot), ("eval.system_prompt", e.system_prompt)) if on]
        if self.objective == "contrastive" and e.prompts:
            used.insert(0, "eval.prompts")
        if any(isinstance(p, ImagePrompt) for p in e.prompts):
            raise ConfigError(f"eval.prompts: an image prompt does not apply to objective {self.objective}",
                              "image prompts are for supervised fine-tuning of a vision-language model (objective sft)")
        if used:
            own = {"dpo": "its held-out rewards/accuracy and chosen-answer perplexity",
                   "contrastive": "its held-out recall@k (embed texts with maximus embed)",
                   "grpo": "its held-out greedy reward (the exact_answer reward for exact match)"}[self.objective]
            raise ConfigError(f"{used[0]} does not apply to objective {self.objective}",
                              f"remove it; objective {self.objective} reports {own}")
        return self

    @model_validator(mode="after")
    def _context_parallel_fits(self):
        """What context parallelism cannot split yet is refused here, before anything loads."""
        t = self.training
        if t.context_parallel in (1, "auto"):  # auto splits only runs that can be split (memory.spec_from_config)
            return self
        if self.optimization.kronecker is not None:
            raise ConfigError(f"training.context_parallel {t.context_parallel} cannot split Kronecker Sketching attention "
                              "(optimization.kronecker_sketching): its sketch summarises the whole row on one process",
                              "turn off optimization.kronecker_sketching or set training.context_parallel: 1")
        if self.objective not in ("sft", "dpo", "grpo"):
            raise ConfigError(f"training.context_parallel {t.context_parallel} supports objectives sft, dpo and grpo, "
                              f"not {self.objective}",
                              "set training.context_parallel: 1")
        if self.objective == "grpo" and self.grpo.async_generation:
            raise ConfigError(f"training.context_parallel {t.context_parallel} cannot run grpo.async_generation: "
                              "the ranks exchange the sampled completions, which a second thread cannot do "
                              "beside the training step's exchanges",
                              "set grpo.async_generation: false or training.context_parallel: 1")
        return self

    @model_validator(mode="after")
    def _normalise(self):
        items = self.dataset if isinstance(self.dataset, list) else [self.dataset]
        if not items:
            raise ValueError("dataset: the list is empty")
        specs = [DatasetSpec(path=i) if isinstance(i, str) else i for i in items]
        object.__setattr__(self, "dataset", specs)
        rows, k = self.training.batch_size * self.grpo.group_size, self.grpo.steps_per_generation
        if self.objective == "grpo" and rows % k:
            divisors = [d for d in range(2, rows + 1) if rows % d == 0][:4]
            raise ConfigError(f"grpo.steps_per_generation {k} does not divide the generation batch of {rows} completions "
                              f"(training.batch_size {self.training.batch_size} x grpo.group_size {self.grpo.group_size})",
                              f"use a divisor of {rows} ({', '.join(map(str, divisors))}, ...) or change training.batch_size")
        if self.output_dir is None:
            name = Path(self.model.rstrip("/")).name or "model"
            object.__setattr__(self, "output_dir", str(Path("runs") / name))
        return self

    # ---------------------------------------------------------------------------------------
    @property
    def datasets(self) -> list[DatasetSpec]:
        return list(self.dataset)  # normalised to a list of specs by the validator

    @classmethod
    def from_dict(cls, data: dict, overrides: list[str] | None = None, source: str = "config") -> "Config":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}",
                              "start the file with e.g. `model: ...`")
        data = _deep_copy(data)
        for item in overrides or []:
            _apply_override(data, item)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _friendly(exc, source) from None
        except ConfigError as exc:  # raised inside a field validator (e.g. target_vram)
            raise ConfigError(f"{source}: {exc.message}", exc.hint) from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> "Config":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}", "check the path passed to --config")
        data = parse_yaml(path.read_text(encoding="utf-8"), str(path))
        if data is None:
            raise ConfigError(f"{path}: the config file is empty", "it needs at least `model:` and `dataset:`")
        return cls.from_dict(data, overrides, source=str(path))

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir)


# --------------------------------------------------------------------------------------------
# Errors and overrides


def parse_yaml(text: str, source: str):
    """`yaml.safe_load(text)` (no tags, no objects); a syntax error is one `ConfigError` line
    naming ``source:line:column`` (a config file, or "config" for one sent from the browser)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}{where}: YAML syntax error: {problem}",
                          "check indentation and quoting on that line") from None


def _deep_copy(d):
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


_SECTIONS: dict[str, type[BaseModel]] = {}


def _section_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Config
    for part in loc:
        if model is None or not isinstance(part, str):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return model
        model = _model_of(field.annotation)
    return model


def _model_of(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _friendly(exc: ValidationError, source: str) -> ConfigError:
    errors = exc.errors()
    # Prefer the most informative error: unknown keys first, then the rest in order.
    errors.sort(key=lambda e: 0 if e["type"] == "extra_forbidden" else 1)
    err = errors[0]
    loc = _clean_loc(err["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        parent = _section_at(tuple(loc[:-1]))
        name = str(loc[-1])
        known = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f"did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?" if close else (
            f"known keys here: {', '.join(known)}" if known else None)
        return ConfigError(f"{source}: unknown key '{key}'", hint)
    if err["type"] == "missing":
        return ConfigError(f"{source}: missing required key '{key}'", "see docs/config.md for every key")
    if err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), ConfigError):
        inner = err["ctx"]["error"]
        return ConfigError(f"{source}: {inner.message}", inner.hint)
    value = err.get("input")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if msg.startswith("Input should be "):
        msg = "expected " + msg[len("Input should be "):]
    return ConfigError(f"{source}: invalid value for '{key}': {value!r}: {msg}", "see docs/config.md for allowed values")


def _clean_loc(raw: tuple) -> list:
    """Drop pydantic's union-branch tags (`str`, `DatasetSpec`, `list[...]`) from an error location."""
    model: type[BaseModel] | None = Config
    loc: list = []
    for part in raw:
        if isinstance(part, int):
            loc.append(part)
            continue
        if model is not None and part in model.model_fields:
            loc.append(part)
            model = _model_of(model.model_fields[part].annotation)
            continue
        tagged = _SECTIONS.get(part)
        if tagged is not None:
            model = tagged
            continue
        if "[" in part or part in ("str", "bool", "int", "float", "none", "literal"):
            continue
        loc.append(part)
    return loc



def _apply_override(data: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key.sub=value", "e.g. training.max_steps=10")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override '{item}' has an empty key", "e.g. training.max_steps=10")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {} if nxt is None or nxt is True or nxt is False else nxt
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{item}': '{p}' is not a section", "only sections can take sub-keys")
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


_SECTIONS.update({m.__name__: m for m in (DatasetSpec, DataConfig, LoraConfig, OffloadConfig, GhostLogitConfig, KroneckerConfig,
                                          MatryoshkaConfig, OptimizationConfig, TrainingConfig, EvalConfig,
                                          DpoConfig, ContrastiveConfig, GrpoConfig, LoggingConfig, Config)})

# --------------------------------------------------------------------------------------------
# Documentation


def _type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("maximus.config.", "").replace("__main__.", "")
    text = re.sub(r"<class '([^']+)'>", r"\1", text)
    return text.replace("NoneType", "null")


def schema_markdown() -> str:
    """docs/config.md, generated from the schema so that every key is documented."""
    lines = ["# Configuration reference", "",
             "Generated from `src/maximus/config.py` by `python -m maximus.config > docs/config.md`;",
             "a test checks that this file is current. Sizes in bytes unless a unit is given.",
             "Override any key on the command line: `maximus-train --config x.yaml training.max_steps=10`.", ""]

    def section(model: type[BaseModel], prefix: str, title: str):
        lines.extend([f"## `{title}`" if prefix else "## Top level", "", (model.__doc__ or "").strip(), "",
                      "| key | type | default | meaning |", "|---|---|---|---|"])
        subs = []
        for name, field in model.model_fields.items():
            sub = _model_of(field.annotation)
            default = "required" if field.is_required() else (
                field.default_factory().__class__.__name__ if field.default_factory and sub else
                repr(field.default_factory() if field.default_factory else field.default))
            if sub is not None and field.default_factory:
                default = "(section)"
            full = f"{prefix}{name}"
            lines.append(f"| `{full}` | `{_type_name(field.annotation)}` | `{default}` | {field.description or ''} |")
            if sub is not None:
                subs.append((sub, f"{full}.", full))
        lines.append("")
        for sub, p, t in subs:
            section(sub, p, t)

    section(Config, "", "")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(schema_markdown(), end="")
