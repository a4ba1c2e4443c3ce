"""GRPO sampling speed: our batched sampler, our former per-group sampler and TRL's GRPOTrainer
(no vLLM), side by side in one process.

All three take the same LoRA model (r=16 on all linear layers, fp32), the same `--prompts`
prompts (different lengths: left padding is exercised), `--group` completions each, up to
`--completion` new tokens, the same reward, the same intra-op threads, beta 0, loss_type dapo,
and run `--steps` optimizer steps through their own trainer (after one warm-up step, not counted):

- `batched`: `maximus.Trainer` as shipped: one sampling call per step for all prompts x group,
  each prompt prefilled once and its KV cache expanded to the group (`maximus.train.sampling`);
- `per-group`: the same trainer with the former sampler put back: one `model.generate` per
  prompt on its group (G copies of the prompt, so G prefills), Transformers' sampling loop;
- `trl`: `GRPOTrainer(...).train()` for the same steps (`per_device_train_batch_size` = prompts x
  group, its own generation with the KV cache, its default gradient checkpointing).

Reported per side: completions per second over the timed steps (generated completions / wall
seconds of those steps), the step peak (`MemoryMeter("cpu")`, live tensor storages, what a step
adds over the loaded model), and for ours the time split of a step: prefill and decode forwards
(timed by a forward hook on the decoder during sampling: a call on more than one new token is a
prefill), loss (everything else: rewards, log-prob passes, forward and backward) and the
optimizer step. The sides alternate over `--repeats` rounds; medians and ratios are printed.

    python benchmarks/grpo_speed.py [--prompts 4] [--group 8] [--completion 12] [--steps 3] [--repeats 2]
    python benchmarks/grpo_speed.py --example before --out runs/grpo_before   # examples/grpo.yaml, former sampler
    python benchmarks/grpo_speed.py --curves runs/grpo_before/metrics.jsonl runs/grpo/metrics.jsonl \\
        --out docs/benchmarks/grpo_reward_time.png                              # reward against wall time
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WORDS = "reverse the list of words and answer in order please red gold stone river".split()


def length_reward(prompts, completions, **columns):
    """Any reward that varies within a group: the step's time does not depend on its values."""
    return [float(len(c) % 7) for c in completions]


# ------------------------------------------------------------------------------ the former sampler
def per_group_sample(objective, trainer, prompt_ids, index, **extra):
    """The sampler before batching (kept here to measure it): one `generate` per prompt, on
    `group_size` copies of it, seeded by (seed, generation, prompt)."""
    from transformers import GenerationConfig

    from maximus.train.sampling import Sampled

    g, tok, device = objective.g, trainer.tokenizer, trainer.device
    config = GenerationConfig(do_sample=True, temperature=g.temperature, top_p=g.top_p, top_k=0,
                              max_new_tokens=g.max_completion_tokens, eos_token_id=tok.eos_token_id,
                              pad_token_id=objective.pad_token_id, num_beams=1, use_cache=True)
    completions = []
    for p, ids in enumerate(prompt_ids):
        prompt = torch.tensor([ids], device=device).repeat(g.group_size, 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hash((objective.cfg.training.seed, index, p)) % 2**63)
            out = trainer.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
        rows = out[:, len(ids):].tolist()
        completions.append([r[:r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r for r in rows])
    return Sampled(completions=completions)


class ForwardClock:
    """Seconds of the decoder's forwards while `on`: prefill (more than one new token) and decode."""

    def __init__(self, model):
        self.on, self.prefill, self.decode, self._t = False, 0.0, 0.0, 0.0
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder = base.model
        decoder.register_forward_pre_hook(self._pre)
        decoder.register_forward_hook(self._post, with_kwargs=True)

    def _pre(self, module, args):
        self._t = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        if not self.on:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        seconds = time.perf_counter() - self._t
        if ids is not None and ids.shape[1] > 1:
            self.prefill += seconds
        else:
            self.decode += seconds


def build(root: Path, prompts: int) -> tuple[Path, Path, list[str]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model_dir = root / "model"
    LlamaForCausalLM(config).save_pretrained(str(model_dir), safe_serialization=True)
    tok.save_pretrained(str(model_dir))
    texts = [" ".join(WORDS[i % 5:i % 5 + 6 + 2 * i]) for i in range(prompts)]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t, "answer": "x"}) + "\n" for t in texts))
    return model_dir, data, texts


