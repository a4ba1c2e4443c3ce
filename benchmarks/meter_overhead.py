"""What the CPU memory meter costs a step, and what `training.memory_meter: sampled` saves.

The built-in quickstart's model and adapter (tiny Llama, LoRA r=16 on every linear plus
`embed_tokens` / `lm_head` trained in full), one optimizer step on 8 x 48 tokens, fp32. Steps run
without the meter and under it, interleaved in one process, after warm-up; then the steps that
`sampled` meters over the quickstart's own run length and data order (a real `Trainer`, no
training) give the expected whole-run cost.

    python benchmarks/meter_overhead.py [--repeats 15] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_memory import cpu_report
    from maximus.builtin import materialize
    from maximus.memory.meter import MemoryMeter

    torch.set_num_threads(args.threads)
    print(cpu_report())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(materialize("builtin:tiny-llama"), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear", modules_to_save=["embed_tokens", "lm_head"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (8, 48))
    meter = MemoryMeter("cpu")

    def step(metered: bool) -> float:
        t = time.perf_counter()
        with meter.track(model, opt) if metered else torch.enable_grad():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    for _ in range(3):
        step(False), step(True)
    plain, metered = [], []
    for _ in range(args.repeats):
        plain.append(step(False))
        metered.append(step(True))
    ratios = [m / p for p, m in zip(plain, metered)]
    ratio = statistics.median(metered) / statistics.median(plain)
    print(f"step without the meter: median {statistics.median(plain) * 1e3:.1f} ms; under it "
          f"{statistics.median(metered) * 1e3:.1f} ms: {ratio:.2f}x (pairs {min(ratios):.2f}-{max(ratios):.2f}x, "
          f"{args.repeats} interleaved pairs)")

    from maximus import Config, Trainer
    from maximus.builtin import resolve
    from maximus.train.metering import MeterPolicy
    from maximus.train.objectives.base import Objective
    from maximus.train.order import row_length

    import tempfile

    with tempfile.TemporaryDirectory() as out:  # the quickstart's config, its run directory elsewhere
        trainer = Trainer(resolve(Config.from_yaml(HERE.parent / "examples" / "quickstart.yaml",
                                                   overrides=[f"output_dir={out}"])))
        trainer.setup()  # model, data and plan; nothing trains
        policy = MeterPolicy("sampled", trainer.total_steps)
        assert type(trainer.objective).step_batches is Objective.step_batches
        n = sum(policy.decide(s, trainer.plan, [row_length(r) for r in trainer.rows_for_step(s)])
                for s in range(1, trainer.total_steps + 1))
    share = n / trainer.total_steps
    print(f"quickstart: {trainer.total_steps} steps, `sampled` meters {n} ({share:.1%}): expected step time "
          f"{share * ratio + (1 - share):.2f}x the unmetered one, against {ratio:.2f}x under `every_step`")


if __name__ == "__main__":
    main()
