"""Matryoshka embeddings: does a 64-d prefix keep the retrieval quality of the full hidden state?

Retrieval set from real text: for every function with a docstring in Python's standard library
(``lib/python3.11/*.py``, parsed with ``ast``), the query is the docstring's first paragraph and
the document is the function's source without its docstring. Files are split by name into
training files (language-model data) and held-out files (retrieval pairs), so no evaluated
function was seen in training.

Two Llama-architecture models, same random init, same tokenizer, same batches in the same order,
are trained as plain next-token LMs on the training files: main loss = exact chunked CE
(``linear_cross_entropy``), and for the others main + prefix losses through
``cross_entropy_with_matryoshka`` (dims 64/128/256, weight 0.2; 256 is skipped when it is the full
width), one model per ``--token-fractions`` value. Then queries and
documents are embedded with ``maximus.embed`` (mean pooling) and recall@10 is measured with the
64-d prefix, the 128-d prefix, the full vector, and coarse-to-fine (64-d shortlist of 100,
full-width rerank). Also measured: search time and index memory over >= 100k vectors (synthetic,
timing only), and the auxiliary loss's cost in step time and peak memory (side by side, same
batch, alternating).

Contrastive mode (``--mode contrastive``): the models are trained as embedding models with
``objective: contrastive`` (``maximus.train.objectives.contrastive.ContrastiveObjective``: in-batch InfoNCE on
mean- or last-pooled final hidden states) on the docstring -> function pairs of the *training*
files; one without and one (or more) with the Matryoshka prefixes (``optimization.matryoshka``);
same init, same batches in the same order. Evaluated on the same held-out pairs as above. The
LM auxiliary loss's cost is also measured on the reference model shape
(``--reference-cost``: vocab 128,256, hidden 512, 8 layers, LoRA r=16, batch 1 x 512 tokens).

    python benchmarks/matryoshka_retrieval.py --quick     # smoke run, < 3 min on 2 CPU cores
    python benchmarks/matryoshka_retrieval.py --mode contrastive --quick
    python benchmarks/matryoshka_retrieval.py --mode cost --cost-seqs 512,2048 --token-fractions 1,0.125,0.0625 --threads 1
        # only the LM auxiliary loss's step cost on the reference model (without / separate / shared)
    python benchmarks/matryoshka_retrieval.py --train-docs paired --steps 1500 --threads 1 --cost-reps 5
        # the numbers in docs/benchmarks/matryoshka.md (~21 min on 1 CPU thread)
"""
from __future__ import annotations

import argparse
import ast
import copy
import glob
import inspect
import math
import os
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from maximus.data.tiny_tokenizer import build_tiny_tokenizer
from maximus.embed import exact_search, nested_prefix, pooled_hidden_states, search
from maximus.losses.linear_cross_entropy import linear_cross_entropy
from maximus.losses.matryoshka import cross_entropy_with_matryoshka, separate_matryoshka_loss_sum
from maximus.memory.meter import MemoryMeter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STDLIB = os.path.dirname(os.__file__)
DIMS = [64, 128, 256]
WEIGHT = 0.2


# ------------------------------------------------------------------------------------- data
@dataclass
class Pair:
    query: str     # first paragraph of the docstring
    document: str  # the function's source, docstring removed


def is_heldout(path: str) -> bool:
    """About one file in five is held out for retrieval (stable: by a hash of the file name)."""
    return zlib.crc32(os.path.basename(path).encode()) % 5 == 0


def function_pairs(source: str, max_doc_chars: int) -> list[Pair]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        query = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
        if len(query.split()) < 4:
            continue
        body = node.body[1:] or [ast.Pass()]
        stripped = copy.copy(node)
        stripped.body, stripped.decorator_list = body, []
        document = ast.unparse(stripped)
        if len(document) < 60:
            continue
        pairs.append(Pair(query, document[:max_doc_chars]))
    return pairs


def load_corpus(max_doc_chars: int, train_docs: str = "raw") -> tuple[list[str], list[Pair], list[str]]:
    """(training texts, held-out retrieval pairs (unique queries and documents), held-out texts).

    train_docs="raw": the training files' source as is. "paired": one training text per function
    of the training files, "<docstring first paragraph>\n<source without docstring>", i.e. the
    same pairing as the retrieval set, so the LM sees docstring and code side by side (held-out
    files still give the evaluated pairs)."""
    train_texts, heldout_texts, pairs = [], [], []
    for path in sorted(glob.glob(os.path.join(STDLIB, "*.py"))):
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        if is_heldout(path):
            heldout_texts.append(text)
            pairs.extend(function_pairs(text, max_doc_chars))
        elif train_docs == "paired":
            train_texts.extend(f"{p.query}\n{p.document}" for p in function_pairs(text, max_doc_chars))
        else:
            train_texts.append(text)
    return train_texts, unique_pairs(pairs), heldout_texts


