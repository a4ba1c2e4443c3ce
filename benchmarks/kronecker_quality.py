"""Quality of Kronecker Sketching attention vs exact (SDPA) attention, trained side by side.

Two experiments, each run twice from the same random init, on the same batches in the same order:

1. Language modelling on long real text: Python standard-library sources (one file per document,
   concatenated), byte-level BPE (vocab 2048), a small random-init Llama. Reports held-out
   cross-entropy (nats/token) of each model on the same held-out files (files never trained on),
   the sketch model also with its attention swapped back to exact SDPA, and wall time.
2. Needle retrieval: random filler tokens, a marker + key + value placed early (outside the
   detail window of the last query), the marker + key repeated at the end; the model must
   predict the value. Loss on the final prediction only; reports held-out accuracy.

Usage:
    python benchmarks/kronecker_quality.py --quick        # ~10 min single-thread CPU (400 LM + 250 needle steps)
    python benchmarks/kronecker_quality.py --lm-steps 600 --needle-steps 600

Prints a markdown table (ratios: sketch / exact). CPU, fp32, one thread by default.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import platform
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from maximus.attention import install_kronecker
from maximus.config import KroneckerConfig
from maximus.data.tiny_tokenizer import build_tiny_tokenizer

STDLIB_GLOB = "/root/.pyenv/versions/3.11.7/lib/python3.11/*.py"


def stdlib_token_streams(vocab_size: int, held_out_every: int, max_chars: int):
    """(tokenizer, train ids [n] long, held-out ids [m] long) from the stdlib sources.

    Files are sorted by name; every `held_out_every`-th file is held out. The tokenizer is
    trained on the training files only. Documents are joined with the EOS token.
    """
    paths = sorted(glob.glob(STDLIB_GLOB))
    texts = [open(p, encoding="utf-8", errors="replace").read() for p in paths]
    train_txt = [t for i, t in enumerate(texts) if i % held_out_every != 0]
    held_txt = [t for i, t in enumerate(texts) if i % held_out_every == 0]
    train_txt = _cap(train_txt, max_chars)
    held_txt = _cap(held_txt, max_chars // 8)
    tok = build_tiny_tokenizer(_cap(train_txt, 2_000_000), vocab_size=vocab_size)

    def encode(docs):
        ids = []
        for d in docs:
            ids.extend(tok(d, add_special_tokens=False)["input_ids"])
            ids.append(tok.eos_token_id)
        return torch.tensor(ids, dtype=torch.long)

    return tok, encode(train_txt), encode(held_txt)


def _cap(texts, max_chars):
    out, n = [], 0
    for t in texts:
        if n >= max_chars:
            break
        out.append(t[: max_chars - n])
        n += len(out[-1])
    return out


def make_model(vocab, args, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=8192,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def sketch_settings(args):
    return KroneckerConfig(detail_tokens=args.detail_tokens, sketch_slots=args.sketch_slots, block=args.block)


def lm_batches(ids, seq, batch, steps, seed):
    """Fixed list of [batch, seq] windows at random offsets (same for both models)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq - 1, (steps, batch), generator=g)
    return [torch.stack([ids[s:s + seq] for s in row.tolist()]) for row in starts]


