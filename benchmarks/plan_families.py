"""Predicted vs measured peak memory of every family of the matrix at long sequences (CPU).

For each family of `maximus.families`' test matrix (tests/tiny.py `FAMILY_FIELDS`: 2 layers,
hidden 64, 4/2 heads, vocabulary 300, the matrix's own sliding windows and soft-caps) and each
sequence length and checkpointing mode, one real `maximus.Trainer` run of 2 LoRA steps
(r 4, fp32, batch 1, one document cut to exactly seq_len tokens per row, no packing) reports
run.json `plan.peak_bytes` (the planner) against `memory.peak_bytes` (the CPU meter). At these
lengths the heads x tokens x tokens attention tensors are the largest terms, so the rows check
the attention coefficients where they matter.

    python benchmarks/plan_families.py                                   # 11 families x 1024, 2048 x off, full
    python benchmarks/plan_families.py --families gemma3_text olmo2 --lengths 1024 --checkpointing off
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the family matrix's models


def measure(model_type: str, seq_len: int, checkpointing: str, work: Path) -> tuple[int, int]:
    """(predicted, measured) peak bytes of one run."""
    from tiny import build_family_model_dir, long_run_config, measured_run, write_long_documents

    from maximus import Config

    model_dir = work / f"model-{model_type}"
    if not model_dir.exists():
        build_family_model_dir(model_dir, model_type, max_position_embeddings=max(4096, 2 * seq_len))
    data = work / f"text-{seq_len}.jsonl"
    if not data.exists():
        write_long_documents(data, seq_len, rows=4)
    out = work / f"run-{model_type}-{seq_len}-{checkpointing}"
    predicted, measured, _ = measured_run(Config.from_dict(long_run_config(model_dir, data, out, seq_len, checkpointing)))
    return predicted, measured


def main() -> None:
    import torch

    from tiny import FAMILY_FIELDS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILY_FIELDS), choices=list(FAMILY_FIELDS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    ap.add_argument("--checkpointing", nargs="+", default=["off", "full"], choices=["off", "full", "selective"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print("| family | seq | checkpointing | predicted MiB | measured MiB | error |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.families:
            for seq_len in args.lengths:
                for checkpointing in args.checkpointing:
                    start = time.perf_counter()
                    predicted, measured = measure(model_type, seq_len, checkpointing, Path(tmp))
                    error = predicted / measured - 1
                    rows.append({"family": model_type, "seq_len": seq_len, "checkpointing": checkpointing,
                                 "predicted_bytes": predicted, "measured_bytes": measured, "error": error,
                                 "seconds": time.perf_counter() - start})
                    print(f"| {model_type} | {seq_len} | {checkpointing} | {predicted / 2**20:,.1f} | "
                          f"{measured / 2**20:,.1f} | {error:+.1%} |", flush=True)
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"worst |error|: {abs(worst['error']):.1%} ({worst['family']}, seq {worst['seq_len']}, "
          f"{worst['checkpointing']})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
