"""Where a GRPO step's time goes on examples/grpo.yaml: ours and TRL's GRPOTrainer (no vLLM), side by side
in one process, alternating.

Both sides run the example's settings as `grpo_reward_time.py` sets them up (`run_ours_trainer`,
`run_trl`: the quickstart's adapter, 4 prompts x group 8, 32 new tokens, fp32, the same rewards
and schedule, the same intra-op threads) for `--steps` optimizer steps, `--repeats` rounds, the
order of the sides swapped each round. Each phase is timed by wrapping the same calls on both
sides (perf_counter):

- prefill / decode: the decoder's forwards while the side samples (a forward hook on the base
  model's decoder: a call on more than one new token is a prefill);
- generation other: the rest of the sampling call (the sampling loop, the draw, KV cache upkeep);
- rewards: the reward functions and advantages (ours: `_score`; TRL: `_calculate_rewards`);
- loss forward: the loss pass's forward (ours: the trainer's step module; TRL: `compute_loss`);
- backward: `torch.Tensor.backward`; optimizer: `clip_grad_norm_` and the optimizer's step;
- other: the rest of the step (data, collation, the memory meter, logging, the trainer's loop).

The first `--warmup` steps of each side are not counted; the table is the mean per step over the
rest (the mean is what wall time sees; a metered step of ours counts with its cost).

    python benchmarks/grpo_step_split.py [--steps 20] [--warmup 2] [--repeats 2] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PHASES = ("prefill", "decode", "generation other", "rewards", "loss forward", "backward", "optimizer", "other")


class Clock:
    """Seconds per phase, accumulated; `step_begin` / `step_end` cut them into steps."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.totals, self.steps, self.sampling, self._begin, self._start = defaultdict(float), [], False, {}, 0.0

    @contextmanager
    def phase(self, name: str):
        t = self.clock()
        try:
            yield
        finally:
            self.totals[name] += self.clock() - t

    def wrap(self, owner, attribute: str, name: str, sampling: bool = False):
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            with self.phase(name):
                if not sampling:
                    return original(*args, **kwargs)
                self.sampling = True
                try:
                    return original(*args, **kwargs)
                finally:
                    self.sampling = False

        setattr(owner, attribute, timed)
        return original

    def watch_decoder(self, model) -> None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        starts = []
        base.model.register_forward_pre_hook(lambda module, args: starts.append(self.clock()))

        def post(module, args, kwargs, output):
            seconds = self.clock() - starts.pop()
            if self.sampling:
                ids = kwargs.get("input_ids", args[0] if args else None)
                self.totals["prefill" if ids is not None and ids.shape[1] > 1 else "decode"] += seconds

        base.model.register_forward_hook(post, with_kwargs=True)

    def step_begin(self) -> None:
        self._begin, self._start = dict(self.totals), self.clock()

    def step_end(self) -> None:
        row = {k: v - self._begin.get(k, 0.0) for k, v in self.totals.items()}
        row["step"] = self.clock() - self._start
        self.steps.append(row)


def split(row: dict) -> dict:
    """A step's phases as the table shows them (generation other = sampling - its forwards)."""
    out = {k: row.get(k, 0.0) for k in ("prefill", "decode", "rewards", "loss forward", "backward")}
    out["generation other"] = row.get("sampling", 0.0) - out["prefill"] - out["decode"]
    out["optimizer"] = row.get("optimizer", 0.0) + row.get("clip", 0.0)
    out["other"] = row["step"] - sum(out.values())
    out["step"] = row["step"]
    return out


def patch_common(clock: Clock):
    import torch

    clock.wrap(torch.Tensor, "backward", "backward")
    clock.wrap(torch.nn.utils, "clip_grad_norm_", "clip")


