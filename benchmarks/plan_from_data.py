"""Planning from the data's rows: the old assumption (every row `seq_len` tokens) against the new
prediction (the largest micro-batch the loader really forms) and the measured peak of real
`maximus-train` runs, fp32 LoRA on CPU, with tokens/s.

Per case (unpacked rows: DPO pairs, chat rows with `packing: false`, GRPO at two completion
lengths, token-budget micro-batches):

1. **free**: the run as configured, no budget: run.json `plan.peak_bytes` (new prediction) vs
   `memory.peak_bytes` (measured); the old assumption is `plan_run` of the same config without
   the data's lengths (what the planner predicted before it read the data).
2. **budget**: `target_vram` = resident memory + 0.6 x what the free step adds (measured), planned
   from the data: accepted? held? tokens/s.
3. **old plan at that budget**: what the seq_len assumption would have chosen under the same
   budget (refused, or its micro-batch / checkpointing run for its tokens/s).
4. **probe** (`--probe`): `maximus plan --measure`'s probe at micro-batch 1 calibrates the estimator;
   its calibrated prediction for the free run (micro-batch 4: a 4x larger micro-batch) vs measured.

    flock /tmp/bench.lock python benchmarks/plan_from_data.py [--only dpo-mb4 chat] [--probe]

Model: a Llama with a 32k vocabulary, hidden 256, 4 layers (random init, seed 0).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

SMALL = dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=500000.0)

REWARDS = '''
def length(prompts, completions, completion_ids=None, **columns):
    return [len(ids) / 100.0 for ids in completion_ids]
'''


def _model(root: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    path = root / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(str(path))
    build_tiny_tokenizer().save_pretrained(str(path))
    return path


def _data(root: Path) -> dict[str, Path]:
    """96 short DPO pairs; 96 chat rows of 30-120 tokens; 96 DPO pairs of which every 16th has a
    long chosen answer (for token budgets); 16 prompts for GRPO."""
    sys.path.insert(0, str(Path(__file__).parent))
    from make_dpo_pairs import reverse_words_pairs

    from maximus.builtin import WORDS

    rng = random.Random(0)

    def words(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))

    records = {
        "pairs": reverse_words_pairs(96, seed=7),
        "chat": [{"messages": [{"role": "user", "content": words(rng.randint(8, 30))},
                               {"role": "assistant", "content": words(rng.randint(15, 80))}]} for _ in range(96)],
        "skewed": [{"prompt": f"Say: {words(4)}\nAnswer:", "chosen": " " + words(250 if i % 16 == 0 else rng.randint(3, 8)),
                    "rejected": " " + words(rng.randint(3, 8))} for i in range(96)],
        "prompts": [{"prompt": f"Reverse: {words(rng.randint(3, 12))}\nAnswer:"} for _ in range(16)],
    }
    paths = {}
    for name, rows in records.items():
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (root / "rewards.py").write_text(REWARDS, encoding="utf-8")
    return paths


def cases(data: dict[str, Path], root: Path) -> dict[str, dict]:
    """name -> config sections (beside the common ones in `_config`)."""
    dpo = {"objective": "dpo", "dataset": {"path": str(data["pairs"]), "format": "preference"}}
    chat = {"dataset": {"path": str(data["chat"]), "format": "chat"}}
    grpo = {"objective": "grpo", "dataset": {"path": str(data["prompts"]), "format": "prompt"},
            "grpo": {"group_size": 4, "rewards": [f"{root / 'rewards.py'}:length"]}}
    return {
        "dpo-mb4": dict(dpo, training={"seq_len": 256, "micro_batch_size": 4}, optimization={}),
        "dpo-mb1-full": dict(dpo, training={"seq_len": 256, "micro_batch_size": 1},
                             optimization={"gradient_checkpointing": "full"}),
        "dpo-seq512": dict(dpo, training={"seq_len": 512, "micro_batch_size": 4}, optimization={}),
        "chat-unpacked": dict(chat, training={"seq_len": 1024, "micro_batch_size": 4, "packing": False},
                              optimization={}),
        "grpo-16": dict(grpo, training={"seq_len": 64, "micro_batch_size": 4, "batch_size": 2},
                        grpo={**grpo["grpo"], "max_completion_tokens": 16}, optimization={}),
        "grpo-64": dict(grpo, training={"seq_len": 64, "micro_batch_size": 4, "batch_size": 2},
                        grpo={**grpo["grpo"], "max_completion_tokens": 64}, optimization={}),
        "skewed-rows": dict(training={"seq_len": 512, "micro_batch_size": 4}, optimization={}, objective="dpo",
                            dataset={"path": str(data["skewed"]), "format": "preference"}),
        "skewed-tokens": dict(training={"seq_len": 512, "micro_batch_tokens": 512}, optimization={}, objective="dpo",
                              dataset={"path": str(data["skewed"]), "format": "preference"},
                              budget_training={"micro_batch_tokens": "auto"}),
    }


def _config(model: Path, out: Path, case: dict, budget: int | None, steps: int) -> dict:
    training = {"batch_size": 8, "max_steps": steps, "warmup_steps": 0, "dtype": "fp32", "learning_rate": 1e-4,
                **case["training"]}
    optimization = {"gradient_checkpointing": "off", **case["optimization"], "target_vram": budget}
    if budget is not None:  # the planner chooses: micro-batch (or token budget) and checkpointing
        training.update(case.get("budget_training", {"micro_batch_size": "auto"}))
        optimization["gradient_checkpointing"] = "auto"
    cfg = {"model": str(model), "method": "lora", "output_dir": str(out), "device": "cpu", "lora": {"r": 16, "alpha": 32},
           "training": training, "optimization": optimization, "eval": {"enabled": False, "before": False},
           "logging": {"progress": "plain"}}
    cfg.update({k: v for k, v in case.items() if k not in ("training", "optimization", "budget_training")})
    return cfg


def _train(cfg: dict, out: Path) -> dict:
    """One `maximus-train` process; its run.json plus the median tokens/s of steps after the first."""
    from _train_process import train_process

    run = train_process(cfg, out)
    if "error" in run:
        return run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 1]
    run["tokens_per_s"] = statistics.median(speeds) if speeds else None
    return run


def _old_plan(cfg: dict, budget: int | None):
    """What the planner chose when it assumed every row is seq_len tokens (no lengths)."""
    from maximus import Config
    from maximus.errors import BudgetError
    from maximus.memory import plan_run

    d = json.loads(json.dumps(cfg))
    d["training"].pop("micro_batch_tokens", None)  # needs the data: the old planner had only row counts
    if "micro_batch_size" not in d["training"]:
        d["training"]["micro_batch_size"] = "auto" if budget is not None else 4
    try:
        return plan_run(Config.from_dict(d), device="cpu", budget_bytes=budget), None
    except BudgetError as exc:
        return None, exc.message


def _mib(n) -> str:
    return f"{n / 2**20:.1f} MiB" if n is not None else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--probe", action="store_true", help="also calibrate on a micro-batch-1 probe (plan --measure)")
    parser.add_argument("--keep", help="keep the runs in this directory")
    args = parser.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="plan_from_data_"))
    root.mkdir(parents=True, exist_ok=True)
    model = _model(root)
    data = _data(root)
    results = []
    try:
        for name, case in cases(data, root).items():
            if args.only and name not in args.only:
                continue
            free_cfg = _config(model, root / f"{name}-free", case, None, args.steps)
            free = _train(free_cfg, root / f"{name}-free")
            line = {"name": name, "free": free}
            if "error" not in free:
                old, _ = _old_plan(free_cfg, None)
                line["old_prediction"] = old.peak_bytes
                b = free["memory"]["breakdown"]
                static = b["parameters"] + b["optimizer_state"]
                budget = int(static + 0.6 * (free["memory"]["peak_bytes"] - static))
                line["budget"] = budget
                tight_cfg = _config(model, root / f"{name}-tight", case, budget, args.steps)
                line["tight"] = _train(tight_cfg, root / f"{name}-tight")
                old_tight, why = _old_plan(tight_cfg, budget)
                line["old_tight_plan"] = old_tight.to_dict() if old_tight else why
                if old_tight is not None:  # run what the old planner chose, for its tokens/s
                    forced = json.loads(json.dumps(tight_cfg))
                    forced["training"].update(micro_batch_size=old_tight.micro_batch_size, micro_batch_tokens=None)
                    forced["optimization"].update(target_vram=None, gradient_checkpointing={
                        "none": "off"}.get(old_tight.recompute[0], old_tight.recompute[0])
                        if len(set(old_tight.recompute)) == 1 else "full")
                    forced["output_dir"] = str(root / f"{name}-old")
                    line["old_run"] = _train(forced, root / f"{name}-old")
                if args.probe and not name.startswith("grpo"):
                    from maximus import Config
                    from maximus.memory import plan_run
                    from maximus.train.order import read_lengths
                    from maximus.train.probe import run_probe

                    cfg = Config.from_dict(free_cfg)
                    cal = run_probe(cfg)
                    here = plan_run(cfg, device="cpu", lengths=read_lengths(cfg))
                    line["probe"] = {**cal.to_dict(), "calibrated": cal.peak(here),
                                     "x_tokens": (here.micro_batch_tokens_max or 1) / cal.probe_tokens}
            results.append(line)
            print(json.dumps({k: v for k, v in line.items() if k in ("name", "old_prediction", "budget")}
                             | {"free_pred": free.get("plan", {}).get("peak_bytes"),
                                "free_meas": free.get("memory", {}).get("peak_bytes")}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    _print_table(results, args)
    return 0


def _print_table(results: list[dict], args) -> None:
    print()
    print(f"model: Llama {SMALL}; fp32 LoRA r=16, batch 8 (GRPO: 2 prompts x 4), {args.steps} steps, CPU")
    print()
    print("| case | longest row / largest micro-batch (tokens) | old assumption (seq_len rows) | new prediction | "
          "measured peak | error | tokens/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    worst = 0.0
    for line in results:
        free = line["free"]
        if "error" in free:
            print(f"| {line['name']} | error: {free['error']} | | | | | |")
            continue
        plan, meas = free["plan"], free["memory"]["peak_bytes"]
        err = plan["peak_bytes"] / meas - 1
        worst = max(worst, abs(err))
        old_err = line["old_prediction"] / meas - 1
        print(f"| {line['name']} | {plan['rows_tokens_max']} / {plan['micro_batch_tokens_max']} | "
              f"{_mib(line['old_prediction'])} ({old_err:+.0%}) | {_mib(plan['peak_bytes'])} | {_mib(meas)} | "
              f"{err:+.1%} | {free['tokens_per_s']:.0f} |")
    print(f"\nworst |error| of the new prediction: {worst:.1%} (goal <= 10 %)\n")
    print("| case | budget (resident + 0.6 x step) | new plan | measured | held | tokens/s | old plan at that budget | "
          "old tokens/s |")
    print("|---|---:|---|---:|---|---:|---|---:|")
    for line in results:
        if "tight" not in line:
            continue
        t, budget = line["tight"], line["budget"]
        if "error" in t:
            new = f"refused: {t['error']} | | | |"
        else:
            p, m = t["plan"], t["memory"]["peak_bytes"]
            batch = (f"{p['micro_batch_tokens']} tokens" if p.get("micro_batch_tokens") else f"mb {p['micro_batch_size']}")
            new = (f"{batch}, ckpt {p['checkpointing_label']}, {_mib(p['peak_bytes'])} | {_mib(m)} | "
                   f"{'yes' if m <= budget else 'NO'} | {t['tokens_per_s']:.0f}")
        old = line["old_tight_plan"]
        if isinstance(old, str):
            old_cells = f"refused: \"{old}\" | -"
        else:
            r = line.get("old_run", {})
            old_cells = (f"mb {old['micro_batch_size']}, ckpt {old['checkpointing_label']} | "
                         f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "| -")
        print(f"| {line['name']} | {_mib(budget)} | {new} | {old_cells} |")
    probes = [line for line in results if "probe" in line]
    if probes:
        print("\n| case | probe (micro-batch 1): measured / predicted | calibrated prediction of the run | "
              "measured | error | x probe tokens |")
        print("|---|---|---:|---:|---:|---:|")
        for line in probes:
            p, meas = line["probe"], line["free"]["memory"]["peak_bytes"]
            print(f"| {line['name']} | {_mib(p['measured_peak_bytes'])} / {_mib(p['predicted_peak_bytes'])} | "
                  f"{_mib(p['calibrated'])} | {_mib(meas)} | {p['calibrated'] / meas - 1:+.1%} | {p['x_tokens']:.1f} |")


if __name__ == "__main__":
    raise SystemExit(main())
