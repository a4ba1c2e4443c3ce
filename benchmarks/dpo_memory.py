"""Peak memory of one DPO step vs one SFT step over the same tokens (goal: DPO <= 1.2x SFT).

Same LoRA model, same 2N rows (N pairs = N chosen + N rejected sequences, padded to one length):
- SFT: `SFTObjective.loss_sum` (exact chunked cross-entropy) + backward;
- DPO (ours): `PreferenceObjective.loss_sum` (reference = adapter off, in no_grad, then the
  policy forward; sequence log-probs through the chunked kernel, no full logits) + backward;
- TRL-style DPO (the usual peer recipe, for scale): a second frozen model copy for the reference
  and full `[rows, T, V]` logits -> log_softmax -> gather for both models.

Memory is counted by `maximus.memory.meter.MemoryMeter` (on CPU: live tensor storages created
during the step). "step" = peak minus what was live before the step (activations, gradients,
temporaries; weights, including the TRL-style reference copy, are not in it), "total" = peak including the
weights. Model: the reference Llama (vocab 128,256, hidden 512, 8 layers) with LoRA r=16
on all linear layers, random weights; `--quick` uses a smaller one.

    python benchmarks/dpo_memory.py [--quick] [--pairs 2] [--seq 1024] [--checkpointing off full]
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def build_model_dir(root: Path, quick: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    if quick:
        shape = dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2)
    else:  # docs/benchmarks/reference.md reference model
        shape = dict(vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=4)
    config = LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=500000.0,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(root / "model"), safe_serialization=True)
    tok.save_pretrained(str(root / "model"))
    (root / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    return root / "model"


def make_rows(pairs: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """Preference rows: a shared prompt of seq/2 tokens, answers filling the rest (rejected a bit shorter)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = seq // 2
    rows = []
    for _ in range(pairs):
        prompt = torch.randint(4, vocab, (prompt_len,), generator=g).tolist()
        row = {}
        for side, answer_len in (("chosen", seq - prompt_len), ("rejected", seq - prompt_len - 7)):
            answer = torch.randint(4, vocab, (answer_len,), generator=g).tolist()
            row[f"{side}_input_ids"] = prompt + answer
            row[f"{side}_labels"] = [-100] * prompt_len + answer
        rows.append(row)
    return rows


def sft_batch(rows: list[dict], pad: int) -> dict:
    """The same 2N sequences as SFT rows, padded to the same length as the DPO batch."""
    from maximus.data import collate

    length = max(len(r[f"{s}_input_ids"]) for r in rows for s in ("chosen", "rejected"))
    sft_rows = [{"input_ids": r[f"{s}_input_ids"], "labels": r[f"{s}_labels"]} for s in ("chosen", "rejected") for r in rows]
    batch = collate(sft_rows, pad)
    assert batch["input_ids"].shape[1] == length
    return batch


