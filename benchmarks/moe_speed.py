"""Mixture-of-experts step speed on CPU: Maximus' grouped expert forward against Transformers' own
experts forwards, side by side in one process.

One random model of a real MoE class (default: Mixtral shape, `--hidden 512`, `--experts 8`, top-2,
expert intermediate `--intermediate 1024`, `--layers 2`, fp32), loaded by `maximus.load_model` with
LoRA as Maximus trains it (r=16 on every linear layer and, through PEFT's `target_parameters`, on
every expert's fused `gate_up_proj` / `down_proj`; the router frozen). The sides share that model
and the same `--batch x --seq` token batch, and alternate over `--repeats` rounds (the side that
goes first rotates from round to round):

- `eager`: Transformers' eager experts forward (`experts_implementation="eager"`: a loop over the
  experts hit, `torch.where` per expert), PEFT folding each adapter into the expert weights;
- `grouped_mm`: Transformers' default here (`torch._grouped_mm` over expert-sorted tokens), PEFT
  folding the adapters the same way;
- `maximus`: `maximus.kernels.grouped_experts` installed: one matmul per expert over its routed
  tokens, the adapters kept factored (no merged expert weights, no weight-sized gradients).

Timed per side: a training step's forward + backward (the loss with the router loss, as the
trainer computes it), and the MoE blocks alone (forward + backward of every layer's MoE block on
the layer's real input, as a share of the step). The loss of each side is printed: they must agree
to float32 rounding. Medians and [min, max] over the rounds, and the ratios of the medians, in wall-clock
seconds and in the process's CPU seconds (one thread: the CPU time leaves out the time other
programs held the core, so it is the steadier figure on a loaded machine).

    python benchmarks/moe_speed.py [--family mixtral|qwen3_moe|gpt_oss] [--hidden 512] [--intermediate 1024]
        [--experts 8] [--top-k 2] [--native] [--loop] [--layers 2] [--batch 2] [--seq 1024] [--repeats 5] [--threads 1]

`--native` takes the family's own routing instead (Mixtral 8 experts top-2, Qwen3-MoE 128 top-8,
gpt-oss 32 top-4, with the released models' expert intermediate / hidden ratio). `--loop` runs
Maximus' side on its fallback path, one matmul per expert, instead of `torch._grouped_mm`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIDES = ("eager", "grouped_mm", "maximus")
# `--native`: each family's own routing, from its released configs: experts, top-k, and the expert
# intermediate size as a multiple of the hidden size (Mixtral-8x7B 14336 / 4096, Qwen3-30B-A3B
# 768 / 2048, gpt-oss-20b 2880 / 2880).
NATIVE = {"mixtral": (8, 2, 3.5), "qwen3_moe": (128, 8, 0.375), "gpt_oss": (32, 4, 1.0)}


def build_model_dir(path: Path, args) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(None, vocab_size=300)
    experts = {"mixtral": dict(num_local_experts=args.experts, intermediate_size=args.intermediate),
               "qwen3_moe": dict(num_experts=args.experts, moe_intermediate_size=args.intermediate,
                                 intermediate_size=args.intermediate, head_dim=args.hidden // 8),
               "gpt_oss": dict(num_local_experts=args.experts, intermediate_size=args.intermediate,
                               head_dim=args.hidden // 8, sliding_window=args.seq)}[args.family]
    config = AutoConfig.for_model(args.family, vocab_size=len(tok), hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=args.seq * 2,
                                  num_experts_per_tok=args.top_k, router_aux_loss_coef=0.01,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                                  **experts)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return path


def use_side(model, side: str, attention: str) -> None:
    """Put `model`'s experts and attention on one side's forwards: Maximus' grouped experts and the
    attention `load_model` chose (`attention`: SDPA, or SDPA with a sink key for gpt-oss), or
    Transformers' experts forward `side` and Transformers' own attention (SDPA where the class
    has it, else eager: gpt-oss's attention with sinks)."""
    from maximus.kernels.grouped_experts import install_grouped_experts, uninstall_grouped_experts
    from maximus.structure import causal_lm_of

    lm = causal_lm_of(model)
    uninstall_grouped_experts(model)
    if side == "maximus":
        assert install_grouped_experts(model), "no experts module was routed"
        lm.set_attn_implementation(attention)
    else:
        lm.set_experts_implementation(side)
        lm.set_attn_implementation("sdpa" if type(lm)._supports_sdpa else "eager")


def moe_blocks(model):
    from maximus.structure import causal_lm_of

    return [layer.mlp for layer in causal_lm_of(model).model.layers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="mixtral", choices=["mixtral", "qwen3_moe", "gpt_oss"])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table of one Maximus step")
    ap.add_argument("--loop", action="store_true",
                    help="Maximus' side on its fallback loop of one matmul per expert instead of torch._grouped_mm")
    ap.add_argument("--native", action="store_true",
                    help="the family's own routing: its expert count, top-k and intermediate/hidden ratio "
                         "(overrides --experts, --top-k and --intermediate)")
    args = ap.parse_args()
    if args.native:
        args.experts, args.top_k, ratio = NATIVE[args.family]
        args.intermediate = round(args.hidden * ratio)
    torch.set_num_threads(args.threads)
    if args.loop:
        import maximus.kernels.grouped_experts as grouped

        grouped._grouped_mm_takes = lambda *tensors, sizes: False

    from maximus.config import Config
    from maximus.forward import sft_loss_sum
    from maximus.models import load_model
    from maximus.structure import causal_lm_of

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp) / "model", args)
        cfg = Config.from_dict({"model": str(model_dir), "dataset": "unused.jsonl", "method": "lora", "device": "cpu",
                                "lora": {"r": args.rank, "alpha": 2 * args.rank},
                                "training": {"dtype": "fp32", "seq_len": args.seq}})
        model, _ = load_model(cfg)
    model.train()
    attention = causal_lm_of(model).config._attn_implementation
    with torch.no_grad():  # trained adapters: B != 0, so the adapters change the experts' outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    params = [p for p in model.parameters() if p.requires_grad]

    # The MoE blocks' real inputs, captured once (the same for every side: routing is side-independent).
    blocks = moe_blocks(model)
    inputs = []
    hooks = [b.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for b in blocks]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()

    def step() -> float:
        loss_sum, count = sft_loss_sum(model, batch, metrics={})
        loss = loss_sum / count
        torch.autograd.grad(loss, params)
        return loss.item()

    def blocks_only() -> None:
        for block, x in zip(blocks, inputs):
            x = x.clone().requires_grad_(True)
            out = block(x)
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.grad(out.sum(), [x] + [p for p in block.parameters() if p.requires_grad])

    kinds = ("step", "moe", "step_cpu", "moe_cpu")
    times = {s: {k: [] for k in kinds} for s in SIDES}
    losses = {}
    for side in SIDES:  # warm-up, not timed; the loss of each side
        use_side(model, side, attention)
        losses[side] = step()

    def timed(side: str, key: str, fn) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        times[side][key].append(time.perf_counter() - wall)
        times[side][key + "_cpu"].append(time.process_time() - cpu)

    if args.profile:
        use_side(model, "maximus", attention)
        with torch.profiler.profile() as prof:
            step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    for r in range(args.repeats):
        for side in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:  # interleaved, the first side rotating
            use_side(model, side, attention)
            timed(side, "step", step)
            timed(side, "moe", blocks_only)
    tokens = args.batch * args.seq
    print(f"attention: maximus {attention}, Transformers "
          f"{'sdpa' if type(causal_lm_of(model))._supports_sdpa else 'eager'}")
    print(f"{args.family}: hidden {args.hidden}, {args.experts} experts top-{args.top_k}, expert intermediate "
          f"{args.intermediate}, {args.layers} layers, {tokens} tokens, LoRA r={args.rank} on all linears + experts, "
          f"fp32, {args.threads} thread(s), {args.repeats} rounds, load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")

    def cell(values) -> str:
        return f"{statistics.median(values):.3f} s [{min(values):.3f}, {max(values):.3f}]"

    for side in SIDES:
        t = times[side]
        print(f"  {side:>10}: loss {losses[side]:.6f}  step {cell(t['step'])} (CPU {cell(t['step_cpu'])})"
              f"  MoE blocks {cell(t['moe'])} (CPU {cell(t['moe_cpu'])})")
    ours = {k: statistics.median(times["maximus"][k]) for k in kinds}
    for side in ("eager", "grouped_mm"):
        theirs = {k: statistics.median(times[side][k]) for k in kinds}
        ratio = {k: theirs[k] / ours[k] for k in kinds}
        print(f"  maximus vs {side}: step {ratio['step']:.2f}x (CPU {ratio['step_cpu']:.2f}x), "
              f"MoE blocks {ratio['moe']:.2f}x (CPU {ratio['moe_cpu']:.2f}x)")
    print(f"  |loss maximus - eager| = {abs(losses['maximus'] - losses['eager']):.2e}")

if __name__ == "__main__":
    main()