def ours(model_dir: Path, data: Path, out: Path, args, sampler: str) -> dict:
    import maximus
    from grpo_memory import measure
    from maximus.train.objectives.grpo import GRPOObjective

    cfg = {"model": str(model_dir), "dataset": {"path": str(data), "format": "prompt"}, "method": "lora",
           "objective": "grpo", "output_dir": str(out), "lora": {"r": 16, "alpha": 32},
           "training": {"batch_size": args.prompts, "max_steps": args.steps + 2, "seq_len": 64, "dtype": "fp32",
                        "warmup_steps": 0, "learning_rate": 1e-5},
           "grpo": {"group_size": args.group, "max_completion_tokens": args.completion, "beta": 0.0,
                    "loss_type": "dapo", "rewards": [f"{Path(__file__).resolve()}:length_reward"]},
           "eval": {"enabled": False}, "logging": {"progress": "none"}}
    trainer = maximus.Trainer(maximus.Config.from_dict(cfg))
    trainer.setup()
    torch.set_num_threads(args.threads)  # the trainer picks its own from the machine's load: the same as TRL's
    objective = trainer.objective
    objective.prepare(trainer)
    clock = ForwardClock(trainer.model)
    shipped = GRPOObjective.sample.__get__(objective)

    def sample(trainer_, prompt_ids, index, **extra):
        clock.on = True
        try:
            if sampler == "per-group":
                return per_group_sample(objective, trainer_, prompt_ids, index)
            return shipped(trainer_, prompt_ids, index, **extra)
        finally:
            clock.on = False

    objective.sample = sample
    step_opt = trainer.optimizer.step
    opt_s = [0.0]

    def timed_step(*a, **k):
        t = time.perf_counter()
        result = step_opt(*a, **k)
        opt_s[0] += time.perf_counter() - t
        return result

    trainer.optimizer.step = timed_step
    trainer.train_step(1)  # warm-up
    clock.prefill = clock.decode = opt_s[0] = 0.0
    lengths = []
    started = time.perf_counter()
    for step in range(2, args.steps + 2):
        trainer.train_step(step)
        lengths.append(objective.generation.metrics["completion_length"])
    seconds = time.perf_counter() - started
    res = {"step_seconds": seconds / args.steps, "completion_length": statistics.mean(lengths),
           "completions_per_s": args.steps * args.prompts * args.group / seconds, "prefill_s": clock.prefill / args.steps,
           "decode_s": clock.decode / args.steps, "optimizer_s": opt_s[0] / args.steps,
           "loss_s": (seconds - clock.prefill - clock.decode - opt_s[0]) / args.steps}
    # The step peak: one more step under the storage meter (it slows every allocation, so apart).
    peak = measure(lambda: trainer.train_step(args.steps + 2), trainer.model, trainer.optimizer)
    res.update(step_bytes=peak["step_bytes"], total_bytes=peak["total_bytes"])
    return res


def trl(model_dir: Path, texts: list[str], out: Path, args) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from maximus.memory.meter import MemoryMeter

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=args.prompts * args.group,
                        num_generations=args.group, max_completion_length=args.completion, beta=0.0, loss_type="dapo",
                        max_steps=args.steps + 2, use_cpu=True, report_to=[], bf16=False, save_strategy="no",
                        logging_steps=1, seed=0, learning_rate=1e-5)
    marks = {}
    meter = MemoryMeter("cpu")
    tracking = []

    class Clock(TrainerCallback):
        """Times the steps after the first (the warm-up); the last step runs under the meter."""

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == args.steps + 1:
                tracking.append(meter.track(trainer.model))
                tracking[0].__enter__()
                marks["before"] = meter.current_bytes()
                meter.reset_peak()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step == 1:
                marks["start"] = time.perf_counter()
            if state.global_step == args.steps + 1:
                marks["end"] = time.perf_counter()
            if state.global_step == args.steps + 2:
                marks["peak"] = meter.peak_bytes()
                tracking[0].__exit__(None, None, None)

    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=config,
                          train_dataset=Dataset.from_list([{"prompt": t} for t in texts] * (args.steps + 3)),
                          processing_class=tok, callbacks=[Clock()],
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer.train()
    seconds = marks["end"] - marks["start"]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_seconds": seconds / args.steps, "completions_per_s": args.steps * args.prompts * args.group / seconds,
            "completion_length": statistics.mean(lengths[1:args.steps + 1]),
            "step_bytes": marks["peak"] - marks["before"], "total_bytes": marks["peak"]}


