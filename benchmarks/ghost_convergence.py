"""Convergence: train the same small Llama on real text with the exact loss and with the Ghost
Logit loss, same tokens in the same order, and compare the EXACT held-out loss and wall time.

Data: Python standard-library source files (this interpreter's ``lib/python3.X``), tokenised with
a byte-level BPE tokenizer trained here (``tokenizers``). To make the output layer as large as a
Llama-3 one, the model's vocabulary is padded to ``--vocab`` rows (default 128,256): the padded
rows never occur as targets but the exact softmax still has to push them down, as for a real
large vocabulary with rare tokens.

    python benchmarks/ghost_convergence.py --quick      # about 2 min on 2 cores (few steps)
    python benchmarks/ghost_convergence.py --steps 300  # the recorded run
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from maximus.losses import ghost_logit_loss, linear_cross_entropy


def stdlib_text(max_bytes: int) -> str:
    """Concatenated standard-library sources (sorted paths, test suites skipped), up to max_bytes."""
    root = pathlib.Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    parts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if any(p in ("test", "tests", "idlelib", "site-packages") for p in path.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "\n".join(parts)


def tokenize(text: str, bpe_vocab: int) -> tuple[torch.Tensor, int]:
    tokenizer = ByteLevelBPETokenizer()
    chunks = [text[i:i + 100_000] for i in range(0, len(text), 100_000)]
    tokenizer.train_from_iterator(chunks, vocab_size=bpe_vocab, min_frequency=2, show_progress=False)
    ids = tokenizer.encode(text).ids
    return torch.tensor(ids, dtype=torch.long), tokenizer.get_vocab_size()


def make_model(vocab: int, hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096,
                         tie_word_embeddings=False, rope_theta=500000.0)
    return LlamaForCausalLM(config)


def exact_loss(model, batch: torch.Tensor) -> torch.Tensor:
    hidden = model.model(input_ids=batch[:, :-1]).last_hidden_state
    return linear_cross_entropy(hidden, model.lm_head.weight, batch[:, 1:])


def train(loss_name: str, tokens: torch.Tensor, held_out: list[torch.Tensor], args) -> dict:
    model = make_model(args.vocab, args.hidden, args.layers, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)  # same batches for both losses
    span = args.seq + 1
    start = time.perf_counter()
    curve = []
    for step in range(args.steps):
        offsets = torch.randint(0, tokens.numel() - span, (args.batch,), generator=generator)
        batch = torch.stack([tokens[o:o + span] for o in offsets.tolist()])
        hidden = model.model(input_ids=batch[:, :-1]).last_hidden_state
        if loss_name == "ghost":
            loss = ghost_logit_loss(hidden, model.lm_head.weight, batch[:, 1:],
                                    num_candidates=args.candidates, prefix_dims=args.prefix_dims)
        else:
            loss = linear_cross_entropy(hidden, model.lm_head.weight, batch[:, 1:])
        for group in optimizer.param_groups:  # linear warm-up, then constant
            group["lr"] = args.lr * min(1.0, (step + 1) / 20)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (step + 1) % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            curve.append((step + 1, loss.item()))
            print(f"{loss_name} step {step + 1}: train loss {loss.item():.3f}", flush=True)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        held = sum(exact_loss(model, b).item() for b in held_out) / len(held_out)
    return {"loss": loss_name, "seconds": seconds, "held_out_exact": held, "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps, small text (about 2 min)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=128256, help="output rows (BPE vocabulary padded to this)")
    parser.add_argument("--bpe-vocab", type=int, default=16000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--candidates", type=int, default=1024)
    parser.add_argument("--prefix-dims", type=int, default=64)
    parser.add_argument("--text-bytes", type=int, default=8_000_000)
    parser.add_argument("--held-out-batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.text_bytes = 30, 2_000_000
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ids, bpe_size = tokenize(stdlib_text(args.text_bytes), args.bpe_vocab)
    # Held out: every 20th block of batch x (seq + 1) tokens, spread over the whole corpus (the
    # sorted file order puts similar modules together, so a contiguous tail would be unrepresentative).
    span = args.seq + 1
    block = span * args.batch
    blocks = ids[:ids.numel() // block * block].view(-1, block)
    held_mask = torch.zeros(blocks.shape[0], dtype=torch.bool)
    held_mask[10::20] = True
    held_out = [b.view(args.batch, span) for b in blocks[held_mask][:args.held_out_batches]]
    train_ids = blocks[~held_mask].reshape(-1)
    print(f"{ids.numel()} tokens, BPE vocab {bpe_size}, output rows {args.vocab}, "
          f"tokenizer {time.perf_counter() - t0:.0f} s", flush=True)
    with torch.no_grad():
        init = sum(exact_loss(make_model(args.vocab, args.hidden, args.layers, 0), b).item()
                   for b in held_out) / len(held_out)
    results = [train(name, train_ids, held_out, args) for name in ("exact", "ghost")]
    exact = results[0]
    print()
    print(f"model: Llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} (BPE {bpe_size}); "
          f"{args.steps} steps x {args.batch} x {args.seq} tokens; AdamW lr {args.lr}; "
          f"ghost candidates {args.candidates}, prefix {args.prefix_dims}")
    print(f"held-out exact loss at init: {init:.3f} (ln V = {math.log(args.vocab):.3f})")
    print("| loss | held-out exact loss | vs exact | train wall s | speed vs exact |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['loss']} | {r['held_out_exact']:.4f} | {r['held_out_exact'] / exact['held_out_exact'] - 1:+.2%} | "
              f"{r['seconds']:.1f} | {exact['seconds'] / r['seconds']:.2f}x |")
    print("train-loss curves (step, loss):", {r["loss"]: r["curve"] for r in results})


if __name__ == "__main__":
    main()
