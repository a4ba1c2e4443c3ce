"""Training memory of a vision-language model: `maximus-train` vs TRL's SFTTrainer + PEFT, same run.

Model: a random LLaVA (CLIP tower + 2-layer projector + Llama) built with its processor
(tests/tiny_vlm.py), with a language model where the loss layer and the activations matter:
vocabulary 32,000, hidden 256, 4 layers; the tower: 96 x 96 images, patch 8 (144 image tokens per
image), hidden 64, 4 layers. Data: `--rows` chat rows, each one drawn image (its colour varies) and
the same ~`--text` tokens of question and answer, so every row has the same length (TRL pads
prompts on the left, which would move the positions). Loss on the answer only on both sides.

Same settings on both sides: LoRA r=16 / alpha 32 on the language model's linears (the same
qualified target names: TRL's side takes them from Maximus' adapter_config.json), tower and
projector frozen, fp32, batch `--rows` in one micro-batch, AdamW lr 2e-4, `--steps` steps,
gradient checkpointing on (TRL's default; `gradient_checkpointing: full` for Maximus), seed 0.
Each side is a fresh subprocess (`--worker`), one thread each.

Memory is counted by the same instrument on both sides, `maximus.memory.meter.MemoryMeter` on
CPU (live tensor storages; the CPU counterpart of `torch.cuda.max_memory_allocated`): Maximus'
trainer meters every step (run.json `memory.peak_bytes`), TRL's `trainer.train()` runs inside
`meter.track(model)`. "training peak" = peak - the model's parameters (weights and adapters):
activations, gradients, optimizer state, the loss. The first-step losses are compared too.

    python benchmarks/vlm_memory.py                       # the documented run
    python benchmarks/vlm_memory.py --rounds 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

SEED = 0
LORA_R, LORA_ALPHA, LR = 16, 32, 2e-4
IMAGE, PATCH, VOCAB = 96, 8, 32000


def build_model(root: Path) -> Path:
    """The benchmark LLaVA: tests/tiny_vlm.py's builder, the vocabulary grown to `VOCAB` rows."""
    import torch
    from transformers import LlavaForConditionalGeneration

    from tiny_vlm import build_tiny_llava

    path = build_tiny_llava(root / "llava", image_size=IMAGE, patch=PATCH, hidden=256, vision_hidden=64, layers=4)
    model = LlavaForConditionalGeneration.from_pretrained(path)
    torch.manual_seed(SEED)
    model.resize_token_embeddings(VOCAB, mean_resizing=False)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def filler(n_words: int, offset: int) -> str:
    from tiny_vlm import COLORS

    words = [*COLORS, "picture", "color", "what", "is", "the"]
    return " ".join(words[(offset + k) % len(words)] for k in range(n_words))


def write_rows(root: Path, rows: int, text_words: int) -> tuple[Path, list[dict]]:
    """Chat rows for Maximus (image parts, paths relative to the file) and the same rows as TRL
    prompt-completion records (image paths absolute)."""
    from tiny_vlm import COLORS, QUESTION, draw_image

    (root / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLORS)
    question = f"{QUESTION} {filler(text_words // 2, 0)}"
    answer = filler(text_words - text_words // 2, 3)
    data, trl_rows = root / "data.jsonl", []
    with open(data, "w", encoding="utf-8") as f:
        for k in range(rows):
            image = draw_image(root / "images" / f"{k}.png", names[k % len(names)], (IMAGE, IMAGE))
            user = [{"type": "image", "image": str(image.relative_to(root))}, {"type": "text", "text": question}]
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
                    + "\n")
            trl_rows.append({"image": str(image), "question": question, "answer": answer})
    return data, trl_rows


# ------------------------------------------------------------------------------------ workers
def maximus_worker(args) -> dict:
    import yaml

    from maximus.config import Config
    from maximus.train.trainer import Trainer

    cfg = yaml.safe_load(Path(args.config).read_text())
    Trainer(Config.model_validate(cfg)).train()
    out = Path(cfg["output_dir"])
    run = json.loads((out / "run.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m and m.get("step")]
    targets = json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"]
    mem = run["memory"]
    return {"losses": losses, "peak_bytes": mem["peak_bytes"], "parameters": mem["breakdown"]["parameters"],
            "planned_peak_bytes": run["plan"]["peak_bytes"], "target_modules": targets,
            "plan": {k: run["plan"].get(k) for k in ("micro_batch_size", "grad_accum", "recompute", "loss_mode")}}


def trl_worker(args) -> dict:
    import torch
    from datasets import Dataset
    from PIL import Image
    from peft import LoraConfig, get_peft_model
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    from trl import SFTConfig, SFTTrainer

    from maximus.memory.meter import MemoryMeter

    torch.set_num_threads(args.threads)
    rows = json.loads(Path(args.rows_file).read_text())
    processor = AutoProcessor.from_pretrained(args.model)
    model = LlavaForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32)
    torch.manual_seed(SEED)
    targets = json.loads(args.targets)
    model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
                                             task_type="CAUSAL_LM", bias="none"))
    records = [{"images": [Image.open(r["image"]).convert("RGB")],
                "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["question"]}]}],
                "completion": [{"role": "assistant", "content": [{"type": "text", "text": r["answer"]}]}]}
               for r in rows]
    config = SFTConfig(output_dir=str(Path(args.work) / "trl"), max_steps=args.steps,
                       per_device_train_batch_size=len(rows), learning_rate=LR, lr_scheduler_type="constant",
                       warmup_steps=0, logging_steps=1, report_to=[], seed=SEED, use_cpu=True, bf16=False,
                       save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, max_length=None,
                       gradient_checkpointing=True, max_grad_norm=1.0, weight_decay=0.0)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(records), processing_class=processor)
    parameters = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    meter = MemoryMeter("cpu")
    t0 = time.perf_counter()
    with meter.track(model):
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "peak_bytes": meter.peak_bytes(), "parameters": parameters,
            "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------ driver