def training_pairs(max_doc_chars: int) -> list[Pair]:
    """Unique docstring -> function pairs of the training files (never a held-out file)."""
    pairs = []
    for path in sorted(glob.glob(os.path.join(STDLIB, "*.py"))):
        if not is_heldout(path):
            pairs.extend(function_pairs(Path(path).read_text(encoding="utf-8", errors="replace"), max_doc_chars))
    return unique_pairs(pairs)


def unique_pairs(pairs: list[Pair]) -> list[Pair]:
    """Pairs in order, skipping any whose query or document was seen before."""
    seen_q, seen_d, unique = set(), set(), []
    for p in pairs:
        if p.query not in seen_q and p.document not in seen_d:
            seen_q.add(p.query)
            seen_d.add(p.document)
            unique.append(p)
    return unique


def token_windows(tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    """All texts tokenized, joined by EOS, cut into [num_windows, seq_len] rows."""
    stream = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(tokenizer.eos_token_id)
    n = len(stream) // seq_len
    return torch.tensor(stream[:n * seq_len]).view(n, seq_len)


# ------------------------------------------------------------------------------------- model
def build_model(vocab_size: int, args, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=args.hidden // 64, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def step_loss(model, ids: torch.Tensor, matryoshka: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backprop, main CE mean), the trainer's recipe: sums divided by the token count.
    ``matryoshka``: None = main loss only, else the auxiliary loss's token fraction."""
    hidden = model.model(input_ids=ids).last_hidden_state
    target = torch.full_like(ids, -100)
    target[:, :-1] = ids[:, 1:]
    weight = model.lm_head.weight
    count = (target != -100).sum()
    if matryoshka is None:
        main = linear_cross_entropy(hidden, weight, target, reduction="sum")
        return main / count, main.detach() / count
    total = cross_entropy_with_matryoshka(hidden, weight, target, dims=DIMS, weight=WEIGHT, token_fraction=matryoshka)
    with torch.no_grad():
        main = linear_cross_entropy(hidden, weight, target, reduction="sum")
    return total / count, main / count


def train(model, windows: torch.Tensor, args, matryoshka: bool) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    model.train()
    start, last = time.perf_counter(), []
    for step in range(args.steps):
        rows = torch.arange(step * args.batch, (step + 1) * args.batch) % windows.shape[0]
        loss, main = step_loss(model, windows[rows], matryoshka)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        last.append(main.item())
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"  step {step + 1}/{args.steps} train CE {statistics.mean(last[-10:]):.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    return {"seconds": time.perf_counter() - start, "final_train_ce": statistics.mean(last[-10:])}


@torch.no_grad()
def heldout_ce(model, windows: torch.Tensor, dims: list[int | None]) -> dict:
    """Held-out next-token CE (nats/token) using the first d hidden dims (None = full)."""
    hidden = model.model(input_ids=windows).last_hidden_state
    target = torch.full_like(windows, -100)
    target[:, :-1] = windows[:, 1:]
    w = model.lm_head.weight
    return {d: linear_cross_entropy(hidden if d is None else hidden[..., :d], w if d is None else w[:, :d],
                                    target).item() for d in dims}


def recall_at_k(query_vecs, doc_vecs, k=10, **search_kwargs) -> float:
    """Fraction of queries whose own document (same row) is in the top k."""
    if search_kwargs:
        _, idx = search(query_vecs, doc_vecs, k=k, **search_kwargs)
    else:
        _, idx = exact_search(query_vecs, doc_vecs, k=k)
    truth = torch.arange(query_vecs.shape[0])[:, None]
    return (idx == truth).any(dim=1).float().mean().item()


def retrieval(model, tokenizer, pairs: list[Pair], args, pooling: str = "mean") -> dict:
    kw = dict(pooling=pooling, batch_size=16, max_length=args.doc_tokens)
    q = pooled_hidden_states(model, tokenizer, [p.query for p in pairs], **kw)
    d = pooled_hidden_states(model, tokenizer, [p.document for p in pairs], **kw)
    out = {}
    for dim in (64, 128, None):
        out[dim or "full"] = recall_at_k(nested_prefix(q, dim), nested_prefix(d, dim))
    out["64->full"] = recall_at_k(nested_prefix(q, None), nested_prefix(d, None), shortlist_dim=64, shortlist=100)
    return out


# ------------------------------------------------------------------------------------- costs
def aux_cost(model, windows: torch.Tensor, args) -> dict:
    """Step time (forward + backward + AdamW, same batch, alternating without/with the auxiliary
    loss, median) and peak tensor memory of one step (MemoryMeter, after the optimizer state exists)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = windows[:args.batch]

    def one_step(aux):
        loss, _ = step_loss(model, ids, aux)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    variants = {False: None, True: args.token_fractions[0]}
    one_step(variants[True])  # warm-up: optimizer state, allocator, lazy inits
    times = {False: [], True: []}
    for _ in range(args.cost_reps):
        for aux, fraction in variants.items():
            t = time.perf_counter()
            one_step(fraction)
            times[aux].append(time.perf_counter() - t)
    peaks = {}
    for aux, fraction in variants.items():
        meter = MemoryMeter("cpu")
        with meter.track(model, opt):
            one_step(fraction)
        peaks[aux] = meter.peak_bytes()
    return {"time": {a: statistics.median(t) for a, t in times.items()}, "peak": peaks}


def loss_only_cost(num_tokens: int, hidden: int, vocab: int, reps: int, fraction: float = 1.0) -> dict:
    """Forward + backward of the main chunked CE alone vs. main + Matryoshka, at a real model's
    head shape (the aux loss only touches the head, so this is its cost next to the main loss)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(num_tokens, hidden, generator=g).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, generator=g)).requires_grad_()
    t = torch.randint(0, vocab, (num_tokens,), generator=g)
    times = {False: [], True: []}
    for _ in range(reps):
        for aux in (False, True):
            start = time.perf_counter()
            if aux:
                loss = cross_entropy_with_matryoshka(h, w, t, dims=DIMS, weight=WEIGHT, token_fraction=fraction)
            else:
                loss = linear_cross_entropy(h, w, t, reduction="sum")
            loss.backward()
            h.grad = w.grad = None
            times[aux].append(time.perf_counter() - start)
    return {a: statistics.median(v) for a, v in times.items()}