def run_ours(steps: int, out: Path, seed: int, clock: Clock) -> None:
    import maximus
    from grpo_reward_time import example_config
    from maximus.train.objectives.grpo import GRPOObjective

    cfg = example_config()
    cfg["output_dir"] = str(out)
    cfg["training"].update(seed=seed, max_steps=steps, log_every=1, save_every=steps)
    cfg["eval"] = {"enabled": False, "split": 0.0}
    cfg["logging"] = {"progress": "none"}
    trainer = maximus.Trainer(maximus.Config.from_dict(cfg))
    originals = [clock.wrap(GRPOObjective, "sample", "sampling", sampling=True),
                 clock.wrap(GRPOObjective, "_score", "rewards")]
    measured = trainer._measured_step

    def step(*args, **kwargs):
        clock.step_begin()
        try:
            return measured(*args, **kwargs)
        finally:
            clock.step_end()

    trainer._measured_step = step
    setup = trainer.setup

    def setup_then_watch():
        setup()
        clock.watch_decoder(trainer.model)
        clock.wrap(trainer, "step_module", "loss forward")
        clock.wrap(trainer.optimizer, "step", "optimizer")

    trainer.setup = setup_then_watch
    try:
        trainer.train()
    finally:
        GRPOObjective.sample, GRPOObjective._score = originals


def run_trl_side(steps: int, out: Path, seed: int, clock: Clock) -> None:
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    import grpo_reward_time

    class Steps(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            clock.watch_decoder(model)
            trainer = holder["trainer"]
            clock.wrap(trainer.optimizer, "step", "optimizer")

        def on_step_begin(self, args, state, control, **kw):
            clock.step_begin()

        def on_step_end(self, args, state, control, **kw):
            clock.step_end()

    holder = {}
    originals = {name: getattr(GRPOTrainer, name) for name in ("_generate_single_turn", "_calculate_rewards", "compute_loss")}
    clock.wrap(GRPOTrainer, "_generate_single_turn", "sampling", sampling=True)
    clock.wrap(GRPOTrainer, "_calculate_rewards", "rewards")
    clock.wrap(GRPOTrainer, "compute_loss", "loss forward")
    init = GRPOTrainer.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        holder["trainer"] = self

    GRPOTrainer.__init__ = keep
    try:
        grpo_reward_time.run_trl(steps, out, seed, callbacks=[Steps()])
    finally:
        GRPOTrainer.__init__ = init
        for name, fn in originals.items():
            setattr(GRPOTrainer, name, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both sides")
    parser.add_argument("--cpu", action="store_true", help="CPU seconds of the process (time.process_time) instead of wall "
                                                           "seconds: what another job's load on the cores changes least")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # our trainer then keeps it
    import torch

    torch.set_num_threads(args.threads)
    from _grpo_sides import cpu_report
    from grpo_reward_time import ensure_quickstart_adapter

    ensure_quickstart_adapter()
    print(cpu_report(), flush=True)
    results = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for side in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
                clock = Clock(time.process_time if args.cpu else time.perf_counter)
                patch_common(clock)
                try:
                    (run_ours if side == "ours" else run_trl_side)(args.steps, Path(tmp) / f"{side}{r}", args.seed, clock)
                finally:
                    torch.Tensor.backward = clock_originals["backward"]
                    torch.nn.utils.clip_grad_norm_ = clock_originals["clip"]
                rows = [split(s) for s in clock.steps[args.warmup:]]
                mean = {k: statistics.mean(x[k] for x in rows) for k in (*PHASES, "step")}
                results[side].append(mean | {"per_step": rows})
                print(json.dumps({"round": r, "side": side, "steps": len(rows), **{k: round(v, 4) for k, v in mean.items()}}),
                      flush=True)
    print(f"\nexamples/grpo.yaml settings, {args.steps} steps per side and round ({args.warmup} not counted), "
          f"{args.repeats} rounds, {args.threads} thread(s), {'CPU' if args.cpu else 'wall'} seconds per step (mean over steps, median over rounds)")
    print("| side | step | " + " | ".join(PHASES) + " |")
    print("|---|---:|" + "---:|" * len(PHASES))
    med = {side: {k: statistics.median(m[k] for m in ms) for k in (*PHASES, "step")} for side, ms in results.items()}
    for side, m in med.items():
        print(f"| {side} | {m['step']:.3f} | " + " | ".join(f"{m[k]:.3f}" for k in PHASES) + " |")
    ratios = [o["step"] / t["step"] for o, t in zip(results["ours"], results["trl"])]
    print(f"ours / TRL step time: median {statistics.median(ratios):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


def _originals() -> dict:
    import torch

    return {"backward": torch.Tensor.backward, "clip": torch.nn.utils.clip_grad_norm_}


clock_originals = _originals()

if __name__ == "__main__":
    main()
