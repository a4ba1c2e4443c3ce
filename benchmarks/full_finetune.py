"""Full fine-tuning with each optimizer, side by side: peak memory (the meter),
tokens/s, held-out loss at 25 / 50 / 100 % of the steps, and the planner's prediction.

Each variant is a real `maximus-train` run (`Trainer`) of the reference model shape
(`_reference_model.py`: 128,256-token vocabulary, hidden 512; `--layers` decoder layers) on the
built-in reverse-words task, packed into rows of `--seq` tokens, fp32 on the CPU, the same seed
and data order for every variant. The variants run one after the other in round-robin order of
`--repeats`; figures are the median over repeats.

    python benchmarks/full_finetune.py --seq 256 --steps 16 --layers 8 --out docs/benchmarks/full_finetune.json

`--alone --only NAME --rows FILE` runs one variant per process (several side by side, each row
appended as it finishes); `--table FILE` prints the markdown of those rows. `--progress DIR...` prints, for run directories
kept with `--keep` (finished or still running), the steps done, the peak of the metered steps so
far, the median tokens/s and every held-out loss logged so far.

Markdown for docs/benchmarks/full_finetune.md is printed at the end.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_IN_BACKWARD = {"optimizer_in_backward": True, "max_grad_norm": None}
#: The lowest-memory setting: APOLLO-Mini, 4-bit moments for embedding and head (stepped row block
#: by row block where their gradients are formed), the step inside the backward, every layer
#: recomputed and 64-token loss chunks.
BEST = "apollo_mini, 4-bit embedding, in backward, recompute"

#: name -> training.* settings of the variant (all full fine-tuning); an "optimization" entry
#: holds optimization.* settings.
VARIANTS = {
    "adamw": {"optimizer": "adamw"},
    "adamw_8bit": {"optimizer": "adamw_8bit"},
    "adamw_4bit": {"optimizer": "adamw_4bit"},
    "adam_mini": {"optimizer": "adam_mini"},
    "muon": {"optimizer": "muon"},
    "galore": {"optimizer": "galore"},
    "apollo": {"optimizer": "apollo"},
    "apollo_mini": {"optimizer": "apollo_mini"},
    "apollo_mini + in backward": {"optimizer": "apollo_mini", **_IN_BACKWARD},
    "adamw + in backward": {"optimizer": "adamw", **_IN_BACKWARD},
    "apollo_mini, 4-bit embedding + in backward": {"optimizer": "apollo_mini", "embedding_optimizer": "adamw_4bit",
                                                   **_IN_BACKWARD},
    BEST: {"optimizer": "apollo_mini", "embedding_optimizer": "adamw_4bit", **_IN_BACKWARD,
           "optimization": {"gradient_checkpointing": "full", "loss_chunk_size": 64}},
    "adamw_4bit, in backward, recompute": {"optimizer": "adamw_4bit", **_IN_BACKWARD,
                                           "optimization": {"gradient_checkpointing": "full", "loss_chunk_size": 64}},
    "adamw_8bit_torchao, in backward (clipped), recompute": {
        "optimizer": "adamw_8bit_torchao", "optimizer_in_backward": True,
        "optimization": {"gradient_checkpointing": "full", "loss_chunk_size": 64}},
    "adamw, bf16 weights (SR)": {"optimizer": "adamw", "master_weights": "bf16"},
    "adamw, fp32 master, bf16 compute": {"optimizer": "adamw", "dtype": "bf16"},
}


def model_dir(layers: int, work: Path) -> Path:
    """The reference shape with `layers` decoder layers (the cached 8-layer one when 8)."""
    from _reference_model import REFERENCE_CONFIG, SEED, reference_model_dir

    ref = reference_model_dir()
    if layers == REFERENCE_CONFIG["num_hidden_layers"]:
        return ref
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = work / f"reference-{layers}-layers"
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**{**REFERENCE_CONFIG, "num_hidden_layers": layers})).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(ref)).save_pretrained(str(out))
    return out


def run_variant(name: str, model: Path, work: Path, args) -> dict:
    from maximus import Config, Trainer

    out = work / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    shutil.rmtree(out, ignore_errors=True)
    variant = dict(VARIANTS[name])
    optimization = {"gradient_checkpointing": "off", **variant.pop("optimization", {})}
    training = {"batch_size": args.batch, "micro_batch_size": args.batch, "max_steps": args.steps,
                "learning_rate": args.lr, "warmup_steps": 0, "scheduler": "constant", "seq_len": args.seq,
                "dtype": "fp32", "seed": 0, "optimizer_rank": args.rank, **variant}
    cfg = Config.from_dict({
        "model": str(model), "dataset": "builtin:reverse-words", "method": "full", "output_dir": str(out),
        "device": "cpu", "optimization": optimization, "training": training,
        "eval": {"split": 0.05, "before": False, "every": max(1, args.steps // 4), "max_batches": args.eval_batches},
        "logging": {"progress": "none"}})
    t0 = time.perf_counter()
    summary = Trainer(cfg).train()
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and r.get("loss") is not None]
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    evals[args.steps] = summary["eval"]["after"].get("loss")
    timed = steps[1:] or steps  # the first step compiles (torchao) and warms caches
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    peak = summary["memory"]["peak_bytes"]
    predicted = summary["plan"]["peak_bytes"]
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return {"variant": name, "peak_bytes": peak, "predicted_bytes": predicted, "tokens_per_s": tps,
            "eval": {str(k): v for k, v in sorted(evals.items())}, "wall_s": wall,
            "final_train_loss": steps[-1]["loss"] if steps else None}


def markdown(results: dict[str, dict], args) -> str:
    base = results["adamw"]
    quarter = [str(max(1, args.steps // 4) * k) for k in (1, 2)] + [str(args.steps)]
    lines = ["| variant | peak | x AdamW | predicted | pred / meas | tokens/s | x AdamW | "
             f"held-out loss @ {' / '.join(quarter)} steps | final vs AdamW |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        ev = [r["eval"].get(q) for q in quarter]
        final, ref = ev[-1], base["eval"].get(quarter[-1])
        lines.append(
            f"| {name} | {r['peak_bytes'] / 2**20:,.0f} MiB | {r['peak_bytes'] / base['peak_bytes']:.2f} | "
            f"{r['predicted_bytes'] / 2**20:,.0f} MiB | {r['predicted_bytes'] / r['peak_bytes']:.3f} | "
            f"{r['tokens_per_s']:,.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
            f"{' / '.join(f'{v:.4f}' if v is not None else '-' for v in ev)} | "
            f"{(final / ref - 1) * 100:+.1f} % |" if final and ref else "-")
    return "\n".join(lines)


def progress(run_dir: Path) -> dict:
    """What a kept run directory holds so far (the run may still be going): steps done, the peak
    of its metered steps, the plan's prediction, the median tokens/s from step 2 on, the held-out
    losses by step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("loss") is not None]
    plan = json.loads((run_dir / "plan.json").read_text())["plan"]
    timed = steps[1:] or steps
    return {"run": run_dir.name, "steps": len(steps),
            "peak_bytes": max((r.get("peak_memory_bytes") or 0 for r in steps), default=0),
            "predicted_bytes": plan["peak_bytes"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed) if timed else None,
            "eval": {r["step"]: r["eval_loss"] for r in rows if r.get("eval_loss") is not None},
            "train_loss": {r["step"]: r["loss"] for r in steps}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--rank", type=int, default=None, help="projection rank for galore / apollo (default theirs)")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", nargs="*", help="variants to run (default all)")
    p.add_argument("--out", type=Path, help="JSON of all results at the end")
    p.add_argument("--keep", type=Path, help="keep each variant's run directory under this folder")
    p.add_argument("--rows", type=Path, help="JSON lines: each variant's result appended as it finishes")
    p.add_argument("--alone", action="store_true",
                   help="run exactly the --only variants (no AdamW baseline): one process per variant, "
                        "their --rows gathered by --table")
    p.add_argument("--table", type=Path, help="print the markdown of a --rows file and exit")
    p.add_argument("--progress", type=Path, nargs="+", help="print what kept run directories hold so far and exit")
    args = p.parse_args(argv)
    if args.progress:
        for run_dir in args.progress:
            print(json.dumps(progress(run_dir)))
        return 0
    if args.table:
        rows = [json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]
        args.steps = rows[0]["steps"]
        print(markdown({r["variant"]: r for r in rows}, args))
        return 0
    import torch

    names = args.only or list(VARIANTS)
    if "adamw" not in names and not args.alone:
        names = ["adamw"] + names
    work = args.keep or Path(tempfile.mkdtemp(prefix="full_finetune_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = model_dir(args.layers, work)
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for _ in range(args.repeats):
            for name in names:  # round-robin: a loaded machine slows every variant alike
                runs[name].append(run_variant(name, model, work, args))
                print(json.dumps(runs[name][-1]), flush=True)
                if args.rows:
                    with args.rows.open("a") as f:
                        f.write(json.dumps({**runs[name][-1], "steps": args.steps, "seq": args.seq,
                                            "layers": args.layers}) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results = {}
    for name, rs in runs.items():
        r = dict(rs[len(rs) // 2])
        r["tokens_per_s"] = statistics.median(x["tokens_per_s"] for x in rs)
        results[name] = r
    meta = {"command": "python benchmarks/full_finetune.py " + " ".join(argv or sys.argv[1:]),
            "machine": f"{platform.machine()} {torch.get_num_threads()} threads, {platform.platform()}",
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    if "adamw" in results:  # --alone without AdamW: the rows file holds the result
        print(markdown(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
