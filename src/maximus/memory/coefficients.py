"""The estimator's measured coefficients, in one data module (`maximus.memory.estimate` and
`maximus.memory.adapter_terms` read them). Each table says how it was measured; docs/planner.md
has the method and the figures.
"""
from __future__ import annotations

__all__ = ["DTYPE_BYTES", "DEVICE_FLOPS", "ATTENTION_PROBS", "ATTENTION_BACKWARD_PROBS", "ATTENTION_SINK_MASKS", "QK_EXTRA", "EXPERT_GATE_TENSORS", "LAYER_COEF", "KRONECKER_COEF", "DORA_OUT_BYTES",
           "DROPOUT_IN_BYTES"]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}

#: Sustained matmul rate assumed when ranking plans, in FLOP/s (bf16). Only ratios matter:
#: the planner compares plans on one device. CPU: measured on the 2-core reference machine.
DEVICE_FLOPS = {"cuda": 300e12, "cpu": 0.83e12, "mps": 10e12}

#: float32 heads x tokens x tokens attention tensors a layer keeps for backward, by model type: the
#: classes without SDPA (maximus.families.attention_implementation). Gemma 2's eager attention keeps
#: its soft-capped scores (tanh's output) and the softmax; a layer's backward holds two more (the
#: gradients of the probabilities and of the scores: `ATTENTION_BACKWARD_PROBS`). Measured at the
#: peak with the CPU meter on the family matrix's 2-layer model at 1,024 and 2,048 tokens
#: (benchmarks/plan_families.py): 2 x layers + 2 without checkpointing, 2 + 2 with it.
ATTENTION_PROBS = {"gemma2": 2}
ATTENTION_BACKWARD_PROBS = {"gemma2": 2}

#: Attention masks a step keeps, shared by the layers of a kind (full, sliding), by model type: each
#: ``[rows, 1, T, T (+1)]`` in the compute dtype plus the boolean mask it was made from. SDPA with
#: attention sinks (gpt-oss, maximus.attention.sink_attention) needs one for its sliding layers (and one for
#: its full layers with padding or packed documents); a sliding window kept on SDPA
#: (attention.varlen.sliding_window, Gemma 3) one for its sliding layers; Gemma 2's eager attention
#: one per kind, held through the step by checkpointed layers. Measured as ATTENTION_PROBS.
ATTENTION_SINK_MASKS = {"gpt_oss": 1, "gemma3": 1, "gemma3_text": 1, "gemma2": 2}

#: What a layer keeps of its query and key projections beyond a Llama layer, by model type, per
#: token: (compute-dtype elements per unit of q_dim + kv_dim, float32 values per query and key head).
#: Qwen3, Qwen3-MoE and Gemma 3 normalise q and k per head (the norm's input and its 1 / rms per
#: head); OLMo 2 normalises them whole with Transformers' norm; Phi-3's fused qkv projection stays
#: alive whole through the values SDPA saves. Measured (fp32, the CPU meter, the family matrix's
#: 2-layer models at 1,024 and 2,048 tokens, benchmarks/plan_families.py); 16-bit rows assume the
#: same elements in the compute dtype.
QK_EXTRA = {"qwen3": (1, 1), "qwen3_moe": (1, 1), "gemma3": (1, 1), "gemma3_text": (1, 1), "olmo2": (1, 0),
            "phi3": (1.5, 0)}

#: Intermediate-sized tensors (compute dtype) an expert's gate keeps per routed token beyond what
#: SiLU(gate) x up keeps (its input and SiLU(gate)), by model type: (under
#: maximus.kernels.grouped_experts, under Transformers' experts forward). The grouped forward's gates
#: are one autograd function each that keeps only its input (-1): gpt-oss's clamped SwiGLU, and
#: Mixtral's and Qwen3-MoE's SiLU(gate) x up; Transformers' operations for gpt-oss keep the clamps,
#: the sigmoid and the products (+3). Measured with saved_tensors_hooks against Mixtral under
#: Transformers' forward, same shape (the family matrix's tiny models, float32): -2.9 and +13.1
#: bytes per routed intermediate unit for gpt-oss.
EXPERT_GATE_TENSORS = {"gpt_oss": (-1, 3), "mixtral": (-1, 0), "qwen3_moe": (-1, 0)}