def maximus_config(model: Path, data: Path, out: Path, rows: int, steps: int, seq: int) -> dict:
    return {"model": str(model), "dataset": {"path": str(data)}, "method": "lora", "output_dir": str(out),
            "device": "cpu", "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "dropout": 0.0},
            "optimization": {"gradient_checkpointing": "full"},
            "training": {"batch_size": rows, "micro_batch_size": rows, "max_steps": steps, "learning_rate": LR,
                         "warmup_steps": 0, "scheduler": "constant", "seq_len": seq, "dtype": "fp32", "seed": SEED,
                         "max_grad_norm": 1.0, "weight_decay": 0.0},
            "eval": {"enabled": False, "split": 0.0}, "logging": {"progress": "none"}}


def run_side(side: str, args, extra: list[str]) -> dict:
    from finetune_vs_peft import launch_worker

    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--threads", str(args.threads),
           "--steps", str(args.steps), "--work", args.work, *extra]
    t0 = time.perf_counter()
    result = launch_worker(cmd, args.threads, args.worker_timeout, side)
    print(f"  {side:<8}: peak {result['peak_bytes'] / 2**20:7.1f} MiB (parameters {result['parameters'] / 2**20:.1f}), "
          f"losses {[round(x, 6) for x in result['losses']]} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
          flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("maximus", "trl"))
    p.add_argument("--config"), p.add_argument("--model"), p.add_argument("--rows-file"), p.add_argument("--targets")
    p.add_argument("--rows", type=int, default=4, help="rows per step (one micro-batch)")
    p.add_argument("--text", type=int, default=240, help="words of question + answer per row")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default=None)
    p.add_argument("--worker-timeout", type=int, default=1800)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.worker:
        result = maximus_worker(args) if args.worker == "maximus" else trl_worker(args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    args.work = args.work or tempfile.mkdtemp(prefix="vlm_memory_")
    root = Path(args.work)
    model = build_model(root)
    data, trl_rows = write_rows(root / "data", args.rows, args.text)
    (root / "rows.json").write_text(json.dumps(trl_rows))
    results = []
    for k in range(args.rounds):  # the sides alternate; each a fresh process
        cfg = maximus_config(model, data, root / f"maximus-{k}", args.rows, args.steps, seq=2048)
        (root / f"maximus-{k}.yaml").write_text(json.dumps(cfg))
        ours = run_side("maximus", args, ["--config", str(root / f"maximus-{k}.yaml")])
        theirs = run_side("trl", args, ["--model", str(model), "--rows-file", str(root / "rows.json"),
                                        "--targets", json.dumps(ours["target_modules"])])
        results.append({"maximus": ours, "trl": theirs})
    mib = 2**20
    train = lambda r: r["peak_bytes"] - r["parameters"]  # noqa: E731
    ratios = [train(r["maximus"]) / train(r["trl"]) for r in results]
    totals = [r["maximus"]["peak_bytes"] / r["trl"]["peak_bytes"] for r in results]
    diffs = [abs(r["maximus"]["losses"][0] - r["trl"]["losses"][0]) for r in results]
    ours, theirs = results[0]["maximus"], results[0]["trl"]
    tokens = json.loads((root / "rows.json").read_text())
    print(f"\nrows {args.rows} per step, {len(tokens)} rows, {args.steps} steps; Maximus plan {ours['plan']}, "
          f"planned peak {ours['planned_peak_bytes'] / mib:.1f} MiB (measured {ours['peak_bytes'] / mib:.1f})")
    print("| side | first-step loss | peak (MiB) | parameters (MiB) | training peak (MiB) |\n|---|---:|---:|---:|---:|")
    for name, r in (("Maximus", ours), ("TRL SFTTrainer + PEFT", theirs)):
        print(f"| {name} | {r['losses'][0]:.6f} | {r['peak_bytes'] / mib:.1f} | {r['parameters'] / mib:.1f} | "
              f"{train(r) / mib:.1f} |")
    print(f"\ntraining peak Maximus / TRL: {statistics.median(ratios):.3f}x (rounds: {', '.join(f'{x:.3f}' for x in ratios)}); "
          f"total peak {statistics.median(totals):.3f}x; first-step loss difference {max(diffs):.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