def search_cost(num_vectors: int, width: int, num_queries: int, reps: int) -> dict:
    """Median seconds to search num_queries queries (k=10) over num_vectors synthetic unit vectors."""
    g = torch.Generator().manual_seed(0)
    index = nested_prefix(torch.randn(num_vectors, width, generator=g), None)
    queries = nested_prefix(torch.randn(num_queries, width, generator=g), None)
    prefix = nested_prefix(index, 64)
    q64 = nested_prefix(queries, 64)
    runs = {"full": lambda: exact_search(queries, index, k=10),
            "64": lambda: exact_search(q64, prefix, k=10),
            "64->full": lambda: search(queries, index, k=10, shortlist_dim=64, shortlist=100, index_prefix=prefix)}
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {"seconds": {n: statistics.median(v) for n, v in times.items()},
            "bytes": {"full": index.numel() * 4, "64": prefix.numel() * 4}}


# ------------------------------------------------------------------------------------- contrastive mode
def contrastive_objective(args, weight: float | None):
    """The trainer's ContrastiveObjective, built from a real Config (weight None = no Matryoshka)."""
    from maximus.config import Config
    from maximus.train.objectives.contrastive import ContrastiveObjective

    opt = {"matryoshka": {"dims": DIMS, "weight": weight}} if weight is not None else {}
    cfg = Config.from_dict({"model": "benchmark", "dataset": "stdlib", "objective": "contrastive",
                            "optimization": opt,
                            "contrastive": {"temperature": args.temperature, "pooling": args.pooling}})
    return ContrastiveObjective(cfg, {"micro_batch_size": args.batch}, pad_token_id=0)


def contrastive_rows(tokenizer, pairs: list[Pair], max_tokens: int) -> list[dict]:
    """Rows as `build_datasets(objective="contrastive")` makes them (maximus.data.pairs)."""
    from maximus.data.formats import PairExample
    from maximus.data.pairs import encode_pair, fit_pair_row

    rows = []
    for p in pairs:
        row = encode_pair(tokenizer, PairExample(p.query, p.document, "stdlib"))
        if row is not None:
            rows.append(fit_pair_row(row, max_tokens)[0])
    return rows


