"""Predict the peak memory of one training step from a model's config.json alone.

No weights are loaded and nothing is allocated: an 8B or 70B Llama is estimated in
milliseconds. The model is analytic, for Llama / Mistral / Qwen2-style decoders (embedding,
attention q/k/v/o with grouped-query heads, gated MLP, RMSNorm, tied or untied head), and its
per-token activation coefficients were measured, not guessed: they are the bytes autograd saves
in one Transformers decoder layer (SDPA attention), counted with `saved_tensors_hooks` on real
layers of several shapes (see docs/planner.md). They hold on CUDA too, since the same Python
code runs there; what differs per device is the workspace (CUDA: dequantised 4-bit weights,
cuBLAS) and the optimizer's temporaries (foreach on CUDA, one tensor at a time on CPU).

Memory of a step = static part (weights, adapters, optimizer state) + the largest of three
phases:

* ``loss``: the start of backward: every layer's saved activations, the output head and the
  loss's working set (the naive loss holds several tokens x vocab tensors), plus gradients
  left from earlier micro-steps when accumulating;
* ``backward``: backward's walk down the layers: what the lower layers keep, the layer in its
  backward and the gradients formed so far (full fine-tuning: the head's and the upper layers';
  every gradient at the end);
* ``optimizer``: the optimizer step: all gradients plus the step's temporaries.

`Estimate.breakdown` splits the peak into weights, adapters, gradients, optimizer, activations,
loss and workspace, summing exactly to `peak_bytes`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Sequence

from maximus.errors import ConfigError
from maximus.config import DEFAULT_H2D_BYTES_PER_S
from maximus.memory.adapter_terms import AdapterTerms, adapter_terms
from maximus.memory.coefficients import DEVICE_FLOPS, DTYPE_BYTES, KRONECKER_COEF, LAYER_COEF  # noqa: F401
from maximus.memory.optimizer_state import (head_block_bytes, in_backward_gradient_bytes, optimizer_note,
                                            optimizer_settings, optimizer_state_bytes, optimizer_step_bytes,
                                            steps_outer_rows)
from maximus.memory.plan import RECOMPUTE_WORDS
from maximus.memory.run_spec import Candidate, KroneckerLayout, RunSpec, candidate_of, keyword_spec
from maximus.memory.shape import ModelShape, model_shape
from maximus.memory.streamed_weights import (STAGING_LAYERS, STREAMED_IN_FLIGHT, host_embedding_bytes,
                                             streamed_layer_bytes)

Method = Literal["full", "lora", "qlora"]
Attention = Literal["sdpa", "kronecker"]
Objective = Literal["sft", "dpo", "contrastive", "grpo"]
DpoReference = Literal["adapter_off", "precomputed", "none"]
LossMode = Literal["naive", "exact", "ghost"]
Checkpointing = Literal["none", "full", "selective"]

__all__ = ["Estimate", "Step", "estimate_peak", "estimate_step", "step_of", "DTYPE_BYTES", "DEVICE_FLOPS"]


# ------------------------------------------------------------------------------------------------
# Saved activations of one decoder layer, bytes per token (coefficients: maximus.memory.coefficients).



def lean_layer_bytes_per_token(shape: ModelShape, dtype_bytes: int, lora_r: int, n_targets: int,
                               n_mlp_targets: int, lora_bytes: int | None = None) -> tuple[float, float]:
    """(whole layer, its MLP): bytes a LoRA / QLoRA decoder layer with lean LoRA projections
    (`maximus.kernels.lean_lora`) keeps for backward, per token, with autocast or without.

    Measured with saved_tensors_hooks on Transformers 5 LlamaDecoderLayer (SDPA, CPU), varying one
    dimension at a time, bf16 and fp32 (docs/benchmarks/long_context.md): exact on every shape
    measured. Each projection keeps its input once in the compute dtype (q/k/v and gate/up share
    one) and its rank-r product; the MLP keeps its input, gate, up, act(gate) and the product.
    `lora_bytes`: bytes per element of the rank-r products, the adapters' compute dtype (default
    `dtype_bytes`: the trainer runs 16-bit steps under autocast; 4 for float32 adapters without it).
    """
    b = dtype_bytes
    rb = b if lora_bytes is None else lora_bytes
    h, i = shape.hidden_size, shape.intermediate_size
    whole = ((2 * b + 4) * h + 4 * b * i + 2 * b * (shape.q_dim + shape.kv_dim) + 4 * shape.num_heads
             + 2 * b * shape.head_dim + rb * lora_r * n_targets + 4)
    mlp = b * h + 4 * b * i + rb * lora_r * n_mlp_targets
    return float(whole), float(mlp)


def tiled_layer_bytes_per_token(whole: float, mlp: float, dtype_bytes: int, hidden_size: int,
                                tile_fraction: float) -> float:
    """Bytes per token a recomputed layer holds in backward when its MLP runs over tiles that are
    `tile_fraction` of the tokens: everything but the MLP for all tokens, the MLP's input for all
    tokens, the rest of the MLP for one tile."""
    tile_fraction = min(1.0, max(0.0, tile_fraction))
    return whole - (mlp - dtype_bytes * hidden_size) * (1.0 - tile_fraction)


def layer_activation_bytes_per_token(shape: ModelShape, method: str, dtype_bytes: int, lora_r: int,
                                     n_targets: int, policy: str = "none", lean_lora: bool = False,
                                     n_mlp_targets: int = 3) -> float:
    """Bytes one decoder layer keeps for backward, per token, under a checkpointing policy.

    ``off``: everything autograd saves; ``full``: the layer input only; ``selective``: the
    outputs of matmuls and attention (the cheap element-wise ops are recomputed). `lean_lora`:
    the adapters' projections are Maximus' lean ones (`lean_layer_bytes_per_token`), else PEFT's.
    """
    b = dtype_bytes
    if policy == "full":
        return shape.hidden_size * b
    if policy == "none" and lean_lora and method != "full":
        return lean_layer_bytes_per_token(shape, b, lora_r, n_targets, n_mlp_targets)[0]
    if policy == "selective":
        h, i = shape.hidden_size, shape.intermediate_size
        kept = h + shape.q_dim + 2 * shape.kv_dim + shape.q_dim + h + 2 * i + h
        return kept * b + 4 * shape.num_heads + (4 * lora_r * n_targets if method != "full" else 0)
    kind = "full" if method == "full" else "adapter"
    ch, ci, cq, ckv = LAYER_COEF[(kind, 4 if b >= 4 else 2)]
    per = (ch * shape.hidden_size + ci * shape.intermediate_size + cq * shape.q_dim + ckv * shape.kv_dim
           + 4 * shape.num_heads)
    if method != "full":
        per += 4 * lora_r * n_targets
    return float(per)


def eager_attention_bytes_per_token(shape: ModelShape, seq_len: int) -> float:
    """One float32 heads x tokens x tokens attention tensor, per token of one layer (0 when the
    model's attention keeps none)."""
    return 4.0 * shape.num_heads * seq_len if shape.attention_probs else 0.0


def masked_attention_bytes_per_token(shape: ModelShape, dtype_bytes: int, seq_len: int) -> float:
    """What one layer keeps beyond unmasked SDPA when its attention gets a ``[rows, 1, T, T]``
    document mask (many short packed documents: `maximus.attention.varlen`), per token: the mask,
    which SDPA turns into the compute dtype and saves, and keys and values repeated to every query
    head (Transformers passes SDPA no ``enable_gqa`` with a mask). Measured with
    saved_tensors_hooks on the embedded default's layers, float32 and bf16."""
    return float(dtype_bytes * (seq_len + 2 * (shape.q_dim - shape.kv_dim)))


def shape_extra_bytes_per_token(shape: ModelShape, dtype_bytes: int, seq_len: int, lora_experts: bool = True) -> float:
    """What a layer keeps beyond a Llama layer of the same (active) shape, per token: the router and
    routed copies of a mixture of experts, the attention tensors (`ModelShape.attention_probs`),
    Gemma's extra norms (their inputs)."""
    return (shape.routing_bytes_per_token(dtype_bytes, lora_experts) + shape.attention_probs * eager_attention_bytes_per_token(shape, seq_len)
            + shape.extra_norms * dtype_bytes * shape.hidden_size
            + shape.qk_extra[0] * dtype_bytes * (shape.q_dim + shape.kv_dim) + shape.qk_extra[1] * 4 * (shape.num_heads + shape.num_kv_heads))


# ------------------------------------------------------------------------------------------------
# The estimate


@dataclass
class Estimate:
    """Predicted peak memory of one training step, in bytes, and a throughput guess."""

    peak_bytes: int
    breakdown: dict[str, int]
    flops_per_token: float
    tokens_per_s_guess: float
    phase: str
    settings: dict[str, Any] = field(default_factory=dict)
    #: What the estimate bounds rather than models (a conservative figure is used), one line each.
    notes: list[str] = field(default_factory=list)
    #: Host memory the plan's offloading fills (checkpointed layer inputs, optimizer state and
    #: masters, streamed frozen weights); 0 when nothing is offloaded. Not part of ``peak_bytes``.
    host_bytes: int = 0
    #: Streamed frozen weights (`optimization.offload.params`): the file they fill (``disk``), the
    #: bytes copied to the device per micro-step (every streamed layer in forward and again in
    #: backward), and the tokens/s of the compute alone (`tokens_per_s_guess` is the slower of the
    #: compute and the copies at `DEFAULT_H2D_BYTES_PER_S`: they overlap, one layer ahead).
    disk_bytes: int = 0
    streamed_bytes_per_step: int = 0
    compute_tokens_per_s: float = 0.0

    @property
    def transfer_bound(self) -> bool:
        """Whether the copies of streamed weights, not the compute, set the step time."""
        return bool(self.streamed_bytes_per_step) and self.tokens_per_s_guess < self.compute_tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "host_bytes": self.host_bytes, "disk_bytes": self.disk_bytes,
                "streamed_bytes_per_step": self.streamed_bytes_per_step,
                "compute_tokens_per_s": self.compute_tokens_per_s, "breakdown": dict(self.breakdown),
                "phase": self.phase,
                "flops_per_token": self.flops_per_token, "tokens_per_s_guess": self.tokens_per_s_guess,
                "settings": dict(self.settings), "notes": list(self.notes)}


