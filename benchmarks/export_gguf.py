"""GGUF export of the reference model (docs/benchmarks/reference.md shape, vocab 128,256), measured in llama.cpp.

A real user path, end to end: LoRA-tune the reference model on `builtin:reverse-words` (so its
held-out perplexity means something: the random base sits near the vocabulary size), export it
with `maximus export --format gguf` at f16, q8_0, q4_0 and q4_k_m, then score the same held-out
records in llama.cpp (llama-cpp-python) and in Transformers (the merged fp32 model). Reports file
size, export time, held-out perplexity and top-1 agreement with Transformers per quant.

    flock /tmp/bench.lock python benchmarks/export_gguf.py --steps 80 --out /tmp/export-bench
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _reference_model import reference_model_dir  # noqa: E402


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def score(logits_of, records: list[list[int]]) -> tuple[float, list[np.ndarray]]:
    """Held-out perplexity over every predicted token of every record, and the argmax rows."""
    nll, count, argmax = 0.0, 0, []
    for ids in records:
        logits = logits_of(ids).astype(np.float64)
        logp = _log_softmax(logits[:-1])
        nll -= logp[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
        argmax.append(logits[:-1].argmax(-1))
    return math.exp(nll / count), argmax


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--heldout", type=int, default=200, help="held-out records")
    parser.add_argument("--out", default="/tmp/maximus-export-bench")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="base model directory (default: the reference model)")
    args = parser.parse_args()
    import llama_cpp

    from maximus import Config, Trainer
    from maximus.builtin import reverse_words_records
    from maximus.export import export_gguf, load_tuned

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.model) if args.model else reference_model_dir()
    run = out / "run"
    if not (run / "run.json").is_file():
        data = out / "train.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in reverse_words_records(4000, seed=0)))
        cfg = Config.from_dict({
            "model": str(base), "dataset": {"path": str(data), "format": "prompt_completion"}, "method": "lora",
            "output_dir": str(run), "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
            "optimization": {"target_vram": None, "gradient_checkpointing": "off"},
            "training": {"batch_size": 16, "micro_batch_size": 16, "max_steps": args.steps, "learning_rate": 3e-3,
                         "warmup_steps": 10, "seq_len": 64, "packing": True, "dtype": "fp32", "log_every": 20},
            "eval": {"split": 0.02, "before": False}, "logging": {"progress": "none"}})
        t = time.perf_counter()
        Trainer(cfg).train()
        print(f"fine-tune: {args.steps} steps in {time.perf_counter() - t:.0f} s")

    model, tokenizer = load_tuned(run, merge=True)
    heldout = [r["prompt"] + r["completion"] for r in reverse_words_records(args.heldout, seed=12345)]
    records = [tokenizer(text)["input_ids"] for text in heldout]

    def hf_logits(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].double().numpy()

    hf_ppl, hf_top = score(hf_logits, records)
    hf_top = np.concatenate(hf_top)
    n_tokens = sum(len(r) - 1 for r in records)
    rows = [("Transformers (merged, fp32)", "-", "-", hf_ppl, "-")]
    for quant in ("f16", "q8_0", "q4_0", "q4_k_m"):
        path = out / f"reference-{quant}.gguf"
        t = time.perf_counter()
        export_gguf(run, path, quant=quant, overwrite=True)
        seconds = time.perf_counter() - t
        llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=args.threads, logits_all=True, verbose=False)

        def llama_logits(ids, llm=llm):
            llm.reset()
            llm.eval(ids)
            return np.array(llm.scores[: len(ids)])

        ppl, top = score(llama_logits, records)
        llm.close()
        agree = float((np.concatenate(top) == hf_top).mean())
        rows.append((f"llama.cpp {quant}", f"{path.stat().st_size / 2**20:.1f}", f"{seconds:.1f}", ppl, f"{agree:.1%}"))
    print(f"held-out: {len(records)} records, {n_tokens} predicted tokens; threads {args.threads}")
    print("| model | file MiB | export s (load + merge + write) | held-out perplexity | top-1 = Transformers |")
    print("|---|---|---|---|---|")
    for name, size, seconds, ppl, agree in rows:
        print(f"| {name} | {size} | {seconds} | {ppl:.4f} | {agree} |")


if __name__ == "__main__":
    main()
