"""Peak memory and time of one GRPO step: ours against TRL's GRPOTrainer, in one run.

Both sides take the same LoRA model (r=16 on all linear layers, fp32), the same prompt
(`--prompt-tokens` tokens, sampled `--group` times), `--completion` new tokens per completion
(the random model never says EOS, so every completion is that long), the same reward function,
the same intra-op thread count (`--threads`),
beta 0 (no reference pass), one update per generation (loss_type dapo, TRL's default), and run one
optimizer step through their own trainer's entry point:

- ours: `maximus.Trainer(cfg).train()` with `objective: grpo` (sampling with the KV cache, one
  batch per group; log-probs through the chunked head; `micro_batch_size` completions per
  backward; the planner's checkpointing choice, or `--checkpointing`);
- TRL: `GRPOTrainer(...).train()` for one step (`per_device_train_batch_size` = the group, its
  own generation with the KV cache, its fused LM head, its default gradient checkpointing
  unless `--checkpointing off`).

Memory is `maximus.memory.meter.MemoryMeter("cpu")` (live tensor storages) over the step, with
the loaded model (and our optimizer) adopted first: "step" = peak minus what was live before the
step (generation, log-probs, backward, optimizer state and step: everything the step adds),
"total" = the peak with the weights. The sides
alternate (`--repeats` rounds, ours first in odd rounds, TRL first in even ones); the table
shows medians and the ratio ours / TRL with its range. The CPU's bf16 flags and measured fp32 /
bf16 matmul rates are printed first. Model: the reference Llama of docs/benchmarks/reference.md.

    python benchmarks/grpo_memory.py [--group 8] [--completion 256] [--repeats 2] [--quick]
    python benchmarks/grpo_memory.py --plot runs/grpo/metrics.jsonl --out docs/benchmarks/grpo_reward.png
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _grpo_sides import cpu_report, length_reward, measure, small_llama_dir, trl_grpo_trainer  # noqa: E402


def build(root: Path, quick: bool, prompt_tokens: int) -> tuple[Path, Path, str]:
    if quick:
        model_dir = small_llama_dir(root)
    else:
        from _reference_model import reference_model_dir

        model_dir = reference_model_dir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    words = "reverse the list of words and answer in order please".split()
    text, i = "", 0
    while len(tok(text)["input_ids"]) < prompt_tokens:
        text += words[i % len(words)] + " "
        i += 1
    data = root / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": text.strip(), "answer": "x"}) + "\n")
    return model_dir, data, text.strip()


def ours(model_dir: Path, data: Path, out: Path, args) -> dict:
    import maximus

    cfg = {"model": str(model_dir), "dataset": {"path": str(data), "format": "prompt"}, "method": "lora",
           "objective": "grpo", "output_dir": str(out), "lora": {"r": 16, "alpha": 32},
           "optimization": {"gradient_checkpointing": args.checkpointing if args.checkpointing != "default" else "auto"},
           "training": {"batch_size": 1, "micro_batch_size": args.micro if args.micro == "auto" else int(args.micro), "max_steps": 1, "seq_len": args.prompt_tokens + 8,
                        "dtype": "fp32", "warmup_steps": 0},
           "grpo": {"group_size": args.group, "max_completion_tokens": args.completion, "beta": 0.0, "loss_type": "dapo",
                    "rewards": [f"{HERE / '_grpo_sides.py'}:length_reward"]},
           "eval": {"enabled": False}, "logging": {"progress": "none"}}
    trainer = maximus.Trainer(maximus.Config.from_dict(cfg))
    trainer.setup()
    trainer.objective.prepare(trainer)

    def run():
        trainer.train_step(1)
        return {"completion_length": trainer.objective.generation.metrics["completion_length"],
                "checkpointing": trainer.plan.checkpointing_label}

    return measure(run, trainer.model, trainer.optimizer)


def trl(model_dir: Path, prompt: str, out: Path, args) -> dict:
    checkpointing = {"default": True, "off": False, "full": True}.get(args.checkpointing, True)
    trainer = trl_grpo_trainer(model_dir, [{"prompt": prompt, "answer": "x"}] * 4, out, prompts=1, group=args.group,
                               completion=args.completion, max_steps=1, reward_funcs=[length_reward],
                               gradient_checkpointing=checkpointing)

    def run():
        trainer.train()
        logged = next((h for h in trainer.state.log_history if "completions/mean_length" in h), {})
        return {"completion_length": logged.get("completions/mean_length"),
                "checkpointing": "full" if checkpointing else "off"}

    return measure(run, trainer.model)


def plot_rewards(metrics: Path, out: Path) -> None:
    from _grpo_sides import WINDOW, reward_axes, save_plot, trailing_mean

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if r.get("reward") is not None]
    steps = [r["step"] for r in rows]
    fig, ax = reward_axes((7, 3.5))
    names = sorted(k for k in rows[0] if k.startswith("reward/"))
    for key, label in [("reward", "reward (sum)")] + [(n, n) for n in names]:
        values = [r[key] for r in rows]
        line, = ax.plot(steps, values, linewidth=0.7, alpha=0.35)
        ax.plot(steps, trailing_mean(values), color=line.get_color(), linewidth=1.6,
                label=f"{label}, mean of {WINDOW} steps")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the sampled completions")
    ax.set_title("examples/grpo.yaml: reward of the sampled completions")
    ax.legend(fontsize=8)
    save_plot(fig, ax, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--micro", default="auto", help="our completions per backward (auto: the planner picks)")
    parser.add_argument("--checkpointing", default="default", choices=["default", "off", "full"],
                        help="default: each side's own default (ours: the planner; TRL: on)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads, the same for both sides")
    parser.add_argument("--quick", action="store_true", help="a small model (vocab 32,000, hidden 256, 4 layers)")
    parser.add_argument("--plot", type=Path, help="only draw the reward curve of this metrics.jsonl")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/grpo_reward.png"))
    args = parser.parse_args()
    if args.plot:
        plot_rewards(args.plot, args.out)
        return
    # One thread count for both sides (our trainer would otherwise pick one from the machine's load).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    print(cpu_report(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, data, prompt = build(root, args.quick, args.prompt_tokens)
        results = {"ours": [], "trl": []}
        for r in range(args.repeats):
            order = ("ours", "trl") if r % 2 == 0 else ("trl", "ours")
            for side in order:
                out = root / f"{side}{r}"
                res = ours(model_dir, data, out, args) if side == "ours" else trl(model_dir, prompt, out, args)
                results[side].append(res)
                print(json.dumps({"round": r, "side": side, **res}), flush=True)
    print(f"\ngroup {args.group} x completion {args.completion} tokens, prompt {args.prompt_tokens} tokens, LoRA r=16, fp32")
    print("| side | checkpointing | step peak (MiB) | total peak (MiB) | step time (s) | completion tokens |")
    print("|---|---|---:|---:|---:|---:|")
    for side, rows in results.items():
        med = {k: statistics.median(x[k] for x in rows) for k in ("step_bytes", "total_bytes", "step_seconds")}
        print(f"| {side} | {rows[0]['checkpointing']} | {med['step_bytes'] / 2**20:.1f} | {med['total_bytes'] / 2**20:.1f} "
              f"| {med['step_seconds']:.1f} | {rows[0]['completion_length']} |")
    for key, label in (("step_bytes", "step peak"), ("total_bytes", "total peak"), ("step_seconds", "step time")):
        ratios = [o[key] / t[key] for o, t in zip(results["ours"], results["trl"])]
        print(f"ours / TRL {label}: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