def default_loss_chunk(num_tokens: int, vocab_size: int, dtype_bytes: int, trainable_head: bool = False) -> int:
    """Tokens per chunk the exact loss uses when none is given (the loss module's default; a
    trainable head, as in full fine-tuning, has a larger floor)."""
    from maximus.losses.linear_cross_entropy import default_chunk_size

    return default_chunk_size(num_tokens, vocab_size, dtype_bytes, trainable_head)


# ------------------------------------------------------------------------------------------------
# Techniques beyond plain SFT on SDPA: each piece measured on the real code path.


def policy_names(checkpointing: Any) -> set[str]:
    """The recompute modes a checkpointing argument of `estimate_peak` names."""
    if isinstance(checkpointing, str):
        return {checkpointing}
    if isinstance(checkpointing, int):
        return {"full", "none"}
    return {"full" if f else "none" for f in checkpointing}


def _block_padding(seq_len: int, block: int) -> float:
    """The sketch pads every sequence to whole blocks: its per-token cost grows by this factor."""
    return math.ceil(seq_len / block) * block / seq_len


def kronecker_saved_bytes_per_token(shape: ModelShape, method: str, dtype_bytes: int, layout: KroneckerLayout,
                                    seq_len: int) -> float:
    """Extra bytes per token one layer saves for backward with the sketch instead of SDPA."""
    H, kv, D, Lb = shape.num_heads, shape.num_kv_heads, shape.head_dim, layout.block
    C, K = layout.columns, layout.slots
    terms = (H * C, kv * C * D / Lb, kv * C, kv * D, H * D, kv * K * D / Lb,
             kv * layout.select_blocks * layout.sub_slots * D / Lb)
    coef = KRONECKER_COEF[("full" if method == "full" else "adapter", 4 if dtype_bytes >= 4 else 2)]
    return max(0.0, sum(c * t for c, t in zip(coef, terms))) * _block_padding(seq_len, Lb)


def reference_forward_bytes_per_token(shape: ModelShape, dtype_bytes: int, layout: KroneckerLayout | None,
                                      seq_len: int) -> float:
    """Transients of one decoder layer's forward without gradients (the DPO reference pass):
    its input and output, q / k / v and the attention output, the gated MLP's three
    intermediates; with the sketch, its float32 logits and probabilities and gathered keys."""
    h, i = shape.hidden_size, shape.intermediate_size
    per = (2 * h + 2 * shape.q_dim + 2 * shape.kv_dim + 3 * i) * dtype_bytes
    if layout is not None:
        H, kv, D, Lb, C = shape.num_heads, shape.num_kv_heads, shape.head_dim, layout.block, layout.columns
        per += (8 * H * C + 2 * kv * C * D * dtype_bytes / Lb) * _block_padding(seq_len, Lb)
    return float(per)


def head_loss_bytes(shape: ModelShape, loss_mode: str, T: int, b: int, trainable_head: bool,
                    chunk_tokens: int | None, default_chunk: int, ghost_candidates: int = 1024,
                    with_grad: bool = True, head_block: int = 0) -> int:
    """Working set of the vocabulary loss over T tokens (bytes).

    ``naive``: Transformers' loss: float32 logits, log-softmax output and, in backward, its
    incoming and outgoing gradients; the 16-bit logits die after forward (the trainer keeps only
    the loss): 12 bytes per logit at the start of backward (10 during forward; 4 + b without
    gradients). ``exact``: one chunk of logits (float32 + 16-bit matmul output) plus the hidden
    state's gradient buffer and the shifted hidden copy. ``ghost``: see `ghost_loss_bytes`.
    ``head_block``: the exact loss's backward steps the head one block of vocabulary rows at a
    time, with this working set (`head_block_bytes`), instead of accumulating the whole V x H
    gradient.
    """
    V, h = shape.vocab_size, shape.hidden_size
    if loss_mode == "naive":
        loss = T * V * (12 if with_grad else 4 + b)
    elif loss_mode == "ghost":
        loss = ghost_loss_bytes(shape, T, b, trainable_head, chunk_tokens, ghost_candidates)
    else:
        chunk = max(1, min(chunk_tokens or default_chunk, T))
        loss = chunk * V * (4 + (b if b < 4 else 0)) + (2 * T * h * b if with_grad else T * h * b)
        if shape.logit_softcap and with_grad:  # the chunk's tanh, kept for the cap's backward
            loss += chunk * V * 4
        if trainable_head and with_grad and head_block:  # the hidden gradient, and one block or one chunk
            loss = max(loss, 2 * T * h * b + head_block)
        elif trainable_head and with_grad:  # float32 gradient accumulator over chunks
            loss += V * h * 4
    # Per-token scratch of the head (labels, log-sum-exp, losses): small but not zero.
    return int(loss + T * 24)