def trl_style_loss(policy, reference, batch: dict, beta: float = 0.1) -> torch.Tensor:
    """The common recipe: full logits of both models, log_softmax, gather (the peer baseline)."""
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    pos = torch.cat([batch["chosen_position_ids"], batch["rejected_position_ids"]])

    def logps(model):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, :-1].float()
        target = labels[:, 1:]
        lp = torch.gather(logits.log_softmax(-1), 2, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (lp * (target != -100)).sum(-1)

    with torch.no_grad():
        ref = logps(reference)
    pol = logps(policy)
    n = batch["chosen_input_ids"].shape[0]
    return -F.logsigmoid(beta * ((pol[:n] - ref[:n]) - (pol[n:] - ref[n:]))).sum()


def measure(model, step_fn, extra=()) -> dict:
    """Peak bytes of one forward+backward (the second of two, so lazy buffers exist) and its time."""
    from maximus.memory.meter import MemoryMeter

    result = {}
    for attempt in range(2):
        model.zero_grad(set_to_none=True)
        gc.collect()
        meter = MemoryMeter("cpu")
        with meter.track(model, *extra):
            before = meter.current_bytes()
            meter.reset_peak()
            t0 = time.perf_counter()
            loss = step_fn()
            loss.backward()
            seconds = time.perf_counter() - t0
            del loss
        result = {"step_bytes": meter.peak_bytes() - before, "total_bytes": meter.peak_bytes(), "seconds": seconds}
    return result


def run(args) -> list[dict]:
    import maximus
    from maximus.data import collate
    from maximus.memory.checkpointing import apply_checkpointing
    from maximus.train.objectives.base import SFTObjective
    from maximus.train.objectives.preference import PreferenceObjective

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="dpo_memory_"))
    model_dir = build_model_dir(root, args.quick)
    seq = args.seq or (256 if args.quick else 1024)
    out = []
    for policy in args.checkpointing:
        cfg = maximus.Config.from_dict({
            "model": str(model_dir), "dataset": str(root / "pairs.jsonl"), "method": "lora", "objective": "dpo",
            "device": "cpu", "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
            "optimization": {"target_vram": None, "gradient_checkpointing": policy},
            "training": {"dtype": "fp32", "seq_len": seq}})
        model, tok = maximus.load_model(cfg, device=torch.device("cpu"), method="lora")
        apply_checkpointing(model, policy, budget_bytes=None, micro_batch=2 * args.pairs, seq_len=seq,
                            offload_activations=False)
        model.train()
        plan = {"micro_batch_size": args.pairs, "loss_mode": "exact", "loss_chunk_size": None}
        rows = make_rows(args.pairs, seq, model.config.vocab_size)
        dpo_b, sft_b = collate(rows, tok.pad_token_id), sft_batch(rows, tok.pad_token_id)
        sft = SFTObjective(cfg, plan, tok.pad_token_id)
        dpo = PreferenceObjective(cfg, plan, tok.pad_token_id)
        simpo = PreferenceObjective(cfg.model_copy(update={"dpo": cfg.dpo.model_copy(update={"loss": "simpo"})}),
                                    plan, tok.pad_token_id)
        tokens = int(sft_b["input_ids"].numel())

        def record(name, runs):
            row = {"checkpointing": policy, "objective": name, "rows": 2 * args.pairs, "seq": seq, "tokens": tokens,
                   "step_bytes": statistics.median(r["step_bytes"] for r in runs),
                   "total_bytes": statistics.median(r["total_bytes"] for r in runs),
                   "seconds": statistics.median(r["seconds"] for r in runs)}
            out.append(row)
            print(json.dumps(row), flush=True)  # a killed run keeps what it measured

        steps = {"sft": lambda: sft.loss_sum(model, sft_b)[0], "dpo": lambda: dpo.loss_sum(model, dpo_b)[0],
                 "simpo": lambda: simpo.loss_sum(model, dpo_b)[0]}
        results: dict[str, list] = {name: [] for name in steps}
        for _ in range(args.repeats):  # interleaved, so load changes hit every objective alike
            for name, fn in steps.items():
                results[name].append(measure(model, fn))
        for name, runs in results.items():
            record(name, runs)
        if args.trl:
            reference = copy.deepcopy(model.get_base_model()).requires_grad_(False)
            record("trl_style", [measure(model, lambda: trl_style_loss(model, reference, dpo_b), (reference,))
                                 for _ in range(args.repeats)])
            del reference
        model = None  # free it before the next policy loads its own
        gc.collect()
    return out


def table(rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = ["| checkpointing | objective | rows x seq | step peak (MiB) | x SFT | total peak (MiB) | x SFT | step time (s) | x SFT |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next(b for b in rows if b["checkpointing"] == r["checkpointing"] and b["objective"] == "sft")
        lines.append(f"| {r['checkpointing']} | {r['objective']} | {r['rows']} x {r['seq']} | {r['step_bytes'] / mib:.1f} | "
                     f"{r['step_bytes'] / base['step_bytes']:.2f} | {r['total_bytes'] / mib:.1f} | "
                     f"{r['total_bytes'] / base['total_bytes']:.2f} | {r['seconds']:.2f} | {r['seconds'] / base['seconds']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model and sequences (< 2 min)")
    parser.add_argument("--pairs", type=int, default=2, help="pairs per micro-batch (2x rows)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; 256 with --quick)")
    parser.add_argument("--checkpointing", nargs="+", default=["off", "full"], help="gradient checkpointing policies")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per cell (median)")
    parser.add_argument("--no-trl", dest="trl", action="store_false", help="skip the TRL-style baseline")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = run(args)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