# Measured with saved_tensors_hooks on Transformers 5 LlamaDecoderLayer (SDPA), varying one
# dimension at a time (docs/planner.md "Where the coefficients come from"):
#   bytes/token = ch*h + ci*i + cq*q_dim + ckv*kv_dim + 4*heads (float32 log-sum-exp)
#                 + 4*r per LoRA-targeted linear (its float32 down-projection output).
# "adapter" = LoRA/QLoRA (frozen base, float32 adapters); "full" = every weight trainable.
# 16-bit rows are measured under `torch.autocast`, as the trainer runs them (issue 16: 20 random
# shapes each, hidden 128-512, intermediate 256-1536; worst error 2 %); full fine-tuning keeps
# float32 master weights (`models.load_base_model`), so its 16-bit row is a float32 model under
# 16-bit autocast: the residual stream stays float32 (26 bytes per hidden unit), plus a 16-bit
# copy of every linear weight per layer (a per-layer constant; a pure bf16 model keeps (16, 8, 4, 4)). Without autocast PEFT
# casts each adapter input to float32 and a LoRA layer keeps (28, 10, 8, 4): bare Transformers
# steps outside autocast keep ~20 % more than the trainer's.
LAYER_COEF = {  # (trainable, dtype bytes) -> (ch, ci, cq, ckv)
    ("full", 2): (26, 8, 4, 4),
    ("full", 4): (24, 16, 8, 8),
    ("adapter", 2): (18, 8, 6, 4),
    ("adapter", 4): (16, 16, 8, 8),
}

# Bytes per query token that one decoder layer saves for backward with Kronecker Sketching on top
# of what it saves with SDPA. Measured with saved_tensors_hooks on Transformers 5 Llama layers
# (2 layers minus 1) with the sketch installed as the trainer installs it (trainable sketch; LoRA
# on all linear layers, bf16 under autocast as the trainer runs), 30-36 random shapes per row
# (hidden 256-512, 1-16 heads, head_dim 32-128, block 32-128, 2-6 detail blocks, 16-256 slots),
# fitted by least squares on the terms the code allocates (docs/benchmarks/planner.md):
#   probabilities H*C (float32 softmax output + its 16-bit copy for the value matmul),
#   gathered keys / values kv*C*D/L, the mask kv*C, block keys kv*D, queries H*D,
#   sketch slot sums kv*K*D/L, selected blocks' slot sums kv*n_sel*S*D/L;
#   with C = detail tokens + slots, K = slots, L = block, S = sub-slots.
# Worst error on the fitted layers: 7 % of the layer's total (mean 1.5 %).
KRONECKER_COEF = {  # (trainable, dtype bytes) -> coefficients of the terms above
    ("full", 2): (6.0, 3.5, 1.0, 3.0, -0.1, 1.3, 13.8),  # float32 master weights, 16-bit autocast
    ("adapter", 2): (5.9, 2.9, 1.4, 3.4, -1.1, 4.6, 4.4),
    ("full", 4): (4.0, 8.0, 1.1, 0.3, 0.0, 8.1, 2.0),
    ("adapter", 4): (4.0, 8.0, 1.1, 0.3, 0.0, 8.1, 2.0),
}

#: Saved bytes per element of a target's width, per token (float32 steps; measured, fp32 and bf16).
#: DoRA: base and LoRA results (output width); dropout: mask + dropped input (input width).
DORA_OUT_BYTES = {4: 8, 2: 4}
DROPOUT_IN_BYTES = {4: 5, 2: 1}
