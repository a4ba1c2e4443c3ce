"""examples/grpo.yaml's reward against wall time: ours and TRL's GRPOTrainer (no vLLM) side by side.

Both sides run at the same time, each in its own process with the same intra-op threads
(`--threads`, 1 by default: the processes share the machine evenly), every seed of `--seeds` at
once (two processes per seed), from the same start: the quickstart's adapter (trained first when
`runs/quickstart/adapter` is missing) on `builtin:tiny-llama`, the example's prompts, rewards
(`exact_answer` + `reversed_words`, weights 1 + 1), 4 prompts x group 8 per optimizer step, 32
new tokens, temperature 1, beta 0, loss_type dapo, rewards scaled per group, learning rate 1e-4
with 5 warm-up steps then constant, no gradient checkpointing, `--steps` optimizer steps each,
seeded by the seed (ours: `training.seed`; TRL: `seed`, which orders its prompts and seeds its
sampling):

- ours: `maximus.Trainer` on examples/grpo.yaml as shipped (only `output_dir`, `max_steps` and
  `eval` changed: no held-out evaluation, so both sides train on every prompt and nothing but
  steps runs beside the other side). The example samples 8 prompts x 8 at once and trains them
  as two steps of 4 prompts (`steps_per_generation: 2`);
- TRL: `GRPOTrainer` with the same settings per optimizer step (`_grpo_sides.trl_grpo_trainer`:
  `batch_size / steps_per_generation` = 4 prompts x 8 per step, sampled every step, TRL's
  default `steps_per_generation` 1; `--trl-steps-per-generation 2` samples 8 prompts for two
  steps, as the example does), the same adapter loaded trainable (LoRA + the saved embedding and head), and our
  learning-rate schedule (`maximus.train.trainer.lr_factor`: Transformers' `constant_with_warmup`
  would start at 0 and climb by 1/5 per step, ours starts at 1/6), with torch AdamW as
  Transformers builds it.

Each side records, per optimizer step, the mean reward of its sampled completions, the wall
seconds its steps took so far (ours: metrics.jsonl `step_time_s`; TRL: step begin to step end)
and the process's CPU seconds over the same spans. The plot draws each seed's trailing mean (the
last 10 steps) against wall time, faint, and the mean over seeds bold; the tables compare the
sides at eight equal wall times and eight equal CPU times (shares of the shortest run), seed by
seed and pooled (the mean over seeds, with the seeds' range), after each side's seconds a step
(and ours / TRL's, the median over seeds) and how many of our steps ran under the memory meter.

    python benchmarks/grpo_reward_time.py [--steps 120] [--seeds 0,1,2] [--threads 1] [--json points.json]
                                          [--trl-steps-per-generation 1]
                                          [--out docs/benchmarks/grpo_reward_time.png]
    python benchmarks/grpo_reward_time.py --replot points.json   # tables and plot again
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
EXAMPLE = ROOT / "examples" / "grpo.yaml"

from _grpo_sides import WINDOW, reward_axes, save_plot, trailing_mean  # noqa: E402  (benchmarks/ is on the path now)


def example_config() -> dict:
    import yaml

    return yaml.safe_load(EXAMPLE.read_text())


def ensure_quickstart_adapter() -> Path:
    adapter = ROOT / example_config()["init_adapter"]
    if not (adapter / "adapter_config.json").exists():
        print(f"training the quickstart first ({adapter} is missing)", flush=True)
        entry = [sys.executable, "-c", "from maximus.cli import train_entry; train_entry()"]
        subprocess.run([*entry, "--config", str(ROOT / "examples" / "quickstart.yaml")], cwd=ROOT, check=True)
    return adapter


def run_ours(steps: int, out: Path, seed: int) -> list[dict]:
    import maximus

    cfg = example_config()
    cfg["output_dir"] = str(out)
    cfg["training"]["seed"] = seed
    cfg["training"]["max_steps"] = steps
    cfg["training"]["log_every"] = 1
    cfg["training"]["save_every"] = steps
    cfg["eval"] = {"enabled": False, "split": 0.0}
    trainer = maximus.Trainer(maximus.Config.from_dict(cfg))
    measured, cpu = trainer._measured_step, {}

    def step(step, run):  # the process's CPU seconds of each step, beside metrics.jsonl's wall seconds
        begin = time.process_time()
        try:
            return measured(step, run)
        finally:
            cpu[step] = time.process_time() - begin

    trainer._measured_step = step
    trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("reward") is not None and "step_time_s" in r]
    wall, cpu_s, points = 0.0, 0.0, []
    for r in rows:
        wall, cpu_s = wall + r["step_time_s"], cpu_s + cpu[r["step"]]
        points.append({"step": r["step"], "wall_s": wall, "cpu_s": cpu_s, "reward": r["reward"],
                       "metered": "peak_memory_bytes" in r})
    return points


def run_trl(steps: int, out: Path, seed: int, callbacks=(), steps_per_generation: int = 1) -> list[dict]:
    """TRL's side: its points (step, wall seconds, reward); `callbacks`: more TrainerCallbacks;
    `steps_per_generation`: TRL's (1, its default: sampled every step)."""
    from transformers import TrainerCallback

    from _grpo_sides import trl_grpo_trainer
    from maximus import Config
    from maximus.builtin import materialize
    from maximus.train.rewards import exact_answer
    from maximus.train.trainer import lr_factor

    sys.path.insert(0, str(ROOT / "examples"))
    from grpo_rewards import reversed_words

    cfg = example_config()
    g, t = cfg["grpo"], cfg["training"]
    training = Config.from_dict(cfg).training
    rows = [json.loads(line) for line in (ROOT / cfg["dataset"]["path"]).read_text().splitlines() if line.strip()]
    points, clock = [], {"wall": 0.0, "cpu": 0.0, "begin": 0.0, "begin_cpu": 0.0}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock["begin"], clock["begin_cpu"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            clock["wall"] += time.perf_counter() - clock["begin"]
            clock["cpu"] += time.process_time() - clock["begin_cpu"]

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                points.append({"step": state.global_step, "wall_s": clock["wall"], "cpu_s": clock["cpu"],
                               "reward": logs["reward"]})

    trainer = trl_grpo_trainer(materialize(cfg["model"]), rows, out, prompts=t["batch_size"] // g.get("steps_per_generation", 1),
                               group=g["group_size"],
                               completion=g["max_completion_tokens"], max_steps=steps,
                               reward_funcs=[exact_answer, reversed_words], callbacks=[Clock(), *callbacks],
                               gradient_checkpointing=False, adapter=ROOT / cfg["init_adapter"],
                               learning_rate=t["learning_rate"], lr_lambda=lambda step: lr_factor(step, training, steps),
                               temperature=g["temperature"], scale_rewards=g["scale_rewards"],
                               reward_weights=g["reward_weights"], seed=seed,
                               steps_per_generation=steps_per_generation)
    trainer.train()
    return points


SIDES = ("ours (maximus)", "TRL GRPOTrainer")
#: The equal-time points of the tables: these shares of the shortest run.
SHARES = tuple(k / 8 for k in range(1, 9))


def reward_at(points: list[dict], at: float, axis: str = "wall_s") -> float | None:
    """The trailing mean reward of the last step finished by `at` seconds of `axis` (None before the first)."""
    smooth = trailing_mean([p["reward"] for p in points])
    done = [s for p, s in zip(points, smooth) if p[axis] <= at]
    return done[-1] if done else None


def horizon(runs: dict, axis: str) -> float:
    """The shortest run's last time on `axis`: every side of every seed got that far."""
    return min(curves[side][-1][axis] for curves in runs.values() for side in SIDES)


def plot(runs: dict, out: Path, title: str) -> None:
    """Each seed faint (the trailing mean), the mean over seeds bold, on wall time."""
    fig, ax = reward_axes((7.5, 3.8))
    end = horizon(runs, "wall_s")
    grid = [end * k / 100 for k in range(1, 101)]
    for side, color in zip(SIDES, ("tab:blue", "tab:orange")):
        for curves in runs.values():
            points = curves[side]
            ax.plot([p["wall_s"] for p in points], trailing_mean([p["reward"] for p in points]), color=color,
                    linewidth=0.7, alpha=0.35)
        at = [(t, [reward_at(c[side], t) for c in runs.values()]) for t in grid]
        at = [(t, sum(v) / len(v)) for t, v in at if None not in v]
        steps = statistics.mean(len(c[side]) / c[side][-1]["wall_s"] for c in runs.values())
        ax.plot([t for t, _ in at], [v for _, v in at], color=color, linewidth=2.0,
                label=f"{side}: mean of {len(runs)} seeds, {1 / steps:.2f} s a step (faint: each seed)")
    ax.set_xlabel("training wall time (s, sum of step times)")
    ax.set_ylabel(f"reward of the sampled completions\n(mean of the last {WINDOW} steps)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    save_plot(fig, ax, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, each run by both sides (prompt order and "
                                                      "sampling); all of them at once")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each side")
    parser.add_argument("--trl-steps-per-generation", type=int, default=1,
                        help="TRL's steps_per_generation (1, its default: it samples every step; 2: one generation "
                             "of 8 prompts for two steps, as the example does)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "grpo_reward_time.png")
    parser.add_argument("--json", type=Path, help="also write both sides' points here")
    parser.add_argument("--replot", type=Path, help="only redraw (and tabulate) the points of an earlier --json")
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)  # one side, in its own process
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--points", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        import torch

        torch.set_num_threads(args.threads)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / args.side
            points = (run_ours(args.steps, out, args.seed) if args.side == "ours" else
                      run_trl(args.steps, out, args.seed, steps_per_generation=args.trl_steps_per_generation))
        args.points.write_text(json.dumps(points))
        return
    if args.replot:
        report(json.loads(args.replot.read_text()), args)
        return
    ensure_quickstart_adapter()
    from _grpo_sides import cpu_report

    print(cpu_report(), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    seeds = [int(x) for x in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        files = {(seed, side): Path(tmp) / f"{side}{seed}.json" for seed in seeds for side in ("ours", "trl")}
        procs = {key: subprocess.Popen([sys.executable, __file__, "--side", key[1], "--steps", str(args.steps),
                                        "--seed", str(key[0]), "--threads", str(args.threads), "--points", str(path),
                                        "--trl-steps-per-generation", str(args.trl_steps_per_generation)],
                                       cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
                 for key, path in files.items()}
        for key, proc in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"the {key[1]} side of seed {key[0]} failed (exit {proc.returncode})")
        runs = {str(seed): {SIDES[0]: json.loads(files[seed, "ours"].read_text()),
                            SIDES[1]: json.loads(files[seed, "trl"].read_text())} for seed in seeds}
    run_args = {"steps": args.steps, "seeds": args.seeds, "threads": args.threads, "machine": machine(),
                "trl_steps_per_generation": args.trl_steps_per_generation,
                "date": time.strftime("%Y-%m-%d", time.gmtime())}
    if args.json:
        args.json.write_text(json.dumps({"args": run_args, "runs": runs}, indent=1))
    report({"args": run_args, "runs": runs}, args)


def equal_time_table(runs: dict, axis: str, label: str, end: float) -> None:
    """A Markdown table: each side's steps done and reward (mean of the last WINDOW steps) at the
    SHARES of `end` seconds of `axis`, and ours minus TRL's; over several seeds the mean, with the
    seeds' range."""
    pooled = len(runs) > 1

    def cell(values, fmt):
        text = format(statistics.mean(values), fmt)
        return f"{text} ({format(min(values), fmt)} to {format(max(values), fmt)})" if pooled else text

    print(f"| {label} | ours: steps | ours: reward | TRL: steps | TRL: reward | ours - TRL |")
    print("|---:|---:|---:|---:|---:|---:|")
    for share in SHARES:
        at, cells, per_side = share * end, [], []
        for side in SIDES:
            values = [reward_at(c[side], at, axis) for c in runs.values()]
            steps = [sum(p[axis] <= at for p in c[side]) for c in runs.values()]
            per_side.append(values)
            cells += [f"{statistics.mean(steps):.0f}", "-" if None in values else cell(values, ".3f")]
        if None in per_side[0] or None in per_side[1]:
            cells.append("-")
        else:
            cells.append(cell([a - b for a, b in zip(*per_side)], "+.3f"))
        print(f"| {at:.1f} | " + " | ".join(cells) + " |")


def report(data: dict, args) -> None:
    """Per seed and as the mean over seeds: the reward at equal wall times and at equal CPU
    seconds, the seconds a step; then the plot."""
    runs, run_args = data["runs"], data["args"]
    print(f"\n{run_args['steps']} steps each, seeds {run_args['seeds']}, {run_args['threads']} thread(s) per side, "
          "all processes at once")
    for side in SIDES:
        for seed, curves in runs.items():
            points = curves[side]
            print(f"{side}, seed {seed}: {len(points)} steps in {points[-1]['wall_s']:.1f} s wall "
                  f"({points[-1]['wall_s'] / len(points):.2f} s a step), {points[-1]['cpu_s']:.1f} CPU s "
                  f"({points[-1]['cpu_s'] / len(points):.3f} a step), final mean of last {WINDOW}: "
                  f"{trailing_mean([p['reward'] for p in points])[-1]:.3f}"
                  + (f"; {sum(p['metered'] for p in points)} steps metered" if "metered" in points[0] else ""))
    per_step = {side: [(c[side][-1]["wall_s"] / len(c[side]), c[side][-1]["cpu_s"] / len(c[side])) for c in runs.values()]
                for side in SIDES}
    for i, unit in enumerate(("wall s", "CPU s")):
        ours, trl = ([v[i] for v in per_step[side]] for side in SIDES)
        ratios = [a / b for a, b in zip(ours, trl)]
        print(f"{unit} a step, median over seeds: ours {statistics.median(ours):.3f}, TRL {statistics.median(trl):.3f}; "
              f"ours / TRL {statistics.median(ratios):.2f}x (seeds {', '.join(f'{r:.2f}' for r in ratios)})")
    for axis, label in (("wall_s", "wall time (s)"), ("cpu_s", "CPU time (s)")):
        end = horizon(runs, axis)
        for seed in runs:
            print(f"\nseed {seed}, at equal {label.split(' (')[0]}:")
            equal_time_table({seed: runs[seed]}, axis, label, end)
        if len(runs) > 1:
            print(f"\nall seeds pooled (mean over seeds, the seeds' range in brackets), at equal {label.split(' (')[0]}:")
            equal_time_table(runs, axis, label, end)
    plot(runs, args.out, f"examples/grpo.yaml, ours vs TRL GRPOTrainer (no vLLM), run side by side, {run_args['threads']} "
                         f"thread each\n{run_args.get('machine', machine())}, {run_args.get('date', '?')}, "
                         f"benchmarks/grpo_reward_time.py --steps {run_args['steps']} --seeds {run_args['seeds']}")


def machine() -> str:
    """The CPU in a few words for the plot's title: its cores and widest vector unit."""
    from _machine import cpuinfo

    info = cpuinfo("flags", "model name")
    if len(info) < 2:
        return f"{os.cpu_count()}-core CPU"
    flags, model = info["flags"].split(), info["model name"]
    vendor = "AMD EPYC" if "EPYC" in model else model
    unit = ("AVX512-BF16" if "avx512_bf16" in flags else "AVX512" if "avx512f" in flags
            else "AVX2 only" if "avx2" in flags else "no AVX2")
    return f"{os.cpu_count()}-core {vendor} ({unit})"


if __name__ == "__main__":
    main()
