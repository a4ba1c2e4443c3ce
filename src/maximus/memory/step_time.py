"""Predict the wall time of one training step from shapes, op class by op class (issue 23).

The planner ranks plans by this time, so it must see what recompute really costs. Counting FLOPs
does not: the 128k-vocabulary output head holds most of a step's FLOPs but runs near the
machine's peak, while a decoder layer's smaller matmuls, attention and element-wise ops run far
below it, so replaying a layer costs a larger share of the step than of its FLOPs (measured in
fp32 on a 2-core CPU: 14-17 % for full recompute, where FLOPs said 8.6 %). Each op class gets its
own rate, measured per device and dtype:

* head: the exact loss's forward + backward (``4 x T x H x V`` FLOPs for a frozen head), with a
  time factor per chunk size;
* decoder matmuls: the layers' linear layers and their LoRA adapters (FLOP/s);
* attention: causal SDPA forward (FLOP/s) and its backward as a multiple of the forward;
* elementwise: norms, RoPE, SiLU, residual adds, casts: seconds per token per
  (hidden + intermediate) element;
* dequantise: NF4 -> compute dtype, seconds per weight, once per matmul use (QLoRA);
* QAT rounding (`training.qat`, `qat_round_seconds`): seconds per weight of llama.cpp's rounding,
  once per optimizer step (every merged weight changes with it), by kind of GGUF type: the legacy
  blocks of 32 (q4_0, q5_0, q8_0; torchao's int4 alike) or a K-quant's scale search.

A layer's forward is the sum of its classes; its backward takes the input gradient of every
matmul (the same product shapes; weight gradients too when the weights train), the attention
backward and twice the elementwise work. Recompute adds: a full layer forward (``full``), or
everything but the large matmuls (``selective``: their outputs are kept; attention, elementwise
ops and the LoRA adapters replay, which measured 72 % of a full replay's time in fp32).

`CALIBRATION` holds the CPU numbers measured by ``benchmarks/step_cost.py calibrate`` (see
docs/benchmarks/planner.md); CUDA and MPS numbers are derived from data-sheet rates, not
measured. Only ratios between plans on one device matter for ranking; the absolute tokens/s is a
guess (a shared CPU under load runs several times slower).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["OpRates", "CALIBRATION", "op_rates", "layer_matmul_flops", "step_seconds", "qat_round_seconds"]


@dataclass(frozen=True)
class OpRates:
    """Measured speed of each op class on one device in one dtype."""

    head_flops_per_s: float
    decoder_flops_per_s: float
    attention_flops_per_s: float
    attention_backward_x_forward: float
    elementwise_s_per_element: float  # per token per (hidden + intermediate) element
    dequantize_s_per_weight: float
    #: head time at a chunk size (tokens) relative to the best chunk; interpolated in log2.
    head_chunk_factor: dict[int, float] = field(default_factory=dict)
    #: tokens of one forward at which the matmul rates were measured.
    calibrated_tokens: int = 2048
    #: QAT: seconds to round one weight as llama.cpp does, per kind of type (``legacy``, ``kquant``).
    qat_round_s_per_weight: dict[str, float] = field(default_factory=lambda: dict(_QAT_ROUND_CUDA))


#: Measured with ``benchmarks/step_cost.py calibrate --chunks 256 512 1024 --repeats 4`` on the
#: 2-core AVX512-BF16 CPU of this project (reference model shapes, 2 threads, one run, the machine
#: shared: load average ~10, so rates are ~5x below a quiet run; ratios are what ranks plans).
#: fp32's elementwise residual came out below zero (its isolated matmul rate underestimates the
#: in-layer one), so fp32 takes bf16's elementwise time x 2 (same ops, twice the bytes) and its
#: decoder rate is fitted so the measured layer forward (613 ms) is reproduced. fp32's NF4
#: dequantise measured 55.9 ns / weight through `bitsandbytes.functional.dequantize_4bit`, but a
#: whole 64-token fp32 QLoRA step took 0.68 s, which bounds the in-step cost far below that (it
#: would be 2.1 s alone): fp32 takes bf16's time x 2 (twice the bytes written).
#: The fp32 rates are then scaled by 5.07, the ratio of predicted to measured step time of the
#: no-recompute plan in `benchmarks/step_cost.py plans --dtype fp32` (quiet machine, load ~2):
#: the load slowed every class alike, and that run sets the absolute scale.
_FP32_QUIET = 5.07
#: bf16 likewise (session 5): `step_cost.py plans --dtype bf16 --steps 2` measured the no-recompute
#: plan at 1.97 s against 11.61 s predicted from the loaded calibration (every plan 5.9-6.4x, ranks
#: already right), so the bf16 rates are scaled by 5.89.
_BF16_QUIET = 5.89
#: `maximus.qat.ggml_rounding.fake_quantize` on a 576 x 1536 fp32 matrix, CPU seconds of one thread
#: (`benchmarks/qat.py --rates`; 2-core AVX512-BF16 CPU, 2026-12-05): q8_0 2.2, q4_0 5.3, q5_0 5.5 ns
#: per weight; q6_k 58, q5_k 84, q4_k 105 ns (llama.cpp's trial scales; 2026-12-06, with both cores
#: busy: q8_0 6.2, q4_0 5.3, q5_0 5.3, q6_k 56, q5_k 98, q4_k 123). The planner's CPU rates are two
#: threads' (half, as torch splits these element-wise ops). Rounding all of SmolLM2-135M's matrices, the one-thread rates give
#: 0.7 s (q4_0) and 3.0 s (q4_k_m: K-quants for ffn_down only), where `benchmarks/qat.py --cost`
#: measured 0.8-0.9 s and 2.0-3.0 s (docs/benchmarks/qat.md).
_QAT_ROUND_CPU = {"legacy": 5.3e-9 / 2, "kquant": 90e-9 / 2}  # kquant: q4_k_m's Q4_K and Q6_K blended
#: Not measured: ~16 bytes moved per weight at 2 TB/s, the K-quant search ~17x that (as on the CPU).
_QAT_ROUND_CUDA = {"legacy": 8e-12, "kquant": 136e-12}
CALIBRATION: dict[tuple[str, str], OpRates] = {
    ("cpu", "fp32"): OpRates(head_flops_per_s=52.7e9 * _FP32_QUIET, decoder_flops_per_s=50.7e9 * _FP32_QUIET,
                             attention_flops_per_s=22.8e9 * _FP32_QUIET, attention_backward_x_forward=2.8,
                             elementwise_s_per_element=37.6e-9 / _FP32_QUIET,
                             dequantize_s_per_weight=0.28e-9 / _FP32_QUIET,
                             head_chunk_factor={256: 1.06, 512: 1.00, 1024: 1.00},
                             qat_round_s_per_weight=_QAT_ROUND_CPU),
    ("cpu", "bf16"): OpRates(head_flops_per_s=111.7e9 * _BF16_QUIET, decoder_flops_per_s=143.4e9 * _BF16_QUIET,
                             attention_flops_per_s=24.6e9 * _BF16_QUIET, attention_backward_x_forward=1.4,
                             elementwise_s_per_element=18.8e-9 / _BF16_QUIET,
                             dequantize_s_per_weight=0.14e-9 / _BF16_QUIET,
                             head_chunk_factor={256: 1.00, 512: 1.08, 1024: 1.20},
                             qat_round_s_per_weight=_QAT_ROUND_CPU),
    # Not measured: half of a 300 TFLOP/s data sheet for matmuls, a third for attention,
    # ~20 bytes moved per element at 2 TB/s, a 4-bit read and 16-bit write per dequantised weight.
    ("cuda", "bf16"): OpRates(head_flops_per_s=150e12, decoder_flops_per_s=150e12, attention_flops_per_s=100e12,
                              attention_backward_x_forward=2.5, elementwise_s_per_element=20 / 2e12,
                              dequantize_s_per_weight=2.5 / 2e12, head_chunk_factor={256: 1.10, 1024: 1.00}),
    ("cuda", "fp32"): OpRates(head_flops_per_s=40e12, decoder_flops_per_s=40e12, attention_flops_per_s=20e12,
                              attention_backward_x_forward=2.5, elementwise_s_per_element=40 / 2e12,
                              dequantize_s_per_weight=4.5 / 2e12, head_chunk_factor={256: 1.10, 1024: 1.00}),
}
#: Other devices: the CUDA numbers scaled by their data-sheet ratio.
_DEVICE_SCALE = {"mps": 10e12 / 300e12}


def op_rates(device: str, dtype_bytes: int) -> OpRates:
    """The calibration for a device type (``cpu``, ``cuda``, ``mps``) and dtype width (2 or 4 bytes)."""
    dtype = "fp32" if dtype_bytes >= 4 else "bf16"
    if (device, dtype) in CALIBRATION:
        return CALIBRATION[(device, dtype)]
    base = CALIBRATION[("cuda", dtype)]
    s = _DEVICE_SCALE.get(device, 1.0)
    return OpRates(head_flops_per_s=base.head_flops_per_s * s, decoder_flops_per_s=base.decoder_flops_per_s * s,
                   attention_flops_per_s=base.attention_flops_per_s * s,
                   attention_backward_x_forward=base.attention_backward_x_forward,
                   elementwise_s_per_element=base.elementwise_s_per_element / s,
                   dequantize_s_per_weight=base.dequantize_s_per_weight / s, head_chunk_factor=base.head_chunk_factor,
                   qat_round_s_per_weight={k: v / s for k, v in base.qat_round_s_per_weight.items()})


def layer_matmul_flops(hidden: int, intermediate: int, q_dim: int, kv_dim: int, lora_r: int = 0,
                       lora_targets: int = 7) -> float:
    """Forward matmul FLOPs per token of one decoder layer's linears, plus LoRA adapters of rank
    ``lora_r`` on the first ``lora_targets`` of q, k, v, o, gate, up, down."""
    h, i = hidden, intermediate
    shapes = [(h, q_dim), (h, kv_dim), (h, kv_dim), (q_dim, h), (h, i), (h, i), (i, h)]
    base = sum(2 * a * b for a, b in shapes)
    return float(base + sum(2 * lora_r * (a + b) for a, b in shapes[:lora_targets]))


def _chunk_factor(rates: OpRates, chunk: int | None) -> float:
    table = rates.head_chunk_factor
    if not table or not chunk:
        return 1.0
    keys = sorted(table)
    if chunk <= keys[0]:
        # Below the measured range smaller matmuls run slower still: +5 % per halving.
        return table[keys[0]] * (1 + 0.05 * math.log2(keys[0] / chunk))
    if chunk >= keys[-1]:
        return table[keys[-1]]
    for lo, hi in zip(keys, keys[1:]):
        if lo <= chunk <= hi:
            w = math.log2(chunk / lo) / math.log2(hi / lo)
            return table[lo] * (1 - w) + table[hi] * w
    return 1.0  # pragma: no cover


@dataclass(frozen=True)
class MicroStep:
    """What one micro-step runs, as the time model reads it (`step_seconds`)."""

    #: Tokens of the micro-step, in rows of `seq_len`.
    tokens: int
    seq_len: int
    #: One recompute mode per layer: ``none`` / ``full`` / ``selective``.
    policy: tuple[str, ...]
    method: str
    lora_r: int
    #: Targeted linears per layer.
    lora_targets: int
    loss_mode: str = "exact"
    loss_chunk: int | None = None
    offload_activations: bool = False


def step_seconds(shape, work: MicroStep, *, device: str, dtype_bytes: int,
                 naive_loss_factor: float = 1.4) -> dict[str, float]:
    """Seconds of one micro-step `work` of a model of `shape` (a `maximus.memory.shape.ModelShape`),
    by op class: ``head``, ``decoder_matmuls``, ``attention``, ``elementwise``, ``dequantize`` and
    ``recompute`` (the part of the others that checkpointing replays)."""
    hidden, intermediate, q_dim, kv_dim = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    tokens, seq_len, policy, method, lora_r = work.tokens, work.seq_len, work.policy, work.method, work.lora_r
    loss_mode, loss_chunk = work.loss_mode, work.loss_chunk
    r = op_rates(device, dtype_bytes)
    # Fewer tokens than calibrated run less efficiently: T / (T + k), k = 1024 on a GPU (it needs
    # many rows to fill), 128 on a CPU (a 64-token step of the reference model measured ~2.7x the
    # per-token time of a 2,048-token one).
    k = 128.0 if device == "cpu" else 1024.0
    eff = min(1.0, (tokens / (tokens + k)) / (r.calibrated_tokens / (r.calibrated_tokens + k)))
    trainable = method == "full"
    lora = 0 if trainable else lora_r
    mm_fwd = layer_matmul_flops(hidden, intermediate, q_dim, kv_dim, lora, work.lora_targets) * tokens / (r.decoder_flops_per_s * eff)
    base_fwd = layer_matmul_flops(hidden, intermediate, q_dim, kv_dim, 0) * tokens / (r.decoder_flops_per_s * eff)
    lora_fwd = mm_fwd - base_fwd
    # backward: input gradients of every product, weight gradients of what trains (LoRA or all)
    mm_bwd = base_fwd * (2.0 if trainable else 1.0) + 2 * lora_fwd
    attn_fwd = 2.0 * tokens * seq_len * shape.head_dim * shape.num_heads / r.attention_flops_per_s  # causal half of 4 s^2 d
    attn_bwd = attn_fwd * r.attention_backward_x_forward
    elem_fwd = r.elementwise_s_per_element * tokens * (hidden + intermediate)
    deq = r.dequantize_s_per_weight * shape.layer_linear_params if method == "qlora" else 0.0
    layer_fwd = mm_fwd + attn_fwd + elem_fwd + deq
    L = len(policy)
    out = {"decoder_matmuls": L * (mm_fwd + mm_bwd), "attention": L * (attn_fwd + attn_bwd),
           "elementwise": L * 3 * elem_fwd, "dequantize": L * 2 * deq}
    # `selective` keeps the large matmuls' outputs and replays the rest: attention, elementwise ops
    # and the LoRA adapters' small matmuls (measured in fp32: 72 % of a full replay's cost).
    selective = layer_fwd - base_fwd - deq
    recompute = sum(layer_fwd if p == "full" else selective if p == "selective" else 0.0 for p in policy)
    if work.offload_activations:
        recompute += 0.05 * L * layer_fwd  # copies, mostly hidden behind compute
    out["recompute"] = recompute
    head_flops = (6.0 if trainable else 4.0) * tokens * hidden * shape.vocab_size
    head = head_flops / (r.head_flops_per_s * eff) * _chunk_factor(r, loss_chunk if loss_mode != "naive" else None)
    if loss_mode == "naive":
        head *= naive_loss_factor  # full logits: several tokens x vocab tensors written and read
    out["head"] = head
    return out


def qat_round_seconds(shape, target: str, *, device: str, dtype_bytes: int, method: str = "full",
                      lora_targets: int = 7, adapter: str = "merged") -> float:
    """Seconds to round again, after an optimizer step, the weights `training.qat: target` rounds
    that the step changed: with full fine-tuning every decoder linear and, for a GGUF target, the
    embedding (and an untied head; ``int4`` rounds the decoder's linears only); with LoRA / QLoRA
    the merged weights of the first `lora_targets` of q, k, v, o, gate, up, down (a frozen weight's rounding is kept from the first step). q4_k_m takes
    llama.cpp's K-quant search where a matrix's columns divide into blocks of 256 and a legacy
    block type elsewhere (as SmolLM2's 576 columns do); q4_0, q8_0 and int4 round blocks of 32.
    0 for ``off``, and for LoRA / QLoRA under `adapter` ``separate`` (`training.qat_adapter`: the
    rounded base is kept from the first step, the adapter is not rounded)."""
    if target == "off" or (adapter == "separate" and method != "full"):
        return 0.0
    h, i = shape.hidden_size, shape.intermediate_size
    # (rows, columns) of each rounded matrix; a K-quant block runs along the columns
    matrices = [(shape.q_dim, h), (shape.kv_dim, h), (shape.kv_dim, h), (h, shape.q_dim), (i, h), (i, h), (h, i)]
    if method == "full":
        matrices = matrices * shape.num_layers
        if target != "int4":
            matrices += [(shape.vocab_size, h)] * (1 if shape.tied_embeddings else 2)
    else:
        matrices = matrices[:lora_targets] * shape.num_layers
    rates = op_rates(device, dtype_bytes).qat_round_s_per_weight
    kquant = target == "q4_k_m"
    return float(sum(rows * cols * rates["kquant" if kquant and cols % 256 == 0 else "legacy"] for rows, cols in matrices))