def ghost_loss_bytes(shape: ModelShape, T: int, b: int, trainable_head: bool, chunk_tokens: int | None,
                     candidates: int) -> int:
    """Working set of `maximus.losses.ghost_logit_loss` (bytes): per call the centred prefix of
    every vocabulary row (`prefix_dims` = 64 columns), the per-row best score and position, one
    candidate-scan block; per chunk of C tokens (the user's `loss_chunk_size`, else 256) the K =
    candidates + C gathered rows and C x K logits (16-bit matmul output, float32 logits and
    their gradient, 16-bit gradient); the hidden-state gradient over all T tokens."""
    from maximus.losses.ghost_logit import DEFAULT_GHOST_CHUNK_TOKENS, SCAN_BLOCK_BYTES

    V, h = shape.vocab_size, shape.hidden_size
    chunk = max(1, min(chunk_tokens or DEFAULT_GHOST_CHUNK_TOKENS, T))
    K = min(V, candidates + chunk)
    # The candidate scan runs over blocks of vocabulary rows; the next block's scores exist
    # before the previous block's are freed.
    block_rows = max(1, SCAN_BLOCK_BYTES // (chunk * b))
    scan = min(V, block_rows) * chunk * b * (2 if V > block_rows else 1)
    # per call: centred prefix rows, best score (16-bit and float32), position, the scan;
    # per chunk: gathered rows, C x K logits and gradients; the hidden-state gradient
    loss = 2 * T * h * b + V * (64 * b + b + 4 + 8) + scan + K * h * b + chunk * (K + 1) * (8 + 2 * b)
    # The vocabulary statistics pass before it: two float32 blocks of weight rows (measured).
    loss = max(loss, 2 * min(V * h * 4, SCAN_BLOCK_BYTES))
    if trainable_head:
        loss += V * h * 4
    return int(loss)


def matryoshka_loss_bytes(shape: ModelShape, main_loss: int, loss_mode: str, T: int, b: int, trainable_head: bool,
                          dims: Sequence[int], token_fraction: float, chunk_tokens: int | None = None) -> int:
    """The loss working set with the SFT Matryoshka auxiliary pass (bytes).

    With every token (fraction 1) and the exact loss, main and prefix losses share one nested
    chunked pass whose chunk holds one more stored C x V gradient per prefix. Otherwise the prefix
    levels run after the main loss, over the sampled tokens gathered together (`sampled_tokens`:
    ceil(fraction x 64) of every 64), while the main loss's hidden-state gradient is still held.
    A chunk the plan sets (`loss_chunk_size`) is the nested pass's chunk too (the trainer passes it)."""
    from maximus.losses.matryoshka import SAMPLE_GROUP_TOKENS, default_nested_chunk_size

    V, h = shape.vocab_size, shape.hidden_size
    levels = len([d for d in dims if 0 < d < h])
    if not levels:
        return main_loss
    per_token = lambda n: V * (b + max(b, 4) + (n - 1) * b)  # noqa: E731  (default_nested_chunk_size's)
    if token_fraction >= 1.0 and loss_mode == "exact":
        chunk = min(T, chunk_tokens or default_nested_chunk_size(T, V, b, levels + 1, trainable_head))
        return int(chunk * per_token(levels + 1) + 2 * T * h * b + (V * h * 4 if trainable_head else 0) + T * 24)
    sampled = min(T, math.ceil(T / SAMPLE_GROUP_TOKENS) * math.ceil(token_fraction * SAMPLE_GROUP_TOKENS))
    chunk = min(sampled, chunk_tokens or default_nested_chunk_size(sampled, V, b, levels, trainable_head))
    aux = chunk * per_token(levels) + sampled * h * (2 * b + 4) + (V * h * 4 if trainable_head else 0)
    return int(max(main_loss, 2 * T * h * b + T * 24 + aux))


def completion_loss_bytes(step, trainable_head: bool) -> tuple[int, int]:
    """(working set of GRPO's log-prob pass over one micro-batch, the chunk it uses when none is
    given) for an `estimate_peak` step step with `objective="grpo"` and the exact head.

    `maximus.losses.token_outputs.label_log_probs` gathers the labelled rows, L =
    `micro_batch x completion_tokens` (not every prompt + completion position), and runs the head
    over them in chunks: one chunk x V float32 buffer (plus the 16-bit matmul output), one row
    block of probabilities (`ROW_BLOCKS_PER_CHUNK`: 1/8 of the chunk), the gathered rows and the
    log-prob gradient basis (L x hidden each); a trainable head adds its float32 gradient
    accumulator and the rows' gradient in backward. Measured with the CPU meter (V = 32,000,
    hidden 256, fp32, forward and backward): 8.92 MiB for 4 rows of 68 tokens with 16 labelled
    (this formula: 8.92), 35.66 for 4 x 128 with 64 (35.67), 74.36 for 8 x 300 with 256 (chunk
    512: 74.37)."""
    from maximus.losses.token_outputs import ROW_BLOCKS_PER_CHUNK

    shape, b = step.shape, step.b
    V, h = shape.vocab_size, shape.hidden_size
    labelled = step.cand.micro_batch * min(step.completion_tokens or step.seq_len, step.seq_len)
    default_chunk = default_loss_chunk(labelled, V, b, trainable_head=trainable_head)
    chunk = max(1, min(step.cand.loss_chunk_tokens or default_chunk, labelled))
    block = -(-chunk // ROW_BLOCKS_PER_CHUNK)
    loss = chunk * V * (4 + (b if b < 4 else 0)) + block * V * 4 + 2 * labelled * h * b
    if trainable_head:
        loss += V * h * 4 + labelled * h * b
    # Per-position scratch (labels, the scattered log-probs): small but not zero.
    return int(loss + step.T * 24), default_chunk


def contrastive_loss_bytes(shape: ModelShape, T: int, b: int) -> int:
    """The contrastive loss never touches the vocabulary: pooled float32 vectors of every row, an
    N x N similarity matrix, and the pooled gradient spread back over T tokens x hidden."""
    return int(T * shape.hidden_size * (b + 4) + T * 24)


def _streamed_weight_bytes(shape: ModelShape, method: str, b: int, device_type: str, notes: list[str]) -> int:
    """Device bytes that `optimization.offload.params` moves off the device: every decoder layer's
    frozen weights (QLoRA: 4-bit data with its quantization state, and the norms; LoRA: the plain
    weights) but the three in flight (the running layer, the prefetched one, the one being
    released in backward). Trainable weights never stream."""
    if device_type == "cpu":
        notes.append("offload.params on a CPU: host and device memory are the same, nothing is saved")
        return 0
    if method == "full":
        notes.append("offload.params streams frozen weights only: full fine-tuning has none")
        return 0
    return max(0, shape.num_layers - STREAMED_IN_FLIGHT) * streamed_layer_bytes(shape, method, b)


def _host_table_bytes(step: Step) -> int:
    """Bytes of the input embedding's table that streaming keeps in host memory instead of on the
    device (`maximus.memory.host_embedding`: a batch's rows are copied in, a transient at the start
    of the forward, no peak); 0 on a CPU (one memory), unsharded runs only."""
    if not step.tech.streams_params or step.device == "cpu" or step.shard > 1:
        return 0
    from maximus.memory.adapter_terms import EMBEDDING_NAMES

    trained = any(str(name).rsplit(".", 1)[-1] in EMBEDDING_NAMES for name in step.lora.modules_to_save or ())
    return host_embedding_bytes(step.shape, step.method, step.b, trained=trained)


# ------------------------------------------------------------------------------------------------
# One step, described once


@dataclass(frozen=True)
class Step:
    """One training step as the terms read it: the run's `RunSpec` and the planner's `Candidate`,
    validated, with what follows from both spelled out once (`step_of`): one recompute mode per
    layer, the ranks the weights are split over, the targeted linears."""

    spec: RunSpec
    cand: Candidate
    policy: tuple[str, ...]
    #: Ranks the weights are split over (1: unsharded, DDP or one device).
    shard: int
    #: The adapters' targeted linears (none for full fine-tuning).
    targets: tuple[str, ...]

    shape = property(lambda self: self.spec.shape)
    lora = property(lambda self: self.spec.lora, doc="`LoraSettings`")
    opt = property(lambda self: self.spec.optimizer, doc="`OptimizerSettings`")
    tech = property(lambda self: self.spec.techniques, doc="`Techniques`")
    kernels = property(lambda self: self.spec.kernels, doc="`KernelChoices`")
    device = property(lambda self: self.spec.device, doc="The device type.")
    method = property(lambda self: self.cand.method)
    seq_len = property(lambda self: self.cand.seq_len, doc="Tokens per row.")
    layout = property(lambda self: self.spec.techniques.kronecker, doc="The Kronecker sketch's layout, or None.")

    @property
    def b(self) -> int:
        """Bytes per element of the compute dtype."""
        return self.spec.dtype_bytes

    @property
    def adapter(self) -> bool:
        return self.method != "full"

    @property
    def T(self) -> int:
        """Tokens of one micro-batch (DPO and contrastive run 2 rows per example)."""
        return self.cand.micro_batch * self.seq_len * self.tech.rows_per_example

    @property
    def master(self) -> bool:
        """16-bit full fine-tuning keeps float32 master weights and computes under autocast."""
        return self.method == "full" and self.b < 4 and self.opt.master_weights != "bf16"

    @property
    def weight_bytes(self) -> int:
        return 4 if self.master else self.b

    @property
    def lean(self) -> bool:
        """Lean LoRA projections in use (an adapter and `KernelChoices.lean_lora`)."""
        return self.kernels.lean_lora and self.adapter

    @property
    def masked_attention(self) -> bool:
        """Attention runs as one SDPA call per row with a document mask (`masked_attention_bytes_per_token`)."""
        return self.cand.masked_attention and self.tech.attention == "sdpa"

    @property
    def completion_tokens(self) -> int | None:
        """GRPO: the completion tokens of a row (None for the other objectives)."""
        return self.tech.completion_tokens if self.tech.objective == "grpo" else None

    @property
    def checkpointing(self) -> Any:
        """The candidate's checkpointing as given (recorded in the settings)."""
        c = self.cand.checkpointing
        return c if isinstance(c, (str, int)) else list(c)


def _policy(checkpointing: Any, num_layers: int) -> tuple[str, ...]:
    """One recompute mode (off | full | selective) per layer from a candidate's checkpointing."""
    L = num_layers
    if isinstance(checkpointing, str):
        mode = RECOMPUTE_WORDS.get(checkpointing)
        if mode is None:
            raise ConfigError(f"unknown checkpointing {checkpointing!r}", "use off, full or selective")
        return (mode,) * L
    if isinstance(checkpointing, int):
        k = max(0, min(L, checkpointing))
        return ("full",) * k + ("none",) * (L - k)
    flags = list(checkpointing)
    if len(flags) != L:
        raise ConfigError(f"per-layer checkpointing needs {L} entries, got {len(flags)}",
                          "one recompute mode (none, selective, full) per layer")
    # Per layer: a recompute mode (`Plan.recompute`: none | selective | full) or a boolean (True = full).
    modes = {True: "full", False: "none", **RECOMPUTE_WORDS}
    if any(f not in modes for f in flags):
        raise ConfigError(f"unknown per-layer recompute mode in {flags}", "use none, selective or full")
    return tuple(modes[f] for f in flags)


def _check_step(spec: RunSpec, cand: Candidate) -> None:
    """The estimate's ConfigErrors for a method, loss mode, size or technique it does not know."""
    tech = spec.techniques
    if cand.method not in ("full", "lora", "qlora"):
        raise ConfigError(f"method must be full, lora or qlora for an estimate, got {cand.method!r}",
                          "the planner resolves method: auto")
    if tech.loss_mode not in ("naive", "exact", "ghost"):
        raise ConfigError(f"unknown loss mode {tech.loss_mode!r}", "use exact, naive or ghost")
    if cand.micro_batch < 1 or cand.seq_len < 1 or spec.world_size < 1:
        raise ConfigError("micro_batch, seq_len and world_size must be positive", "check training.* keys")
    if tech.attention not in ("sdpa", "kronecker"):
        raise ConfigError(f"unknown attention {tech.attention!r}", "use sdpa or kronecker")
    if tech.objective not in ("sft", "dpo", "contrastive", "grpo"):
        raise ConfigError(f"unknown objective {tech.objective!r}", "use sft, dpo, contrastive or grpo")
    if tech.dpo_reference not in ("adapter_off", "precomputed", "none"):
        raise ConfigError(f"unknown dpo reference {tech.dpo_reference!r}", "use adapter_off, precomputed or none")
    if tech.loss_mode == "ghost" and tech.objective != "sft":
        raise ConfigError(f"optimization.use_ghost_logit does not apply to objective {tech.objective}",
                          "the Ghost Logit loss replaces the SFT vocabulary softmax; set use_ghost_logit: false")
    if not 0.0 < tech.matryoshka_token_fraction <= 1.0:
        raise ConfigError(f"matryoshka token_fraction must be in (0, 1], got {tech.matryoshka_token_fraction}", "e.g. 0.0625")


def step_of(spec: RunSpec, cand: Candidate) -> Step:
    """The `Step` of `cand` in the run `spec`; raises the estimate's ConfigErrors."""
    _check_step(spec, cand)
    adapter = cand.method != "full"
    sharded = spec.world_size > 1 if cand.sharded is None else cand.sharded
    return Step(spec=spec, cand=cand, policy=_policy(cand.checkpointing, spec.shape.num_layers),
                shard=spec.world_size if (sharded and spec.world_size > 1 and cand.method != "qlora") else 1,
                targets=spec.lora.targets(spec.shape) if adapter else ())



# ------------------------------------------------------------------------------------------------
# The estimate's parts: static + activations + backward walk + loss + workspace


@dataclass(frozen=True)
class StaticTerms:
    """Bytes that live through the whole step (per rank), and what the phases need of them."""

    weights_dev: int
    adapters: int
    opt_dev: int
    grads: int
    step_temporaries: int
    host_opt: int
    streamed: int
    trainable: int
    trainable_head: bool
    extras: AdapterTerms
    notes: list[str]
    vision: Any = None  # `maximus.memory.vision_terms.VisionTerms` of a VLM


def _weight_bytes(step: Step, notes: list[str]) -> tuple[int, int, int]:
    """(device bytes of the weights, bytes streamed from the host, tied-embedding parameters kept whole)."""
    shape, b, wb, shard = step.shape, step.b, step.weight_bytes, step.shard
    L = shape.num_layers
    non_linear = L * shape.layer_other_params + shape.embedding_params + shape.head_params + shape.hidden_size
    linear = L * shape.layer_linear_params
    if step.method == "qlora":
        # NF4: 4 bits per weight; blocks of 64 with a uint8 absmax, itself quantised in blocks of
        # 256 with a float32 absmax (double quantisation): 0.127 extra bits per weight.
        weights = int(linear * (0.5 + 1 / 64 + 4 / (64 * 256))) + non_linear * b
    else:
        weights = (linear + non_linear) * wb
    # A head tied to the embedding stays whole on every rank (maximus.train.distributed).
    whole = shape.embedding_params if (shard > 1 and shape.tied_embeddings) else 0
    weights_dev = (weights - whole * wb) // shard + whole * wb
    if shard > 1:
        # Gathered at once: two decoder layers (the running one, the prefetched one), the root
        # unit (embedding, final norm) for the whole step, the head while the loss runs.
        weights_dev += (2 * (shape.layer_linear_params + shape.layer_other_params)
                        + (shape.embedding_params + shape.head_params if not whole else 0)) * wb
    streamed = _streamed_weight_bytes(shape, step.method, b, step.device, notes) if step.tech.streams_params else 0
    return weights_dev - streamed - _host_table_bytes(step) + qat_copy_bytes(step), streamed, whole


def qat_copy_bytes(step: Step) -> int:
    """`training.qat`'s cache (`maximus.qat.install`): one rounded copy of every quantized matrix,
    kept between weight updates. GGUF targets round the decoder's linears, the embedding and an
    untied head; int4 the linears only. A copy is in the weight's dtype (float32 for QLoRA's
    dequantized base)."""
    if step.tech.qat == "off":
        return 0
    shape = step.shape
    matrices = shape.num_layers * shape.layer_linear_params
    if step.tech.qat != "int4":
        matrices += shape.embedding_params + shape.head_params
    return matrices * (4 if step.method == "qlora" else step.weight_bytes) // step.shard


def _mlp_targets(targets: Sequence[str]) -> int:
    """How many of the targeted linears are MLP projections (which reach a mixture's experts)."""
    return sum(1 for t in targets if t in ("gate_proj", "up_proj", "down_proj"))


def _trainable_terms(step: Step, notes: list[str]) -> tuple[int, int, AdapterTerms]:
    """(device bytes of the adapters, trainable parameters, `adapter_terms`): the LoRA matrices,
    the Kronecker sketch, `lora.modules_to_save` copies and DoRA magnitudes (no tower)."""
    shape, shard, adapter = step.shape, step.shard, step.adapter
    L, lin, r = shape.num_layers, shape.linear_shapes(), step.lora.r
    n_adapter = L * sum(r * (lin[t][0] + lin[t][1]) for t in step.targets)
    dense_mlp = _mlp_targets(step.targets)
    if dense_mlp or step.lora.experts:  # lora.experts: every expert's adapter, whatever target_modules says
        n_adapter += L * shape.expert_lora_params(r, experts=step.lora.experts, dense_targets=dense_mlp)
    adapters = 4 * n_adapter // shard  # PEFT keeps adapters in float32 (autocast_adapter_dtype)
    trainable = n_adapter if adapter else shape.num_params
    if step.layout is not None:
        # The sketch's own parameters: float32, trainable; PEFT (modules_to_save) keeps a frozen
        # original beside the trained copy.
        n_sketch = L * step.layout.params(shape.head_dim)
        adapters += 4 * n_sketch * (2 if adapter else 1)
        trainable += n_sketch if adapter else 0
    # lora.modules_to_save copies, DoRA magnitudes (float32, trainable), and what they and dropout save.
    extras = (adapter_terms(shape, step.targets, step.b, modules_to_save=step.lora.modules_to_save, use_dora=step.lora.use_dora,
                            lora_dropout=step.lora.dropout) if adapter else AdapterTerms())
    notes.extend(extras.notes)
    adapters += 4 * extras.trainable_params // shard
    trainable += extras.trainable_params
    return adapters, trainable, extras


def _vision_static(step: Step):
    """The tower and the projector of a VLM (`maximus.memory.vision_terms.VisionTerms`); None for text."""
    if step.tech.vision is None:
        return None
    from maximus.memory.vision_terms import vision_terms

    return vision_terms(step.tech.vision, rows=step.T // step.seq_len, seq_len=step.seq_len, text=step.shape,
                        method=step.method, dtype_bytes=step.b, lora_r=step.lora.r, checkpointing=step.checkpointing,
                        grad_accum=_backwards_per_step(step))


def _optimizer_terms(step: Step, trainable: int, whole: int, notes: list[str]) -> tuple[int, int, int, int]:
    """(gradients, optimizer state on the device, the step's temporaries, host optimizer bytes), per rank."""
    shape, shard, adapter = step.shape, step.shard, step.adapter
    p_bytes = 4 if adapter else step.weight_bytes
    opt = dict(full=not adapter, trainable=trainable, p_bytes=p_bytes)
    # Per trainable parameter, on average (maximus.memory.optimizer_state: one row per optimizer).
    state_bytes = optimizer_state_bytes(shape, step.opt.name, rank=step.opt.rank,
                                        embedding_optimizer=step.opt.embedding, **opt) / max(1, trainable)
    replicated = 0 if adapter else whole  # a trainable tied embedding: whole gradient and moments
    per_rank_trainable = (trainable - replicated) / shard + replicated
    grads = int(per_rank_trainable * p_bytes)
    if step.opt.in_backward:
        grads = in_backward_gradient_bytes(shape, rows=_outer_rows(step), **opt)
    step_temporaries = (optimizer_step_bytes(shape, step.opt.name, device=step.device, rank=step.opt.rank,
                                             master_weights=step.opt.master_weights, rows=_outer_rows(step),
                                             in_backward=step.opt.in_backward,
                                             embedding_optimizer=step.opt.embedding, **opt) // shard
                        if not step.cand.offload_optimizer else 0)
    note = optimizer_note(step.opt.name, step.opt.rank, step.opt.in_backward, step.opt.master_weights,
                          step.opt.embedding)
    if note:
        notes.append(note)
    states = int(per_rank_trainable * state_bytes)
    # `OffloadedAdamW` keeps, per trainable parameter, a float32 master, a float32 gradient buffer
    # and the moments in host memory.
    host_opt = int(per_rank_trainable * 8) + states if step.cand.offload_optimizer else 0
    return grads, 0 if step.cand.offload_optimizer else states, step_temporaries, host_opt


def _static_terms(step: Step) -> StaticTerms:
    """Weights, adapters (with the sketch and `adapter_terms`), gradients and optimizer state."""
    notes: list[str] = []
    weights_dev, streamed, whole = _weight_bytes(step, notes)
    adapters, trainable, extras = _trainable_terms(step, notes)
    vision = _vision_static(step)
    if vision is not None:
        weights_dev += vision.weights
        adapters += vision.adapters if step.adapter else 0
        trainable += vision.trainable
    grads, opt_dev, step_temporaries, host_opt = _optimizer_terms(step, trainable, whole, notes)
    return StaticTerms(weights_dev=weights_dev, adapters=adapters, opt_dev=opt_dev, grads=grads,
                       step_temporaries=step_temporaries, host_opt=host_opt, streamed=streamed, trainable=trainable,
                       trainable_head=not step.adapter or extras.trains_head, extras=extras, notes=notes, vision=vision)


@dataclass(frozen=True)
class LayerTerms:
    """Bytes per token the decoder layers keep for backward (`_layer_terms`)."""

    per_layer: tuple[float, ...]  # what each layer keeps under its policy (0: offloaded)
    stored: float  # all layers, plus an offloaded layer in flight
    acts: int  # bytes at the start of backward: every layer, the head's input, the extras
    host_acts: int
    per_off: float
    per_recomputed: float  # a fully recomputed layer during its backward
    grad_work: float  # the gradients flowing through a layer in backward
    norm_moment: float  # a recomputed layer at its post-attention norm's backward
    tile_fraction: float
    notes: list[str]


def _layer_saved_bytes(step: Step, extras: AdapterTerms) -> tuple[float, float, float, float]:
    """(off, full, selective, attention work): bytes per token one layer keeps per recompute mode."""
    n_t, n_mlp_t = len(step.targets), _mlp_targets(step.targets)
    act = step.shape.active_shape()  # mixture of experts: each token's activations go through top-k experts
    per_off = layer_activation_bytes_per_token(act, step.method, step.b, step.lora.r, n_t, "none", step.lean, n_mlp_t)
    per_full = layer_activation_bytes_per_token(act, step.method, step.b, step.lora.r, n_t, "full")
    per_sel = layer_activation_bytes_per_token(act, step.method, step.b, step.lora.r, n_t, "selective")
    for term, selective_too in _layer_saved_extras(step, extras):
        per_off += term
        if selective_too:
            per_sel += term
    return per_off, per_full, per_sel, _sketch_backward_bytes(step)


def _layer_saved_extras(step: Step, extras: AdapterTerms):
    """What a layer not fully recomputed keeps beyond its projections and attention, in order:
    (bytes per token, whether a selectively recomputed layer keeps it too)."""
    shape, b, r, T, lin, targets = step.shape, step.b, step.lora.r, step.T, step.shape.linear_shapes(), step.targets
    expert_adapters = step.adapter and step.lora.experts and shape.num_experts > 0  # whatever the MLP targets
    yield shape_extra_bytes_per_token(shape, b, step.seq_len, expert_adapters) + extras.layer_bytes_per_token, True
    if step.masked_attention:  # the mask and the repeated keys / values, saved by SDPA
        yield masked_attention_bytes_per_token(shape, b, step.seq_len), True
    yield shape.gate_bytes_per_token(b, step.kernels.grouped_experts), False
    if expert_adapters and not (step.kernels.grouped_experts):
        # PEFT's merged expert weights, kept per layer until its backward (a per-layer constant)
        yield shape.merged_expert_bytes(b) / T, False
    if step.kernels.lean_norm and b < 4:  # the lean norm keeps its input, not Transformers' float32 copy (16-bit steps)
        yield -4 * shape.hidden_size, False
    if step.adapter and b < 4 and not step.lean:
        # Autocast caches a 16-bit copy of each float32 adapter weight per forward, saved for
        # backward: a per-layer constant (measured; it dominates short sequences).
        yield 2 * sum(r * (lin[t][0] + lin[t][1]) for t in targets) / T, True
    if step.master:  # autocast's 16-bit copies of the float32 linear weights, saved for backward
        yield 2 * shape.layer_linear_params / T, True
    if step.layout is not None:
        # Selective recompute keeps the attention's outputs; for the sketch that is bounded by
        # everything it saves (its probabilities are the attention's output here).
        yield kronecker_saved_bytes_per_token(shape, step.method, b, step.layout, step.seq_len), True


def _sketch_backward_bytes(step: Step) -> float:
    """What the Kronecker sketch's backward adds per token to a layer's backward."""
    if step.layout is None or step.b >= 4:
        return 0.0
    # In backward each gradient of the sketch (probabilities, logits, gathered keys) mostly
    # replaces a saved tensor that its node frees as it runs: nothing extra in float32; in
    # 16-bit the casts' gradients add ~3 bytes per head and softmax column (measured with
    # the meter on real trainer steps, full recompute, 2 x 1,024 tokens).
    return 3.0 * step.shape.num_heads * step.layout.columns * _block_padding(step.seq_len, step.layout.block)


def _kept_by_policy(step: Step, kept: dict[str, float]) -> tuple[tuple[float, ...], float, int]:
    """(what each layer keeps under its policy, 0 when offloaded; all layers plus an offloaded
    layer in flight; bytes on the host), from the bytes per token `kept` per recompute mode."""
    policy, offload = step.policy, step.cand.offload_activations
    per_layer = tuple(0.0 if (p == "full" and offload) else kept[p] for p in policy)  # offloaded: on host
    host_acts = int(step.T * kept["full"] * sum(1 for p in policy if p == "full")) if offload else 0
    in_flight = 2 * kept["full"] if (offload and any(p != "none" for p in policy)) else 0.0  # prefetch one layer ahead
    return per_layer, sum(per_layer) + in_flight, host_acts


def _tile_fraction(step: Step) -> float:
    """Tiling: the share of the tokens a fully recomputed layer's MLP holds at once (1: untiled)."""
    if step.cand.tile_tokens is not None and "full" in step.policy:
        return min(1.0, max(1, int(step.cand.tile_tokens)) / step.T)
    return 1.0


def _mlp_saved_bytes(step: Step) -> float:
    """Bytes per token the MLP of a layer keeps for backward (what tiling divides)."""
    shape, b, h = step.shape, step.b, step.shape.hidden_size
    n_mlp_t = _mlp_targets(step.targets)
    if step.lean:
        return lean_layer_bytes_per_token(shape, b, step.lora.r, len(step.targets), n_mlp_t)[1]
    # PEFT: gate and up each keep a float32 copy of the input (adapters) or share it (full)
    return 4 * b * shape.active_shape().intermediate_size + (8 * h + 12 * step.lora.r * n_mlp_t if step.adapter else b * h)


def _norm_work_bytes(step: Step) -> int:
    """A later moment of a layer's backward: its post-attention RMSNorm, after the MLP's tensors
    are gone. Transformers' norm computes in float32: five float32 hidden-size temporaries in its
    backward, plus its float32 copy of the input (16-bit steps) and the incoming and residual
    gradients (measured at the peak with the CPU meter, reference shape, bf16, 16k-32k tokens).
    Untiled, the MLP moment is larger; tiled, this one sets the peak unless the norm is lean
    (`maximus.kernels.lean_norm`, or the Triton one): float32 work for one block of rows, the input kept once."""
    b, h = step.b, step.shape.hidden_size
    norm_copy = 4 * h if b < 4 else 0
    return 2 * b * h if step.kernels.lean_norm else 5 * 4 * h + norm_copy + 2 * b * h


def _layer_terms(step: Step, extras: AdapterTerms) -> LayerTerms:
    """What the layers keep for backward under the policy (offloaded, tiled), and a layer's backward."""
    shape, b, T = step.shape, step.b, step.T
    h, wb, notes = shape.hidden_size, step.weight_bytes, []
    per_off, per_full, per_sel, attn_work = _layer_saved_bytes(step, extras)
    if step.layout is not None and "selective" in policy_names(step.checkpointing):
        notes.append("selective recompute with Kronecker Sketching: bounded by everything the sketch saves")
    per_layer, stored, host_acts = _kept_by_policy(step, {"none": per_off, "full": per_full, "selective": per_sel})
    tile_fraction = _tile_fraction(step)
    mlp_part = _mlp_saved_bytes(step)
    # Attention masks shared by the layers of a kind live through forward and backward; an eager
    # attention's only when a checkpointed layer holds them for its recompute.
    masks = shape.sink_masks if not shape.attention_probs or any(m != "none" for m in step.policy) else 0
    shared_masks = masks * (b + 1) * (step.seq_len + 1)
    # Backward of one layer also holds the gradients flowing through it (hidden and MLP
    # intermediate, partly in float32): ~2*b*(h + i) bytes per token, measured, plus the
    # incoming hidden-state gradient; tiled, the intermediate part exists for one tile.
    grad_work = (shared_masks + 2 * b * (h + shape.active_shape().intermediate_size * tile_fraction) + 2 * h * b + attn_work
                 + shape.attention_backward_probs * eager_attention_bytes_per_token(shape, step.seq_len))
    # Embedding output, final norm (float32 copy) and the head's input; a float32 master model
    # keeps a float32 residual stream; the lean final norm keeps its input, not a float32 copy.
    norm_copy = 4 * h if b < 4 else 0
    head_acts = ((2 * wb + 4) * h + extras.stream_bytes_per_token - (norm_copy if step.kernels.lean_norm else 0)
                 + shared_masks)
    return LayerTerms(per_layer=per_layer, stored=stored, acts=int(T * (stored + head_acts)), host_acts=host_acts,
                      per_off=per_off, per_recomputed=tiled_layer_bytes_per_token(per_off, mlp_part, b, h, tile_fraction),
                      grad_work=grad_work, norm_moment=per_off - mlp_part + _norm_work_bytes(step),
                      tile_fraction=tile_fraction, notes=notes)


def _backward_walk(step: Step, layers: LayerTerms) -> list[float]:
    """Bytes per token at each point of backward's walk, from the last layer down: at layer l, the
    layers below still hold what they kept, and a recomputed layer holds its full set of saved
    tensors again (one MLP tile of it when tiled) plus the gradients through it."""
    below, points = layers.stored, []
    for l in range(len(step.policy) - 1, -1, -1):
        mode = step.policy[l]
        below -= layers.per_layer[l]
        here = layers.per_recomputed if mode == "full" else layers.per_off if mode != "none" else layers.per_layer[l]
        points.append(max(below + here + layers.grad_work, below + layers.norm_moment if mode == "full" else 0.0))
    return points


def _backward_peak(step: Step, static: StaticTerms, walk: list[int]) -> tuple[int, int]:
    """(gradients, activations) at backward's worst moment, for the walk's bytes `walk` (from the
    last layer down). Full fine-tuning, one micro-step, gradients in .grad: a layer's weight
    gradients appear at its own backward, so at layer l only the head's (formed with the loss) and
    those of the layers from l up exist, and the embedding's is formed last, when the layers'
    activations are gone; otherwise every gradient is counted beside the walk's worst point."""
    worst = max(walk, default=0)
    if (step.adapter or step.opt.in_backward or _backwards_per_step(step) > 1 or step.shard > 1
            or static.vision is not None or not walk):
        return static.grads, worst
    shape = step.shape
    per_param = static.grads / max(1, static.trainable)
    per_layer = (shape.layer_linear_params + shape.layer_other_params) * per_param
    head = ((shape.head_params or shape.embedding_params) + shape.hidden_size) * per_param
    at = max(range(len(walk)), key=lambda i: walk[i] + per_layer * (i + 1))
    grads_then = int(head + per_layer * (at + 1))
    # The end of backward: every gradient, the layers' tensors gone. A tied embedding's lookup
    # gradient meets the head's, which autograd held through the walk, and the two are summed out
    # of place: three vocabulary-sized buffers at once (measured: 776 MiB against 780 predicted,
    # the reference shape tied, 2 layers, fp32, CPU).
    end = static.grads + (2 * int(shape.embedding_params * per_param) if shape.tied_embeddings else 0)
    if walk[at] + grads_then <= end:
        return end, 0
    return grads_then, walk[at]


def _loss_terms(step: Step, trainable_head: bool) -> tuple[int, int]:
    """(working set of the loss, the chunk the loss uses when none is given)."""
    shape, T, b, V, h = step.shape, step.T, step.b, step.shape.vocab_size, step.shape.hidden_size
    # A trainable head (full fine-tuning, a saved lm_head) has a larger chunk floor.
    default_chunk = default_loss_chunk(T, V, b, trainable_head=trainable_head)
    if step.tech.objective == "contrastive":
        return contrastive_loss_bytes(shape, T, b), default_chunk
    if step.tech.objective == "grpo" and step.tech.loss_mode == "exact":  # the head over the completion tokens only
        return completion_loss_bytes(step, trainable_head)
    head_block = (head_block_bytes(shape, T, b, step.opt.master_weights)
                  if _outer_rows(step) and step.tech.loss_mode == "exact" else 0)
    loss = head_loss_bytes(shape, step.tech.loss_mode, T, b, trainable_head=trainable_head,
                           chunk_tokens=step.cand.loss_chunk_tokens, default_chunk=default_chunk,
                           ghost_candidates=step.tech.ghost_candidates, head_block=head_block)
    if step.tech.matryoshka_dims and step.tech.objective == "sft":
        loss = matryoshka_loss_bytes(shape, loss, step.tech.loss_mode, T, b, trainable_head=trainable_head,
                                     dims=step.tech.matryoshka_dims, token_fraction=step.tech.matryoshka_token_fraction,
                                     chunk_tokens=step.cand.loss_chunk_tokens)
    if step.master:  # the loss casts the float32 head to the 16-bit matmul dtype once per call
        loss += V * h * 2
    return loss, default_chunk


def _outer_rows(step: Step) -> bool:
    """The embedding and head updated row block by row block inside the backward (`steps_outer_rows`)."""
    return steps_outer_rows(step.shape, step.opt.name, full=step.method == "full", in_backward=step.opt.in_backward,
                            master_weights=step.opt.master_weights, embedding_optimizer=step.opt.embedding)


def _workspace_terms(step: Step) -> int:
    """Scratch the step needs whatever the phase: dequantised 4-bit weights, CUDA's workspaces."""
    workspace = 0
    if step.method == "qlora":
        # bitsandbytes dequantises a whole 4-bit weight to the compute dtype for each matmul.
        workspace += max(a * c for a, c in step.shape.linear_shapes().values()) * step.b
    if step.device == "cuda":
        workspace += 64 * 2**20  # cuBLAS / attention workspaces and allocator slack
    return workspace


def _backwards_per_step(step: Step) -> int:
    """Backward passes per optimizer step: micro-steps x passes each (`Techniques.passes`). Above
    one, gradients are alive while a later pass runs its forward and backward."""
    return step.cand.grad_accum * step.tech.passes


def _phases(step: Step, static: StaticTerms, layers: LayerTerms, walk: list[float], loss: int,
            workspace: int) -> dict[str, dict[str, int]]:
    """Each phase's gradients, activations, loss and workspace (the static part aside)."""
    T, grads = step.T, static.grads
    # The head's weight gradient appears only after the loss's large buffers are gone, so the
    # loss phase holds gradients only when they accumulate over micro-steps.
    grads_before = grads if _backwards_per_step(step) > 1 else 0
    step_temps = static.step_temporaries
    bwd_grads, bwd_acts = _backward_peak(step, static, [int(T * (v + static.extras.stream_bytes_per_token))
                                                        for v in walk])
    phases = {
        "loss": {"gradients": grads_before, "activations": layers.acts, "loss": loss, "workspace": workspace},
        # In backward, each weight's step runs there: its temporaries join the backward's peak.
        "backward": {"gradients": bwd_grads, "activations": bwd_acts, "loss": 0, "workspace": workspace,
                     "workspace_extra": step_temps if step.opt.in_backward else 0},
        "optimizer": {"gradients": grads, "activations": 0, "loss": 0, "workspace": workspace, "workspace_extra": step_temps},
    }
    if step.tech.objective == "dpo" and step.tech.dpo_reference != "none":
        # The reference log-probs: a no-grad forward of the same rows (before each policy forward,
        # or once before training when precomputed): one layer's transients and one loss chunk.
        phases["reference"] = {
            "gradients": grads_before if step.tech.dpo_reference == "adapter_off" else 0,
            "activations": int(T * reference_forward_bytes_per_token(step.shape, step.b, step.layout, step.seq_len)),
            "loss": head_loss_bytes(step.shape, step.tech.loss_mode, T, step.b, trainable_head=False,
                                    chunk_tokens=step.cand.loss_chunk_tokens,
                                    default_chunk=default_loss_chunk(T, step.shape.vocab_size, step.b),
                                    ghost_candidates=step.tech.ghost_candidates, with_grad=False),
            "workspace": workspace}
    return phases


def _settings(step: Step, static: StaticTerms, tile_fraction: float) -> dict[str, Any]:
    """`Estimate.settings`: what the estimate assumed."""
    settings = dict(method=step.method, dtype=step.spec.dtype, micro_batch=step.cand.micro_batch, seq_len=step.seq_len,
                    checkpointing=step.checkpointing, offload_activations=step.cand.offload_activations,
                    offload_optimizer=step.cand.offload_optimizer, loss_mode=step.tech.loss_mode,
                    loss_chunk_tokens=step.cand.loss_chunk_tokens if step.tech.loss_mode != "naive" else None,
                    optimizer=step.opt.name, lora_r=step.lora.r if step.adapter else None,
                    world_size=step.spec.world_size, sharded=step.shard > 1, device=step.device,
                    tile_tokens=step.cand.tile_tokens if tile_fraction < 1.0 else None, lean_lora=step.lean,
                    lean_norm=step.kernels.lean_norm, attention=step.tech.attention, objective=step.tech.objective)
    if step.layout is not None:
        settings["kronecker"] = step.layout.to_dict()
    if step.tech.objective == "dpo":
        settings["dpo_reference"] = step.tech.dpo_reference
    if step.tech.objective == "grpo":
        settings["completion_tokens"] = step.completion_tokens
    if step.tech.loss_mode == "ghost":
        settings["ghost_candidates"] = step.tech.ghost_candidates
    if step.tech.matryoshka_dims and step.tech.objective == "sft":
        settings.update(matryoshka_dims=list(step.tech.matryoshka_dims),
                        matryoshka_token_fraction=step.tech.matryoshka_token_fraction)
    if step.tech.streams_params:
        settings["offload_params"] = step.tech.params_store
    if step.masked_attention:
        settings["masked_attention"] = True
    if static.extras.trainable_params or static.extras.layer_bytes_per_token:
        settings["adapter_terms"] = static.extras.to_dict()
    if static.vision is not None:
        settings["vision"] = static.vision.to_dict()
    settings.update(optimizer_settings(step.opt.name, step.opt.rank, step.opt.in_backward,
                                       step.opt.master_weights, step.opt.embedding))
    return settings


def estimate_peak(model_config: Any, *, method: Method = "lora", dtype: str = "bf16", micro_batch: int = 1,
                  seq_len: int = 2048, checkpointing: Checkpointing | Sequence[bool] | int = "none",
                  offload_activations: bool = False, offload_optimizer: bool = False, loss_mode: LossMode = "exact",
                  optimizer: str = "adamw", lora_r: int = 16, lora_targets: str | Sequence[str] = "all-linear",
                  world_size: int = 1, loss_chunk_tokens: int | None = None, grad_accum: int = 1,
                  ghost_candidates: int = 1024, device: str = "cuda", sharded: bool | None = None,
                  attention: Attention = "sdpa", kronecker: Any = None, objective: Objective = "sft",
                  dpo_reference: DpoReference = "adapter_off", matryoshka_dims: Sequence[int] | None = None,
                  matryoshka_token_fraction: float = 0.0625, offload_params: bool | str = False,
                  tile_tokens: int | None = None, lean_lora: bool = False, lean_norm: bool = True,
                  optimizer_rank: int | None = None, optimizer_in_backward: bool = False,
                  master_weights: str = "fp32", lora_experts: bool = True, grouped_experts: bool = True,
                  modules_to_save: Sequence[str] = (), use_dora: bool = False, lora_dropout: float = 0.0,
                  vision: Any = None, embedding_optimizer: str = "adamw", masked_attention: bool = False,
                  completion_tokens: int | None = None, qat: str = "off", qat_float_weight: float = 0.0,
                  qat_adapter: str = "merged") -> Estimate:
    """Predict the peak memory of one training step (forward, backward, optimizer step).

    Args:
        model_config: transformers config, config.json dict or path, model directory, or a hub id
            in `KNOWN_SHAPES`.
        method: ``full``, ``lora`` or ``qlora`` (NF4 base with double quantisation).
        dtype: compute / weight dtype: ``bf16``, ``fp16`` or ``fp32``.
        micro_batch, seq_len: sequences per forward pass and tokens per sequence.
        checkpointing: ``off``, ``full``, ``selective``; or per layer a list of recompute modes
            (``none`` | ``selective`` | ``full``, as `Plan.recompute`) or of booleans (True = fully
            checkpointed); or an int = how many layers (the first ones) are fully checkpointed.
        offload_activations: checkpointed layer inputs live in host memory (prefetched back).
        offload_optimizer: optimizer state lives in host memory.
        loss_mode: ``naive`` (Transformers' loss on full logits), ``exact`` (chunked linear
            cross-entropy), ``ghost`` (sampled vocabulary).
        optimizer: a `training.optimizer` name (`maximus.memory.optimizer_state.OPTIMIZERS`).
        optimizer_rank: projection rank of apollo / apollo_mini / galore (None: their default).
        optimizer_in_backward: each parameter steps inside the backward and its gradient is freed
            (`training.optimizer_in_backward`): gradients of one or two weights at a time.
        master_weights: ``fp32`` (float32 master weights for 16-bit full fine-tuning) or ``bf16``
            (bf16 weights, stochastic rounding: no master copy).
        embedding_optimizer: ``adamw`` or ``adamw_4bit``: the embedding's and the head's moments
            under apollo / apollo_mini / galore / muon (`training.embedding_optimizer`).
        lora_r, lora_targets: adapter rank and targeted linear layers.
        lora_experts: a mixture of experts' MLP targets reach every expert (`lora.experts`);
            False: its expert layers carry no MLP adapters (no expert LoRA state).
        grouped_experts: `maximus.kernels.grouped_experts` runs the experts (on CPU,
            `optimization.grouped_experts`): the adapters stay factored; else Transformers'
            forward keeps PEFT's merged copy of each layer's expert weights for backward.
        world_size: data-parallel ranks; the estimate is per rank.
        sharded: whether FSDP2 shards the model over the ranks (`training.distributed: fsdp`).
            Default: yes for full and LoRA when world_size > 1 (what `auto` picks when one
            device cannot hold the run). QLoRA is never sharded (Maximus runs it under DDP:
            `fully_shard` cannot split NF4 weights). Sharded: weights, adapters, gradients and
            optimizer state are 1/world_size per rank, except a head tied to the embedding
            (kept whole); plus what FSDP2 gathers at once (two decoder layers, the embedding
            for the whole step, the head while the loss runs). Unsharded (DDP): every rank
            holds what one process would.
        loss_chunk_tokens: tokens per chunk of the exact / ghost loss (default: the loss's own).
        grad_accum: micro-steps per optimizer step (>1 keeps gradients alive during backward).
        device: ``cuda`` or ``cpu``: decides workspace and optimizer temporaries.
        ghost_candidates: hard-negative rows per chunk of the ghost loss
            (`optimization.ghost_logit.candidates`).
        attention: ``sdpa`` or ``kronecker`` (Kronecker Sketching, `kronecker` = its
            `KroneckerConfig` or a dict of detail_tokens / sketch_slots / block; None = defaults).
        objective: ``sft``, ``dpo`` (a micro-batch of N pairs is 2N rows: chosen and rejected),
            ``contrastive`` (2N rows: queries and positives; no vocabulary loss) or ``grpo`` (rows
            of prompt + completion, `seq_len` tokens each, of which `completion_tokens` carry the
            loss: the exact head runs over those only, `completion_loss_bytes`).
        dpo_reference: ``adapter_off`` (a no-grad reference forward of the same rows before
            each policy forward), ``precomputed`` (log-probs cached before training) or
            ``none`` (SimPO / ORPO need no reference).
        matryoshka_dims, matryoshka_token_fraction: the SFT Matryoshka auxiliary pass (prefix
            losses over a sampled share of the tokens); None = off.
        offload_params: frozen decoder weights (4-bit ones too) stream to the device one layer ahead
            (`optimization.offload.params`): True or ``on`` from pinned host memory, ``disk`` from a
            memory-mapped file (host memory then holds two pinned staging layers on CUDA); ``auto``
            and ``off`` stream nothing here (the planner decides ``auto``). An untied, untrained
            input embedding's table then lives in host memory too (`maximus.memory.host_embedding`).
        tile_tokens: the MLP of each fully recomputed layer runs over tiles of this many tokens
            in backward (`optimization.tile_tokens`); None: untiled.
        lean_norm: the RMSNorms are Maximus' lean ones (`optimization.lean_norm`, or the Triton
            kernel), else Transformers' float32 path with its float32 temporaries in backward.
        lean_lora: the adapters' projections are Maximus' lean ones (the input kept once, in the
            compute dtype); False: PEFT's own layers (what a plain Transformers + PEFT step keeps).
        vision: a vision-language model's tower and projector (`maximus.memory.vision_terms.VisionSpec`,
            from `maximus.memory.spec_from_config.run_spec`); None for a text model. The rows' image tokens are in `seq_len`.
        modules_to_save, use_dora, lora_dropout: `lora.modules_to_save` (full trained copies, e.g.
            embed_tokens, lm_head), DoRA and LoRA dropout (`maximus.memory.adapter_terms`); adapters only.
        masked_attention: SDPA gets a document mask (`MicroBatch.masked`: many short packed
            documents), which it keeps with keys and values repeated to every head.
        qat: `training.qat` (``off`` or a target): the cache of rounded weights joins the weights
            term (`qat_copy_bytes`).
        qat_float_weight: `training.qat_float_weight`; above 0 (with `qat`) each micro-batch runs
            twice, so gradients are alive in the second pass (as with `grad_accum` > 1) and the
            step takes twice the compute.
        qat_adapter: `training.qat_adapter`; ``separate`` (LoRA / QLoRA) rounds the frozen base
            once for the run, so the step time counts no rounding.

    Returns:
        An `Estimate` whose breakdown (weights, adapters, gradients, optimizer, activations,
        loss, workspace) sums to `peak_bytes`.
    """
    settings = {k: v for k, v in locals().items() if k != "model_config"}
    return estimate_step(keyword_spec(model_shape(model_config), settings, lean_lora=lean_lora),
                         candidate_of(settings))


def estimate_step(spec: RunSpec, cand: Candidate) -> Estimate:
    """The `Estimate` of the candidate plan `cand` in the run `spec`: static part + the largest of
    its phases (`estimate_peak` documents what it counts). Under context parallelism
    (``cand.context_parallel`` > 1) it is one rank's: `context_split_estimate`."""
    if cand.context_parallel > 1:
        return context_split_estimate(spec, cand)
    step = step_of(spec, cand)
    static = _static_terms(step)
    layers = _layer_terms(step, static.extras)
    walk = _backward_walk(step, layers)
    loss, default_chunk = _loss_terms(step, static.trainable_head)
    phases = _phases(step, static, layers, walk, loss, _workspace_terms(step))
    if static.vision is not None:
        static.vision.add_to_phases(phases, static.grads if _backwards_per_step(step) > 1 else 0)
    totals = {k: sum(v.values()) for k, v in phases.items()}
    phase = max(totals, key=totals.get)
    chosen = phases[phase]
    breakdown = {"weights": static.weights_dev, "adapters": static.adapters, "gradients": chosen["gradients"],
                 "optimizer": static.opt_dev, "activations": chosen["activations"], "loss": chosen["loss"],
                 "workspace": chosen["workspace"] + chosen.get("workspace_extra", 0)}
    peak = sum(breakdown.values())
    chunk_used = None if step.tech.loss_mode == "naive" else max(1, min(step.cand.loss_chunk_tokens or default_chunk, step.T))
    flops, tps = _throughput(step, static.trainable, chunk_used, layers.tile_fraction)
    streaming = _streaming_terms(step, static.streamed, tps)
    return Estimate(peak_bytes=int(peak), breakdown={k: int(v) for k, v in breakdown.items()},
                    flops_per_token=flops, tokens_per_s_guess=streaming["tokens_per_s"], phase=phase,
                    settings=_settings(step, static, layers.tile_fraction), notes=static.notes + layers.notes,
                    host_bytes=int(layers.host_acts + static.host_opt + streaming["host"]),
                    disk_bytes=streaming["disk"], streamed_bytes_per_step=streaming["per_step"],
                    compute_tokens_per_s=tps)


def context_split_estimate(spec: RunSpec, cand: Candidate) -> Estimate:
    """One rank's estimate when ``cand.context_parallel`` ranks share each row: every per-token
    term is that of a ``seq_len / degree``-token row, rounded up to the padding the trainer adds
    (`train.context_parallel`), plus the attention exchange's buffers for those tokens
    (`memory.context_exchange.exchange_bytes_per_token`), counted as activations. The weights and
    optimizer state are whole under DDP; under FSDP2 (a sharded step) they are 1/(world_size x
    degree): the trainer shards over the whole world, the ranks that share rows included."""
    from maximus.memory.context_exchange import exchange_bytes_per_token

    degree = cand.context_parallel
    local_tokens = 2 * -(-cand.seq_len // (2 * degree))  # rows padded to the zigzag split's 2 x degree chunks
    sharded = spec.world_size > 1 if cand.sharded is None else cand.sharded
    world = replace(spec, world_size=spec.world_size * degree) if sharded else spec
    local = estimate_step(world, replace(cand, seq_len=local_tokens, context_parallel=1, sharded=sharded))
    exchange = exchange_bytes_per_token(spec.shape, degree, spec.dtype_bytes) * cand.micro_batch * local_tokens
    breakdown = {**local.breakdown, "activations": local.breakdown["activations"] + exchange}
    note = (f"context parallelism: each of {degree} ranks holds {local_tokens:,} tokens of each row, plus "
            f"{exchange:,} bytes of the attention exchange's buffers")
    return replace(local, peak_bytes=local.peak_bytes + exchange, breakdown=breakdown, notes=local.notes + [note],
                   settings={**local.settings, "context_parallel": degree})


def _streaming_terms(step: Step, streamed: int, compute_tps: float) -> dict[str, Any]:
    """What streamed frozen weights (`optimization.offload.params`) cost off the device: the host
    bytes (every layer, or with ``disk`` two pinned staging layers; and the embedding's table) and
    the file's bytes, the bytes copied per micro-step (the layers, and at most one embedding row a
    token), and the tokens/s of a step that takes the slower of its compute and its copies (they
    overlap, one layer ahead) at `DEFAULT_H2D_BYTES_PER_S`."""
    L = step.shape.num_layers
    streamed_layers = streamed // max(1, L - STREAMED_IN_FLIGHT) * L  # every layer lives off the device
    per_layer = streamed_layers // L
    host, disk = ((STAGING_LAYERS * per_layer, streamed_layers) if step.tech.params_store == "disk"
                  else (streamed_layers, 0))
    host += _host_table_bytes(step)  # the embedding's table, in host memory in both modes
    # Forward fetches every layer but the first (resident since the last backward); backward every
    # layer but the last again (for the recompute and the input gradients).
    per_step = 2 * max(0, L - 1) * per_layer
    if _host_table_bytes(step):  # the batch's distinct rows of the embedding (at most one a token)
        per_step += min(step.T, step.shape.vocab_size) * step.shape.hidden_size * step.b
    tps = compute_tps
    if per_step:
        transfer_s = (per_step + per_layer) / DEFAULT_H2D_BYTES_PER_S  # the first layer's copy is not hidden
        tps = step.T / max(step.T / compute_tps, transfer_s)
    return {"host": host, "disk": int(disk), "per_step": int(per_step), "tokens_per_s": tps}


def _throughput(step: Step, trainable: int, loss_chunk: int | None, tile_fraction: float) -> tuple[float, float]:
    """(training FLOPs per token, a tokens/s guess) used to rank plans against each other. The
    time is `maximus.memory.step_time.step_seconds`: op class by op class, measured rates."""
    from maximus.memory.step_time import MicroStep, qat_round_seconds, step_seconds

    shape, method, T, seq_len, policy = step.shape, step.method, step.T, step.seq_len, step.policy
    L = shape.num_layers
    layer_fwd = 2 * shape.layer_linear_params + 2 * seq_len * shape.q_dim  # causal attention: half of 4*s*d
    head_fwd = 2 * shape.vocab_size * shape.hidden_size
    fwd = L * layer_fwd + head_fwd
    # Backward: input gradients always (2x forward FLOPs for matmuls ~ 1x); weight gradients only
    # for trainable weights (full fine-tuning).
    bwd = fwd * (2.0 if method == "full" else 1.0)
    recompute = sum(layer_fwd if p == "full" else 0.08 * layer_fwd if p == "selective" else 0 for p in policy)
    flops = float(fwd + bwd + recompute)
    work = MicroStep(tokens=T, seq_len=seq_len, policy=policy, method=method, lora_r=step.lora.r,
                     lora_targets=len(step.targets), loss_mode=step.tech.loss_mode, loss_chunk=loss_chunk,
                     offload_activations=step.cand.offload_activations)
    parts = step_seconds(shape, work, device=step.device, dtype_bytes=step.b)
    seconds = sum(parts.values()) * step.tech.passes  # training.qat_float_weight: a float pass after the rounded one
    if tile_fraction < 1.0:
        # Tiles run smaller MLP matmuls (the MLP forward is not repeated: see kernels/tiled_mlp.py).
        seconds *= 1.01 + 0.01 * math.log2(1.0 / tile_fraction)
    # The optimizer step is memory-bound: ~16 bytes touched per trainable parameter, once per
    # optimizer step (spread over grad_accum micro-steps of T tokens).
    bandwidth = 2e12 if step.device == "cuda" else 20e9
    if step.cand.offload_optimizer:
        bandwidth = 20e9  # host-side update
    seconds += 16 * trainable / bandwidth / max(1, step.cand.grad_accum)
    # training.qat rounds again, once per optimizer step, the quantized weights the step changed
    # (none under qat_adapter separate: a LoRA layer's frozen base is rounded once for the run)
    seconds += qat_round_seconds(shape, step.tech.qat, device=step.device, dtype_bytes=step.b, method=method,
                                 lora_targets=len(step.targets), adapter=step.tech.qat_adapter) / max(1, step.cand.grad_accum)
    return flops, T / seconds