def train_contrastive(model, rows: list[dict], args, objective) -> dict:
    """AdamW + warmup/cosine; step = one micro-batch of `args.batch` pairs (in-batch negatives),
    loss = objective.loss_sum / pairs, as the trainer computes it. Batch order: per-epoch
    permutations from `args.seed`, identical for every model."""
    from maximus.data import collate

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    per_epoch = len(rows) // args.batch
    orders: dict[int, torch.Tensor] = {}
    model.train()
    start, last, times = time.perf_counter(), [], []
    for step in range(args.steps):
        epoch, pos = divmod(step, per_epoch)
        if epoch not in orders:
            orders[epoch] = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        idx = orders[epoch][pos * args.batch:(pos + 1) * args.batch]
        batch = collate([rows[int(i)] for i in idx], pad_token_id=0)
        t = time.perf_counter()
        loss_sum, metrics = objective.loss_sum(model, batch)
        (loss_sum / len(idx)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        last.append(loss_sum.item() / len(idx))
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"  step {step + 1}/{args.steps} loss {statistics.mean(last[-10:]):.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    return {"seconds": time.perf_counter() - start, "final_loss": statistics.mean(last[-10:]),
            "median_step_s": statistics.median(times)}


def contrastive_step_cost(model, rows: list[dict], args, reps: int) -> dict:
    """Median step time (fwd + bwd + AdamW) of the same batch without / with the Matryoshka
    prefixes, alternating."""
    from maximus.data import collate

    batch = collate(rows[:args.batch], pad_token_id=0)
    objectives = {False: contrastive_objective(args, None), True: contrastive_objective(args, args.weights[0])}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = {False: [], True: []}
    for rep in range(reps + 1):
        for aux, obj in objectives.items():
            t = time.perf_counter()
            loss, _ = obj.loss_sum(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rep:  # rep 0 warms up
                times[aux].append(time.perf_counter() - t)
    return {a: statistics.median(v) for a, v in times.items()}


def reference_aux_cost(seq_len: int, reps: int, fractions: list[float] = (1.0,), separate: bool = True,
                       memory: bool = False) -> dict:
    """The LM auxiliary loss on the reference model shape (vocab 128,256, hidden 512, 8
    layers), LoRA r=16 on all linear layers (frozen head), bf16 weights, batch 1 x seq_len random
    tokens: median step time (fwd + bwd + AdamW) of the trainer's `sft_loss_sum` without / with
    `optimization.matryoshka` (dims 64/128/256, weight 0.2) at each token fraction, and (with
    ``separate``) the previous implementation (one chunked CE per prefix added to the main loss),
    all alternating in one loop. With ``memory``, also the peak tensor memory of one step each."""
    from peft import LoraConfig, get_peft_model

    from _reference_model import build_reference_model
    from maximus.config import MatryoshkaConfig
    from maximus.forward import hidden_states, output_head, shift_labels, sft_loss_sum, token_loss_sum

    model = get_peft_model(build_reference_model(torch.bfloat16),
                           LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128256, (1, seq_len), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}

    def loss_of(variant):
        if variant == "separate":  # the implementation before the shared pass, for comparison
            hidden = hidden_states(model, ids)
            target = shift_labels(ids)
            head = output_head(model)
            loss = token_loss_sum(hidden, head, target) + separate_matryoshka_loss_sum(
                hidden, head.weight, target, dims=DIMS, weight=WEIGHT)
            return loss, (target != -100).sum()
        mat = None if variant == "without" else MatryoshkaConfig(dims=DIMS, weight=WEIGHT, token_fraction=variant)
        return sft_loss_sum(model, batch, matryoshka=mat)

    def step(variant) -> float:
        t = time.perf_counter()
        loss, n = loss_of(variant)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    variants = ["without"] + (["separate"] if separate else []) + list(fractions)
    for v in variants:  # warm-up
        step(v)
    times = {v: [] for v in variants}
    for _ in range(reps):
        for v in variants:
            times[v].append(step(v))
    out = {"time": {v: statistics.median(t) for v, t in times.items()}}
    if memory:
        out["peak"] = {}
        for v in variants:
            meter = MemoryMeter("cpu")
            with meter.track(model, opt):
                step(v)
            out["peak"][v] = meter.peak_bytes()
    return out


def print_reference_cost(ref: dict, seq_len: int, reps: int) -> None:
    t, peak = ref["time"], ref.get("peak")
    base = t["without"]
    print(f"\n## Cost of the LM auxiliary loss on the reference model shape, 1 x {seq_len} tokens (median of {reps})\n")
    print("LoRA training step (fwd + bwd + AdamW), vocab 128,256, hidden 512, 8 layers; dims 64/128/256, weight 0.2\n")
    print("| variant | step s | ratio to without | cost |" + (" peak MiB | peak ratio |" if peak else ""))
    print("|---|---|---|---|" + ("---|---|" if peak else ""))
    for v, sec in t.items():
        name = {"without": "without", "separate": "separate passes (before)"}.get(v) or f"shared, token_fraction {v:g}"
        row = f"| {name} | {sec:.3f} | {sec / base:.3f} | {sec / base - 1:+.1%} |"
        if peak:
            row += f" {peak[v] / 2**20:.0f} | {peak[v] / peak['without']:.3f} |"
        print(row)


def cost_main(args) -> int:
    """``--mode cost``: only the reference-shape step cost, at each ``--cost-seqs`` length."""
    t0 = time.perf_counter()
    for seq_len in args.cost_seqs:
        ref = reference_aux_cost(seq_len, args.cost_reps, args.token_fractions, memory=args.memory)
        print_reference_cost(ref, seq_len, args.cost_reps)
        print(f"({time.perf_counter() - t0:.0f} s so far)", flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"argv: {' '.join(sys.argv[1:])}")
    return 0


def contrastive_main(args) -> int:
    t0 = time.perf_counter()
    train_texts, heldout, _ = load_corpus(max_doc_chars=args.doc_tokens * 6, train_docs="paired")
    heldout = [heldout[i] for i in torch.randperm(len(heldout), generator=torch.Generator().manual_seed(args.seed))[:args.pairs]]
    train_pairs = training_pairs(args.doc_tokens * 6)
    tokenizer = build_tiny_tokenizer(train_texts, vocab_size=args.vocab)
    rows = contrastive_rows(tokenizer, train_pairs, args.doc_tokens)
    epochs = args.steps * args.batch / len(rows)
    print(f"corpus: {len(rows)} training pairs (training files), {len(heldout)} held-out pairs, vocab {len(tokenizer)}, "
          f"{args.steps} steps x {args.batch} pairs = {epochs:.1f} epochs, pooling {args.pooling}, "
          f"temperature {args.temperature} ({time.perf_counter() - t0:.0f} s)", flush=True)

    results = {"untrained": {"retrieval": retrieval(build_model(len(tokenizer), args, args.seed).eval(), tokenizer,
                                                    heldout, args, args.pooling)}}
    variants = [("contrastive", None)] + [(f"contrastive + Matryoshka (weight {w:g})", w) for w in args.weights]
    for name, weight in variants:
        print(f"training {name}", flush=True)
        model = build_model(len(tokenizer), args, args.seed)
        info = train_contrastive(model, rows, args, contrastive_objective(args, weight))
        results[name] = {"train": info, "retrieval": retrieval(model, tokenizer, heldout, args, args.pooling)}
        print(f"  {name}: recall@10 {results[name]['retrieval']} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"measuring costs ({time.perf_counter() - t0:.0f} s)", flush=True)
    step_cost = contrastive_step_cost(model, rows, args, args.cost_reps)
    ref = (reference_aux_cost(args.reference_seq, args.cost_reps, args.token_fractions)
           if args.reference_cost else None)

    print(f"\n## Contrastive retrieval: recall@10, {len(heldout)} docstring -> function pairs (held-out stdlib files)\n")
    print(f"{args.pooling} pooling, temperature {args.temperature}, dims {DIMS} (those < {args.hidden}), "
          f"{args.steps} steps x {args.batch} pairs (in-batch negatives), lr {args.lr}\n")
    print("| model | 64-d | 128-d | full (%d-d) | 64-d / full | 64-d shortlist -> full rerank | final train loss | median step s |" % args.hidden)
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        rec, tr = r["retrieval"], r.get("train", {})
        ratio = rec[64] / rec["full"] if rec["full"] else float("nan")
        loss = f"{tr['final_loss']:.3f}" if tr else "-"
        med = f"{tr['median_step_s']:.3f}" if tr else "-"
        print(f"| {name} | {rec[64]:.3f} | {rec[128]:.3f} | {rec['full']:.3f} | {ratio:.0%} | {rec['64->full']:.3f} | {loss} | {med} |")
    print(f"\n(chance = {10 / len(heldout):.3f})")
    print(f"\n## Cost of the Matryoshka prefixes in contrastive training (same batch, alternating, median of {args.cost_reps})\n")
    print("| what | without | with | ratio |")
    print("|---|---|---|---|")
    print(f"| contrastive step, {args.batch} pairs, s | {step_cost[False]:.3f} | {step_cost[True]:.3f} | {step_cost[True] / step_cost[False]:.3f} |")
    if ref is not None:
        print_reference_cost(ref, args.reference_seq, args.cost_reps)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"argv: {' '.join(sys.argv[1:])}")
    return 0


def print_retrieval(results: dict, pairs: list[Pair], heldout: torch.Tensor, args) -> None:
    print(f"\n## Retrieval: recall@10, {len(pairs)} docstring -> function pairs (held-out stdlib files)\n")
    print("| model | 64-d | 128-d | full (%d-d) | 64-d / full | 64-d shortlist -> full rerank | held-out CE full | CE with 64-d prefix | train s |" % args.hidden)
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        rec, ce = r["retrieval"], r["ce"]
        ratio = rec[64] / rec["full"] if rec["full"] else float("nan")
        secs = f"{r['train']['seconds']:.0f}" if "train" in r else "-"
        print(f"| {name} | {rec[64]:.3f} | {rec[128]:.3f} | {rec['full']:.3f} | {ratio:.0%} | {rec['64->full']:.3f} "
              f"| {ce[None]:.3f} | {ce[64]:.3f} | {secs} |")
    print(f"\n(chance = {10 / len(pairs):.3f}; CE in nats/token on {heldout.numel():,} held-out tokens)")


# ------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (< 3 min on 2 CPU cores)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per model")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--pairs", type=int, default=1000, help="held-out retrieval pairs")
    parser.add_argument("--doc-tokens", type=int, default=128, help="tokens kept per query / document")
    parser.add_argument("--index-size", type=int, default=100_000, help="vectors in the timing index")
    parser.add_argument("--cost-reps", type=int, default=7, help="alternating timed steps per variant")
    parser.add_argument("--search-reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-docs", choices=["raw", "paired"], default="raw",
                        help="LM data: raw training-file source, or docstring + function source texts")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--mode", choices=["lm", "contrastive", "cost"], default="lm",
                        help="train next-token LMs (+ LM auxiliary loss) or contrastive embedding models, or "
                             "only time the LM auxiliary loss on the reference model (cost)")
    parser.add_argument("--pooling", choices=["mean", "last"], default="mean", help="contrastive mode: pooling")
    parser.add_argument("--temperature", type=float, default=0.05, help="contrastive mode: InfoNCE temperature")
    parser.add_argument("--weights", type=lambda s: [float(x) for x in s.split(",")], default=[1.0],
                        help="contrastive mode: Matryoshka weights, one model each (comma-separated)")
    parser.add_argument("--reference-cost", action="store_true",
                        help="contrastive mode: also time the LM auxiliary loss on the reference model")
    parser.add_argument("--reference-seq", type=int, default=512, help="tokens of the reference-model step")
    parser.add_argument("--token-fractions", type=lambda s: [float(x) for x in s.split(",")], default=[1.0],
                        help="LM auxiliary loss token fractions: one LM each (lm mode; the first is timed), "
                             "one timed variant each (cost, --reference-cost)")
    parser.add_argument("--cost-seqs", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048],
                        help="cost mode: sequence lengths of the reference-model step")
    parser.add_argument("--memory", action="store_true", help="cost mode: also the peak tensor memory per variant")
    parser.add_argument("--no-costs", action="store_true", help="lm mode: skip the cost and search sections")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.pairs, args.vocab, args.doc_tokens = 6, 150, 1024, 64
        args.cost_reps, args.search_reps, args.reference_seq = 3, 1, 128
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.mode == "contrastive":
        return contrastive_main(args)
    if args.mode == "cost":
        if args.quick:
            args.cost_seqs = [128]
        return cost_main(args)
    t0 = time.perf_counter()

    train_texts, pairs, heldout_texts = load_corpus(max_doc_chars=args.doc_tokens * 6, train_docs=args.train_docs)
    pairs = [pairs[i] for i in torch.randperm(len(pairs), generator=torch.Generator().manual_seed(args.seed))[:args.pairs]]
    tokenizer = build_tiny_tokenizer(train_texts, vocab_size=args.vocab)
    windows = token_windows(tokenizer, train_texts, args.seq_len)
    windows = windows[torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(args.seed))]
    heldout = token_windows(tokenizer, heldout_texts, args.seq_len)[:32]
    print(f"corpus: {len(train_texts)} training texts ({args.train_docs}), {windows.numel():,} training tokens "
          f"(steps use {args.steps * args.batch * args.seq_len:,}), {len(pairs)} held-out pairs, "
          f"vocab {len(tokenizer)} ({time.perf_counter() - t0:.0f} s)", flush=True)

    results = {}
    untrained = build_model(len(tokenizer), args, args.seed).eval()
    results["untrained"] = {"retrieval": retrieval(untrained, tokenizer, pairs, args),
                            "ce": heldout_ce(untrained, heldout, [64, None])}
    variants = [("plain LM", None)] + [(f"LM + Matryoshka (token_fraction {f:g})", f) for f in args.token_fractions]
    for name, aux in variants:
        print(f"training {name}", flush=True)
        model = build_model(len(tokenizer), args, args.seed)
        info = train(model, windows, args, aux)
        results[name] = {"train": info, "retrieval": retrieval(model, tokenizer, pairs, args),
                         "ce": heldout_ce(model, heldout, [64, None])}
        print(f"  {name}: recall@10 {results[name]['retrieval']}, held-out CE {results[name]['ce']}, "
              f"{info['seconds']:.0f} s", flush=True)
        if aux is not None and aux == args.token_fractions[0]:
            cost_model = model
    if args.no_costs:
        print_retrieval(results, pairs, heldout, args)
        return 0
    print(f"measuring costs ({time.perf_counter() - t0:.0f} s)", flush=True)
    cost = aux_cost(cost_model, windows, args)
    head_shape = (512, 1024, 16000) if args.quick else (1024, 2048, 32000)  # tokens, hidden, vocab
    head_cost = loss_only_cost(*head_shape, reps=2 if args.quick else 3, fraction=args.token_fractions[0])
    timing = {w: search_cost(args.index_size, w, 64, args.search_reps) for w in (args.hidden, 4096)}

    print_retrieval(results, pairs, heldout, args)

    t, p = cost["time"], cost["peak"]
    print(f"\n## Cost of the auxiliary loss (dims {DIMS}, weight {WEIGHT}), side by side\n")
    print("| what | without | with | ratio |")
    print("|---|---|---|---|")
    print(f"| training step, benchmark model ({args.batch}x{args.seq_len} tokens), median s | {t[False]:.3f} | {t[True]:.3f} | {t[True] / t[False]:.3f} |")
    print(f"| peak tensor memory of a step, MiB | {p[False] / 2**20:.1f} | {p[True] / 2**20:.1f} | {p[True] / p[False]:.3f} |")
    print(f"| head only: CE fwd+bwd, {head_shape[0]} tokens, H={head_shape[1]}, V={head_shape[2]}, median s | {head_cost[False]:.3f} | {head_cost[True]:.3f} | {head_cost[True] / head_cost[False]:.3f} |")
    flop = lambda v, h, params: 6 * v * sum(d for d in DIMS if d < h) / (6 * params)
    print(f"\nAux matmul FLOPs of the separate passes (before the shared pass) as a share of a training step's 6*params FLOPs per token: benchmark model "
          f"{flop(len(tokenizer), args.hidden, sum(x.numel() for x in cost_model.parameters())):.1%}, "
          f"Llama-3-8B (V=128256, H=4096, 8.03e9 params) {flop(128256, 4096, 8.03e9):.2%}.")

    print(f"\n## Search over {args.index_size:,} vectors, 64 queries, k=10 (median of {args.search_reps})\n")
    print("| width | index MiB full | index MiB 64-d | full s | 64-d s | speed-up | 64-d shortlist 100 -> full rerank s |")
    print("|---|---|---|---|---|---|---|")
    for w, r in timing.items():
        s, b = r["seconds"], r["bytes"]
        print(f"| {w} | {b['full'] / 2**20:.0f} | {b['64'] / 2**20:.0f} | {s['full']:.3f} | {s['64']:.3f} "
              f"| {s['full'] / s['64']:.1f}x | {s['64->full']:.3f} |")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"argv: {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
