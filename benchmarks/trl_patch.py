"""TRL's own trainers with and without `maximus.patch`, on the reference model (issue 18).

Model: the reference Llama (docs/benchmarks/reference.md) (vocab 128,256, hidden 512, 8 layers; `_reference_model.py`),
random weights, float32, LoRA r=16 / alpha 32 on every linear layer (PEFT `all-linear`), seed 0.

* SFT: `trl.SFTTrainer`, packed rows of 2,048 tokens (random-length documents of random token
  ids, pre-tokenized), batch 1, TRL's defaults otherwise (its `gradient_checkpointing=True`),
  bf16 off (fp32 both sides), 4 steps.
* DPO: `trl.DPOTrainer`, one pair per step (prompt 256 + answers of 768 tokens: 2 x 1,024 tokens),
  the adapter-off reference, 4 steps.

The only difference between the two sides is one line, `maximus.patch(model, seq_len=...)`, before
the trainer is built. Each run is a fresh subprocess (`--worker`); the sides alternate, `--rounds`
times. Per run: the loss of every step (`trainer.state.log_history`), training memory growth (peak
RSS during `trainer.train()` minus RSS just before it, after a malloc_trim; VmHWM reset through
/proc/self/clear_refs), and tokens/s of steps 2..4 (wall time between `on_step_begin` and
`on_step_end`). Ratios are patched / plain, median over rounds with the range.

RSS also holds what glibc's malloc keeps after a free (mid-size blocks stay in its heap once its
dynamic mmap threshold has risen), which varies from run to run. So after the timed rounds each
side runs once more with `maximus.memory.meter.StorageTracker` around `trainer.train()` (`--track`):
the peak bytes of live tensor storages created during training, the CPU counterpart of
`torch.cuda.max_memory_allocated` (deterministic; not timed, the tracker slows every op).

    flock /tmp/bench.lock python benchmarks/trl_patch.py                  # SFT and DPO, 2 rounds
    flock /tmp/bench.lock python benchmarks/trl_patch.py --trainers sft --rounds 1
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
SEED = 0


def _sft_dataset(vocab: int, seq: int, steps: int):
    from datasets import Dataset

    rng = random.Random(SEED)
    rows, total = [], 0
    while total < seq * (steps + 2):
        n = rng.randint(seq // 16, seq // 3)
        rows.append({"input_ids": [rng.randrange(vocab) for _ in range(n)]})
        total += n
    return Dataset.from_list(rows)


def _dpo_dataset(tokenizer, steps: int, prompt_tokens: int, answer_tokens: int):
    from datasets import Dataset

    rng = random.Random(SEED)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2)[:2000] or ["a", "b"]  # sorted: get_vocab order varies per process

    def text(n: int) -> str:
        out = ""
        while len(tokenizer(out).input_ids) < n:
            out += " " + " ".join(rng.choice(words) for _ in range(32))
        ids = tokenizer(out).input_ids[:n]
        return tokenizer.decode(ids)

    return Dataset.from_list([{"prompt": text(prompt_tokens), "chosen": text(answer_tokens),
                               "rejected": text(answer_tokens)} for _ in range(steps + 2)])


def worker(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from _reference_model import reference_model_dir
    from finetune_vs_peft import _status_bytes, _trim_and_reset_peak

    torch.set_num_threads(args.threads)
    path = Path(args.model_dir) if args.model_dir else reference_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(SEED)
    model = get_peft_model(model, LoraConfig(**LORA))
    notices = []
    if args.impl == "patched":
        import maximus

        maximus.patch(model, seq_len=args.seq, micro_batch_size=1 if args.trainer == "sft" else 2)
    common = dict(output_dir=str(Path(args.work) / f"{args.trainer}-{args.impl}"), max_steps=args.steps,
                  per_device_train_batch_size=1, learning_rate=2e-4, logging_steps=1, report_to=[], seed=SEED,
                  use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    if args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, processing_class=tokenizer,
                             args=SFTConfig(packing=True, max_length=args.seq, **common),
                             train_dataset=_sft_dataset(model.config.vocab_size, args.seq, args.steps))
    else:
        from trl import DPOConfig, DPOTrainer

        half = args.seq // 2
        trainer = DPOTrainer(model=model, processing_class=tokenizer,
                             args=DPOConfig(max_length=half, **common),
                             train_dataset=_dpo_dataset(tokenizer, args.steps, half // 4, half - half // 4))

    times: list[float] = []
    tokens: list[int] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    trainer.add_callback(Clock())
    original = trainer.training_step

    def counted(model, inputs, *rest, **kw):
        tokens.append(int(inputs["input_ids"].numel()))
        return original(model, inputs, *rest, **kw)

    trainer.training_step = counted
    base = _trim_and_reset_peak()
    if args.track:
        from maximus.memory.meter import StorageTracker

        with StorageTracker() as tracker:
            trainer.train()
    else:
        trainer.train()
    peak = _status_bytes("VmHWM")
    if args.impl == "patched":
        import maximus

        notices = maximus.patch_report(model).notices
    logs = [h for h in trainer.state.log_history if "loss" in h]
    measured = list(zip(times, tokens))[1:]
    return {"impl": args.impl, "trainer": args.trainer, "losses": [h["loss"] for h in logs],
            "rss_growth": peak - base, "base_rss": base, "step_s": times, "tokens": tokens,
            "tokens_per_s": statistics.median(n / t for t, n in measured), "notices": notices,
            "live_peak": tracker.peak_bytes if args.track else None,
            "extra": {k: logs[0].get(k) for k in ("entropy", "mean_token_accuracy", "rewards/accuracies") if k in logs[0]}}


def run_worker(trainer: str, impl: str, args, track: bool = False) -> dict:
    from finetune_vs_peft import launch_worker

    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--trainer", trainer, "--impl", impl,
           "--seq", str(args.seq), "--steps", str(args.steps), "--threads", str(args.threads), "--work", args.work]
    if args.model_dir:
        cmd += ["--model-dir", str(args.model_dir)]
    if track:
        cmd.append("--track")
    t0 = time.perf_counter()
    result = launch_worker(cmd, args.threads, args.worker_timeout, f"{trainer}/{impl}")
    what = (f"live-tensor peak {result['live_peak'] / 2**20:7.0f} MiB" if track else
            f"growth {result['rss_growth'] / 2**20:7.0f} MiB, {result['tokens_per_s']:6.0f} tok/s")
    print(f"  {trainer} {impl:<8}: {what}, losses {[round(x, 5) for x in result['losses']]} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return result


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--trainer", default="sft", choices=("sft", "dpo"))
    p.add_argument("--trainers", default="sft,dpo")
    p.add_argument("--impl", default="plain", choices=("plain", "patched"))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--track", action="store_true", help="worker: count live tensor bytes (StorageTracker)")
    p.add_argument("--no-track-run", action="store_true", help="skip the extra live-tensor run per side")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--work", default="/tmp/maximus-trl-bench")
    p.add_argument("--worker-timeout", type=int, default=1800)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    from speed import matmul_rate

    from _machine import cpu_flags

    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in cpu_flags()]
    print(f"CPU bf16: {', '.join(bf16) or 'emulated (no avx512_bf16 / amx_bf16)'}; bf16 matmul rate "
          f"{matmul_rate(args.threads) / 1e9:.0f} GFLOP/s at {args.threads} threads; runs are fp32", file=sys.stderr)
    lines = []
    for name in args.trainers.split(","):
        runs = {"plain": [], "patched": []}
        for _ in range(args.rounds):
            for impl in ("plain", "patched"):
                runs[impl].append(run_worker(name, impl, args))
        diffs = [max(abs(a - b) for a, b in zip(x["losses"], y["losses"], strict=True))
                 for x, y in zip(runs["plain"], runs["patched"])]
        mem = [y["rss_growth"] / x["rss_growth"] for x, y in zip(runs["plain"], runs["patched"])]
        speed = [y["tokens_per_s"] / x["tokens_per_s"] for x, y in zip(runs["plain"], runs["patched"])]
        plain, ours = runs["plain"][0], runs["patched"][0]
        live = "| - | - | - "
        if not args.no_track_run:
            tracked = {impl: run_worker(name, impl, args, track=True)["live_peak"] for impl in ("plain", "patched")}
            live = (f"| {tracked['plain'] / 2**20:,.0f} MiB | {tracked['patched'] / 2**20:,.0f} MiB | "
                    f"{tracked['patched'] / tracked['plain']:.2f}x ")
        lines.append(f"| {name.upper()} | {max(diffs):.2e} | "
                     f"{statistics.median(r['rss_growth'] for r in runs['plain']) / 2**20:,.0f} MiB | "
                     f"{statistics.median(r['rss_growth'] for r in runs['patched']) / 2**20:,.0f} MiB | {_ratio(mem)} | "
                     f"{statistics.median(r['tokens_per_s'] for r in runs['plain']):,.0f} | "
                     f"{statistics.median(r['tokens_per_s'] for r in runs['patched']):,.0f} | {_ratio(speed)} {live}|")
        print(f"{name}: per-step losses plain {plain['losses']}\n{name}: per-step losses patched {ours['losses']}\n"
              f"{name}: TRL metrics of step 1 plain {plain['extra']} patched {ours['extra']}\n"
              f"{name}: notices {ours['notices']}")
    print("\n| trainer | max per-step loss difference | RSS growth, plain | patched | ratio (median, range) | "
          "tokens/s plain | patched | ratio (median, range) | live-tensor peak, plain | patched | ratio |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
