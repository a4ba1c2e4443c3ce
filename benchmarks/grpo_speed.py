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
  group, its own generation with the KV cache, its default gradient checkpointing), set up by
  `_grpo_sides.trl_grpo_trainer` (shared with grpo_memory.py and grpo_reward_time.py).

Threads: `--threads default` gives each side the intra-op thread count it picks by itself on this
machine (ours: `maximus.kernels.cpu_threads`, from the cores and the load right now; TRL: torch's
default, every core); `--threads N` gives both N.

Reported per side: completions per second over the timed steps (generated completions / wall
seconds of those steps), the step peak (`MemoryMeter("cpu")`, live tensor storages, what a step
adds over the loaded model), and for ours the time split of a step: prefill and decode forwards
(timed by a forward hook on the decoder during sampling: a call on more than one new token is a
prefill), loss (everything else: rewards, log-prob passes, forward and backward) and the
optimizer step. The sides alternate over `--repeats` rounds; medians and ratios are printed.

    python benchmarks/grpo_speed.py [--prompts 4] [--group 8] [--completion 12] [--steps 3] [--repeats 2]
                                    [--threads default|N] [--sides batched,per-group,trl]
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

from _grpo_sides import cpu_report, length_reward, measure, small_llama_dir, trl_grpo_trainer  # noqa: E402

WORDS = "reverse the list of words and answer in order please red gold stone river".split()
#: torch's intra-op threads before anything here changed them: TRL's default.
DEFAULT_THREADS = torch.get_num_threads()


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
    model_dir = small_llama_dir(root)
    texts = [" ".join(WORDS[i % 5:i % 5 + 6 + 2 * i]) for i in range(prompts)]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t, "answer": "x"}) + "\n" for t in texts))
    return model_dir, data, texts


def ours(model_dir: Path, data: Path, out: Path, args, sampler: str) -> dict:
    import maximus
    from maximus.train.objectives.grpo import GRPOObjective

    cfg = {"model": str(model_dir), "dataset": {"path": str(data), "format": "prompt"}, "method": "lora",
           "objective": "grpo", "output_dir": str(out), "lora": {"r": 16, "alpha": 32},
           "training": {"batch_size": args.prompts, "max_steps": args.steps + 2, "seq_len": 64, "dtype": "fp32",
                        "warmup_steps": 0, "learning_rate": 1e-5},
           "grpo": {"group_size": args.group, "max_completion_tokens": args.completion, "beta": 0.0,
                    "loss_type": "dapo", "rewards": [f"{HERE / '_grpo_sides.py'}:length_reward"]},
           "eval": {"enabled": False}, "logging": {"progress": "none"}}
    trainer = maximus.Trainer(maximus.Config.from_dict(cfg))
    trainer.setup()  # picks its intra-op threads (OMP_NUM_THREADS when --threads N set it)
    threads = torch.get_num_threads()
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
           "loss_s": (seconds - clock.prefill - clock.decode - opt_s[0]) / args.steps, "threads": threads}
    # The step peak: one more step under the storage meter (it slows every allocation, so apart).
    peak = measure(lambda: trainer.train_step(args.steps + 2), trainer.model, trainer.optimizer)
    res.update(step_bytes=peak["step_bytes"], total_bytes=peak["total_bytes"])
    return res


def trl(model_dir: Path, texts: list[str], out: Path, args) -> dict:
    from transformers import TrainerCallback

    from maximus.memory.meter import MemoryMeter

    torch.set_num_threads(DEFAULT_THREADS if args.threads == "default" else int(args.threads))
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

    trainer = trl_grpo_trainer(model_dir, [{"prompt": t} for t in texts] * (args.steps + 3), out, prompts=args.prompts,
                               group=args.group, completion=args.completion, max_steps=args.steps + 2,
                               reward_funcs=[length_reward], callbacks=[Clock()], learning_rate=1e-5)
    trainer.train()
    seconds = marks["end"] - marks["start"]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_seconds": seconds / args.steps, "completions_per_s": args.steps * args.prompts * args.group / seconds,
            "completion_length": statistics.mean(lengths[1:args.steps + 1]),
            "step_bytes": marks["peak"] - marks["before"], "total_bytes": marks["peak"], "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", default="default", help="intra-op threads: N for both sides, or each side's default")
    parser.add_argument("--sides", default="batched,per-group,trl")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads != "default":
        os.environ["OMP_NUM_THREADS"] = str(int(args.threads))  # our trainer then keeps it
        torch.set_num_threads(int(args.threads))
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
                results[side].append(res)
                print(json.dumps({"round": r, "side": side, **res}), flush=True)
    print(f"\n{args.prompts} prompts x group {args.group}, up to {args.completion} new tokens, {args.steps} timed steps, "
          f"LoRA r=16, fp32, threads: {args.threads}")
    print("| side | threads | completions/s (range) | step peak (MiB) | prefill s | decode s | loss s | optimizer s | completion tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    med = {}
    for side, rows in results.items():
        med[side] = {k: statistics.median(x[k] for x in rows if x.get(k) is not None) if any(x.get(k) is not None for x in rows)
                     else None for k in ("completions_per_s", "step_bytes", "prefill_s", "decode_s", "loss_s",
                                         "optimizer_s", "completion_length")}
        m = med[side]
        fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
        rates = [x["completions_per_s"] for x in rows]
        print(f"| {side} | {'/'.join(str(x['threads']) for x in rows)} | {fmt(m['completions_per_s'])} "
              f"({min(rates):.2f}-{max(rates):.2f}) | {fmt(m['step_bytes'] and m['step_bytes'] / 2**20, '{:.1f}')} "
              f"| {fmt(m['prefill_s'])} | {fmt(m['decode_s'])} | {fmt(m['loss_s'])} | {fmt(m['optimizer_s'])} "
              f"| {fmt(m['completion_length'], '{:.1f}')} |")
    if "trl" in results:
        for side in [s for s in sides if s != "trl"]:
            for key, label in (("completions_per_s", "completions/s"), ("step_bytes", "step peak")):
                ratios = [o[key] / t[key] for o, t in zip(results[side], results["trl"])]
                print(f"{side} / TRL {label}: median {statistics.median(ratios):.2f}x "
                      f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
