"""Triton kernels vs eager PyTorch on CUDA: each kernel, then an 8B-shaped QLoRA decoder-layer step.

Needs a CUDA GPU and `pip install triton` (it exits at once with a message otherwise). Each row times
forward + backward (CUDA events, median of --repeats after warm-up) of ours and of the eager path it
replaces, side by side in one run, and prints a markdown table with the speed ratio and the largest
difference. The layer step is Llama-3-8B shaped (hidden 4096, MLP 14336, 32 q / 8 kv heads, NF4 double
quantised, LoRA r=16 on every linear, bf16) with one decoder layer and a small vocabulary, so the
step is the layer.

    python benchmarks/gpu_kernels.py            # batch 1 x 2048 tokens
    python benchmarks/gpu_kernels.py --quick    # 512 tokens, fewer repeats (< 2 min)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import torch

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
DEVICE = "cuda"


def fail_fast() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels.py needs a CUDA GPU (Triton kernels compile for CUDA); on CPU run the parity tests: "
                 "pytest tests/kernels -k triton")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("gpu_kernels.py needs Triton: pip install triton")


def time_ms(step, repeats: int) -> float:
    """Median milliseconds of `step()` (forward + backward) after two warm-up calls."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fwd_bwd(fn, *inputs):
    """A step closure: fn(*inputs) then backward of a fixed random cotangent; returns (step, first output)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs]

    def step():
        for t in leaves:
            t.grad = None
        res = fn(*leaves)
        torch.autograd.backward(list(res if isinstance(res, tuple) else (res,)), grads)

    return step, outs[0].detach()


def kernel_rows(tokens: int, repeats: int) -> list[tuple[str, float, float, float]]:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from maximus.kernels.triton.lora_4bit import lora_linear_4bit
    from maximus.kernels.triton.nf4 import dequantize_nf4
    from maximus.kernels.triton.rms_norm import rms_norm
    from maximus.kernels.triton.rope import apply_rotary
    from maximus.kernels.triton.swiglu import swiglu, swiglu_reference

    dev, bf16 = DEVICE, torch.bfloat16
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16)
    norm = LlamaRMSNorm(HIDDEN).to(dev, bf16)
    q = torch.randn(1, tokens, HEADS, HEAD_DIM, device=dev, dtype=bf16).transpose(1, 2)
    k = torch.randn(1, tokens, KV_HEADS, HEAD_DIM, device=dev, dtype=bf16).transpose(1, 2)
    angles = torch.arange(tokens, device=dev)[:, None] * torch.rand(HEAD_DIM // 2, device=dev)
    cos, sin = (torch.cat([f(angles)] * 2, -1)[None].to(bf16) for f in (torch.cos, torch.sin))
    gate, up = (torch.randn(tokens, INTERMEDIATE, device=dev, dtype=bf16) for _ in range(2))
    packed, state = bnbf.quantize_4bit(torch.randn(INTERMEDIATE, HIDDEN, device=dev, dtype=bf16), blocksize=64,
                                       compress_statistics=True, quant_type="nf4")
    a = torch.randn(16, HIDDEN, device=dev, dtype=bf16) * 0.01
    b = torch.randn(INTERMEDIATE, 16, device=dev, dtype=bf16) * 0.01

    def peft_style(t, a_, b_):  # what PEFT's Linear4bit computes: bitsandbytes' 4-bit matmul plus the LoRA term
        return bnb.matmul_4bit(t, packed.t(), quant_state=state) + (t @ a_.t() @ b_.t()) * 2.0

    cases = [
        ("rms_norm (fwd+bwd)", lambda t, w: rms_norm(t, w, 1e-5),
         lambda t, w: torch.func.functional_call(norm, {"weight": w}, (t,)), (x, norm.weight)),
        ("rope q+k (fwd+bwd)", lambda q_, k_: apply_rotary(q_, k_, cos, sin),
         lambda q_, k_: apply_rotary_pos_emb(q_, k_, cos, sin), (q, k)),
        ("swiglu (fwd+bwd)", swiglu, swiglu_reference, (gate, up)),
        (f"lora_linear_4bit {HIDDEN}->{INTERMEDIATE} (fwd+bwd)", lambda t, a_, b_: lora_linear_4bit(t, packed, state, a_, b_, 2.0),
         lambda t, a_, b_: peft_style(t, a_, b_), (x, a, b)),
    ]
    rows = []
    for name, ours, eager, inputs in cases:
        ours_step, ours_out = fwd_bwd(ours, *inputs)
        eager_step, eager_out = fwd_bwd(eager, *inputs)
        rows.append((name, time_ms(ours_step, repeats), time_ms(eager_step, repeats),
                     (ours_out.float() - eager_out.float()).abs().max().item()))
    ours_ms = time_ms(lambda: dequantize_nf4(packed, state), repeats)
    bnb_ms = time_ms(lambda: bnbf.dequantize_4bit(packed, state), repeats)
    diff = (dequantize_nf4(packed, state).float() - bnbf.dequantize_4bit(packed, state).float()).abs().max().item()
    rows.append((f"dequantize_nf4 {INTERMEDIATE}x{HIDDEN} (vs bitsandbytes)", ours_ms, bnb_ms, diff))
    return rows


def layer_row(tokens: int, repeats: int) -> tuple[str, float, float, float]:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from maximus.kernels.triton import install_triton_kernels, uninstall_triton_kernels

    config = LlamaConfig(vocab_size=1024, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=1,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rope_theta=500000.0)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=quant, dtype=torch.bfloat16,
                                                     device_map={"": DEVICE}, attn_implementation="sdpa")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                             task_type="CAUSAL_LM")).train()
    ids = torch.randint(0, 1024, (1, tokens), device=DEVICE)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    with torch.no_grad():
        eager_logits = model(input_ids=ids).logits.float()
    eager_ms = time_ms(step, repeats)
    install_triton_kernels(model)
    with torch.no_grad():
        ours_logits = model(input_ids=ids).logits.float()
    ours_ms = time_ms(step, repeats)
    uninstall_triton_kernels(model)
    return (f"8B-shaped QLoRA layer step, {tokens} tokens", ours_ms, eager_ms,
            (ours_logits - eager_logits).abs().max().item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 tokens, 5 repeats")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    fail_fast()
    tokens, repeats = (512, 5) if args.quick else (args.tokens, args.repeats)
    rows = kernel_rows(tokens, repeats) + [layer_row(tokens, repeats)]
    print(f"\n{torch.cuda.get_device_name()}, bf16, {tokens} tokens, median of {repeats}\n")
    print("| what | Triton (ms) | eager (ms) | speed-up | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for name, ours_ms, eager_ms, diff in rows:
        print(f"| {name} | {ours_ms:.3f} | {eager_ms:.3f} | {eager_ms / ours_ms:.2f}x | {diff:.2e} |")


if __name__ == "__main__":
    main()
