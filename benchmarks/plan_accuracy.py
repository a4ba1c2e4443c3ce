"""Predicted vs measured peak memory of real training steps on CPU (issue 5, "Accuracy on CPU").

For each setting (method x seq_len x checkpointing x loss mode) this builds the reference model
of shared/ANCHORS.md with plain Transformers + PEFT + bitsandbytes, runs one warm-up step (so
the optimizer state exists, as in every later step), then measures one full step (forward,
backward, optimizer step, zero_grad) with `maximus.memory.MemoryMeter` and compares it with
`maximus.memory.estimate_peak(..., device="cpu")`.

    python benchmarks/plan_accuracy.py            # 12 settings on the reference model
    python benchmarks/plan_accuracy.py --quick    # 8 settings on a smaller model, < 2 min
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from maximus.memory import MemoryMeter, estimate_peak, measure_step_peak

try:  # the lean loss lands in maximus.losses (another issue); skip its column without it
    from maximus.losses.linear_cross_entropy import linear_cross_entropy
except ImportError:  # pragma: no cover
    linear_cross_entropy = None

REFERENCE = dict(vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                 tie_word_embeddings=False, rope_theta=500000.0)
SMALL = dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
             tie_word_embeddings=False, rope_theta=500000.0)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(config: LlamaConfig, method: str, dtype: str, checkpointing: str, lora_r: int, saved_dir: str | None):
    """The model for one setting: full (all weights trainable), LoRA or QLoRA (NF4, double quant)."""
    torch.manual_seed(0)
    if method == "qlora":
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=DTYPES[dtype])
        model = AutoModelForCausalLM.from_pretrained(saved_dir, quantization_config=quant, dtype=DTYPES[dtype])
    else:
        model = LlamaForCausalLM(config).to(DTYPES[dtype])
    if method != "full":
        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear"))
    if checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def loss_of(model, ids: torch.Tensor, loss_mode: str) -> torch.Tensor:
    if loss_mode == "naive":
        return model(input_ids=ids, labels=ids).loss
    # exact: the decoder's hidden states, then the chunked loss against the head's weight
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = causal_lm.model(input_ids=ids).last_hidden_state
    return linear_cross_entropy(hidden[:, :-1], causal_lm.lm_head.weight, ids[:, 1:])


def measure(config: LlamaConfig, *, method: str, dtype: str, seq_len: int, checkpointing: str, loss_mode: str,
            micro_batch: int = 1, lora_r: int = 16, saved_dir: str | None = None) -> tuple[int, dict, float]:
    """Measured peak bytes, breakdown and seconds of one steady-state training step."""
    model = build(config, method, dtype, checkpointing, lora_r, saved_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        loss_of(model, ids, loss_mode).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    peak, meter = measure_step_peak(step, model, optimizer, device="cpu")  # warm-up step + measured step
    seconds = (time.perf_counter() - start) / 2
    breakdown = meter.breakdown(model, optimizer)
    del model, optimizer
    gc.collect()
    return peak, breakdown, seconds


def meter_overhead(config: LlamaConfig, seq_len: int = 512, repeats: int = 7) -> tuple[float, float]:
    """Median seconds of one LoRA training step without and with `MemoryMeter.track` (CPU),
    alternating the two so that machine noise hits both alike."""
    import statistics

    model = build(config, "lora", "bf16", "off", 16, None)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        loss_of(model, ids, "naive").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    meter = MemoryMeter("cpu")
    step()
    plain, tracked = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        with meter.track(model, optimizer):
            step()
        tracked.append(time.perf_counter() - start)
    return statistics.median(plain), statistics.median(tracked)


def grid(quick: bool) -> list[dict]:
    settings = []
    seqs = (256, 1024) if quick else (512, 2048)
    for method in ("full", "lora", "qlora"):
        for seq in seqs:
            for ckpt, loss in (("off", "naive"), ("full", "exact")):
                if quick and method == "full" and seq == seqs[1]:
                    continue
                settings.append(dict(method=method, seq_len=seq, checkpointing=ckpt, loss_mode=loss))
    # the other two corners at the long sequence: checkpointing alone and lean loss alone
    settings.append(dict(method="lora", seq_len=seqs[1], checkpointing="full", loss_mode="naive"))
    settings.append(dict(method="qlora", seq_len=seqs[1], checkpointing="off", loss_mode="exact"))
    if not quick:
        settings.append(dict(method="lora", seq_len=seqs[0], checkpointing="off", loss_mode="naive", dtype="fp32"))
        settings.append(dict(method="lora", seq_len=seqs[0], checkpointing="full", loss_mode="exact", micro_batch=2))
    return settings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller model and grid (< 2 min)")
    parser.add_argument("--threshold", type=float, default=0.15, help="goal: |error| within this fraction")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (memory does not depend on it; 1 is fastest on a shared 2-core machine)")
    parser.add_argument("--overhead-only", action="store_true", help="only time the meter's overhead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    plain, tracked = meter_overhead(LlamaConfig(**SMALL))
    print(f"meter overhead (LoRA step, SMALL model, 1 x 512 tokens): {plain:.3f} s plain, {tracked:.3f} s tracked, "
          f"x{tracked / plain:.2f} (medians of 7, alternated)", flush=True)
    if args.overhead_only:
        return 0
    shape = SMALL if args.quick else REFERENCE
    config = LlamaConfig(**shape)
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as saved_dir:
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(saved_dir)  # QLoRA loads from here
        for s in grid(args.quick):
            s = {"dtype": "bf16", "micro_batch": 1, **s}
            if s["loss_mode"] == "exact" and linear_cross_entropy is None:
                continue
            measured, parts, seconds = measure(config, saved_dir=saved_dir, **s)
            est = estimate_peak(config, lora_r=16, device="cpu", **s)
            err = est.peak_bytes / measured - 1
            worst = max(worst, abs(err))
            rows.append((s, measured, est, err, seconds, parts))
            print(f"  {s}: measured {measured / 2**20:.0f} MiB, predicted {est.peak_bytes / 2**20:.0f} MiB "
                  f"({err:+.1%}), step {seconds:.2f} s", flush=True)
    print()
    print(f"model: {'SMALL' if args.quick else 'REFERENCE (ANCHORS.md)'} {shape}")
    print()
    print("| method | dtype | micro-batch x seq | checkpointing | loss | measured peak | predicted peak | error | predicted phase |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s, measured, est, err, seconds, parts in rows:
        print(f"| {s['method']} | {s['dtype']} | {s['micro_batch']} x {s['seq_len']} | {s['checkpointing']} | {s['loss_mode']} "
              f"| {measured / 2**20:.0f} MiB | {est.peak_bytes / 2**20:.0f} MiB | {err:+.1%} | {est.phase} |")
    print()
    ok = worst <= args.threshold
    print(f"worst |error|: {worst:.1%} over {len(rows)} settings (goal <= {args.threshold:.0%}: {'met' if ok else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