# ------------------------------------------------------------------------------ the example, before / after
def run_example(which: str, out: Path) -> None:
    """examples/grpo.yaml with the shipped sampler (`after`) or the former one (`before`)."""
    import yaml

    import maximus
    from maximus.train.objectives.grpo import GRPOObjective

    cfg = yaml.safe_load(Path("examples/grpo.yaml").read_text())
    cfg["output_dir"] = str(out)
    if which == "before":
        GRPOObjective.sample = lambda self, trainer, prompt_ids, index, **extra: per_group_sample(self, trainer, prompt_ids, index)
    maximus.Trainer(maximus.Config.from_dict(cfg)).train()


def plot_curves(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for path in paths:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows = [r for r in rows if r.get("reward") is not None]
        wall, t = [], 0.0
        for r in rows:
            t += r["step_time_s"]
            wall.append(t)
        values = [r["reward"] for r in rows]
        window = 10
        smooth = [statistics.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
        line, = ax.plot(wall, values, linewidth=0.7, alpha=0.3)
        ax.plot(wall, smooth, color=line.get_color(), linewidth=1.6,
                label=f"{path.parent.name}: {len(rows)} steps in {t:.0f} s (mean of {window} steps)")
    ax.set_xlabel("training wall time (s, sum of step times)")
    ax.set_ylabel("mean reward of the sampled completions")
    ax.set_title("examples/grpo.yaml: reward against wall time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", default="batched,per-group,trl")
    parser.add_argument("--example", choices=["before", "after"], help="only run examples/grpo.yaml with that sampler")
    parser.add_argument("--curves", type=Path, nargs="+", help="only plot these metrics.jsonl against wall time")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/grpo_reward_time.png"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.curves:
        plot_curves(args.curves, args.out)
        return
    if args.example:
        run_example(args.example, args.out)
        return
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    from grpo_memory import cpu_report

    print(cpu_report(), flush=True)
    sides = args.sides.split(",")
    results = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, data, texts = build(root, args.prompts)
        for r in range(args.repeats):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                out = root / f"{side}{r}"
                res = trl(model_dir, texts, out, args) if side == "trl" else ours(model_dir, data, out, args, side)
                torch.set_num_threads(args.threads)  # a trainer may have picked its own
                results[side].append(res)
                print(json.dumps({"round": r, "side": side, **res}), flush=True)
    print(f"\n{args.prompts} prompts x group {args.group}, up to {args.completion} new tokens, {args.steps} timed steps, "
          f"LoRA r=16, fp32, {args.threads} threads")
    print("| side | completions/s | step peak (MiB) | prefill s | decode s | loss s | optimizer s | completion tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    med = {}
    for side, rows in results.items():
        med[side] = {k: statistics.median(x[k] for x in rows if x.get(k) is not None) if any(x.get(k) is not None for x in rows)
                     else None for k in ("completions_per_s", "step_bytes", "prefill_s", "decode_s", "loss_s",
                                         "optimizer_s", "completion_length")}
        m = med[side]
        fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
        print(f"| {side} | {fmt(m['completions_per_s'])} | {fmt(m['step_bytes'] and m['step_bytes'] / 2**20, '{:.1f}')} "
              f"| {fmt(m['prefill_s'])} | {fmt(m['decode_s'])} | {fmt(m['loss_s'])} | {fmt(m['optimizer_s'])} "
              f"| {fmt(m['completion_length'], '{:.1f}')} |")
    if "trl" in results:
        for side in [s for s in sides if s != "trl"]:
            for key, label in (("completions_per_s", "completions/s"), ("step_bytes", "step peak")):
                ratios = [o[key] / t[key] for o, t in zip(results[side], results["trl"])]
                print(f"{side} / TRL {label}: median {statistics.median(ratios):.2f}x "
                      f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json), "out": str(args.out)},
                                         "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