def train(model, batches, lr, loss_fn):
    """AdamW on every parameter (the sketches included); returns (wall seconds, last-10 mean loss)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / len(batches))))
    model.train()
    losses = []
    t0 = time.perf_counter()
    for b in batches:
        loss = loss_fn(model, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return time.perf_counter() - t0, sum(losses[-10:]) / len(losses[-10:])


def lm_loss(model, b):
    return model(input_ids=b, labels=b).loss


@torch.no_grad()
def held_out_loss(model, ids, seq, max_windows):
    """Mean next-token cross-entropy (nats/token) over consecutive non-overlapping windows."""
    model.eval()
    n = min(max_windows, (len(ids) - 1) // seq)
    total, count = 0.0, 0
    for w in range(n):
        x = ids[w * seq:(w + 1) * seq].unsqueeze(0)
        logits = model(input_ids=x).logits[0, :-1].float()
        total += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += seq - 1
    return total / count


def with_attention(model, impl):
    model.set_attn_implementation(impl)
    return model


# ---- needle -----------------------------------------------------------------------------------
MARKER = 1
KEY0, N_KEYS = 10, 32
VAL0, N_VALS = 50, 32
FILL0 = 100


def needle_batch(batch, seq, vocab, g, needle_max_pos):
    """[batch, seq] tokens; the needle (marker, key, value) sits at a random position
    < needle_max_pos, the query (marker, key) ends the sequence; target: the value.

    Several distractor pairs (other keys) are also planted so the model has to match the key."""
    x = torch.randint(FILL0, vocab, (batch, seq), generator=g)
    keys = torch.randint(0, N_KEYS, (batch,), generator=g)
    vals = torch.randint(0, N_VALS, (batch,), generator=g)
    for i in range(batch):
        pos = torch.randperm(needle_max_pos - 3, generator=g)[:1].item()
        x[i, pos:pos + 3] = torch.tensor([MARKER, KEY0 + keys[i].item(), VAL0 + vals[i].item()])
        x[i, -2:] = torch.tensor([MARKER, KEY0 + keys[i].item()])
    return x, VAL0 + vals


def needle_loss(model, b):
    x, y = b
    return F.cross_entropy(model(input_ids=x, logits_to_keep=1).logits[:, -1].float(), y)


@torch.no_grad()
def needle_accuracy(model, batches):
    model.eval()
    hit, n = 0, 0
    for x, y in batches:
        pred = model(input_ids=x, logits_to_keep=1).logits[:, -1].argmax(-1)
        hit += (pred == y).sum().item()
        n += len(y)
    return hit / n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the default sizes below (~10 min, 1 thread)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lm-steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-windows", type=int, default=24)
    p.add_argument("--max-chars", type=int, default=3_000_000)
    p.add_argument("--detail-tokens", type=int, default=256)
    p.add_argument("--sketch-slots", type=int, default=16)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--needle-seq", type=int, default=1024)
    p.add_argument("--needle-max-pos", type=int, default=384,
                   help="needle placed before this position: >= seq - detail_tokens tokens from the query")
    p.add_argument("--needle-steps", type=int, default=250)
    p.add_argument("--needle-batch", type=int, default=4)
    p.add_argument("--needle-eval", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-lm", action="store_true")
    p.add_argument("--skip-needle", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []

    if not args.skip_lm:
        t0 = time.perf_counter()
        tok, train_ids, held_ids = stdlib_token_streams(2048, 10, args.max_chars)
        vocab = len(tok)
        print(f"tokenised in {time.perf_counter() - t0:.0f}s: vocab {vocab}, train {len(train_ids):,} tokens, "
              f"held-out {len(held_ids):,} tokens", flush=True)
        batches = lm_batches(train_ids, args.seq, args.batch, args.lm_steps, args.seed)
        res = {}
        for name in ("exact", "sketch"):
            model = make_model(vocab, args, args.seed)
            if name == "sketch":
                install_kronecker(model, sketch_settings(args))
            secs, train_loss = train(model, batches, args.lr, lm_loss)
            loss = held_out_loss(model, held_ids, args.seq, args.eval_windows)
            res[name] = dict(secs=secs, train=train_loss, held=loss)
            if name == "sketch":
                res[name]["held_as_exact"] = held_out_loss(with_attention(model, "sdpa"), held_ids, args.seq,
                                                           args.eval_windows)
            print(f"lm {name}: {res[name]}", flush=True)
        e, s = res["exact"], res["sketch"]
        rows.append(("LM held-out loss (nats/token)", f"{e['held']:.4f}", f"{s['held']:.4f}",
                     f"{s['held'] / e['held']:.3f}x ({100 * (s['held'] / e['held'] - 1):+.1f} %)"))
        rows.append(("LM held-out loss, sketch model run with exact attention", f"{e['held']:.4f}",
                     f"{s['held_as_exact']:.4f}", f"{s['held_as_exact'] / e['held']:.3f}x"))
        rows.append(("LM train loss (last 10 steps)", f"{e['train']:.4f}", f"{s['train']:.4f}",
                     f"{s['train'] / e['train']:.3f}x"))
        rows.append(("LM training wall time (s)", f"{e['secs']:.0f}", f"{s['secs']:.0f}",
                     f"{s['secs'] / e['secs']:.2f}x"))

    if not args.skip_needle:
        vocab = 512
        g = torch.Generator().manual_seed(args.seed + 1)
        train_b = [needle_batch(args.needle_batch, args.needle_seq, vocab, g, args.needle_max_pos)
                   for _ in range(args.needle_steps)]
        eval_b = [needle_batch(16, args.needle_seq, vocab, g, args.needle_max_pos)
                  for _ in range(max(1, args.needle_eval // 16))]
        res = {}
        for name in ("exact", "sketch"):
            model = make_model(vocab, args, args.seed)
            if name == "sketch":
                install_kronecker(model, sketch_settings(args))
            secs, train_loss = train(model, train_b, args.lr, needle_loss)
            res[name] = dict(secs=secs, train=train_loss, acc=needle_accuracy(model, eval_b))
            print(f"needle {name}: {res[name]}", flush=True)
        e, s = res["exact"], res["sketch"]
        chance = 1 / N_VALS
        rows.append((f"needle accuracy (chance {chance:.3f})", f"{e['acc']:.3f}", f"{s['acc']:.3f}", ""))
        rows.append(("needle final train loss (chance ln 32 = 3.466)", f"{e['train']:.3f}", f"{s['train']:.3f}", ""))
        rows.append(("needle training wall time (s)", f"{e['secs']:.0f}", f"{s['secs']:.0f}",
                     f"{s['secs'] / e['secs']:.2f}x"))

    print(f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.1f}")
    print("| measure | exact (SDPA) | Kronecker sketch | sketch / exact |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
