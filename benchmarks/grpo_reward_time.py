"""examples/grpo.yaml's reward against wall time: ours and TRL's GRPOTrainer (no vLLM) side by side.

Both sides run at the same time, each in its own process with the same intra-op threads
(`--threads`, 1 by default: the two share the machine evenly), from the same start: the
quickstart's adapter (trained first when `runs/quickstart/adapter` is missing) on
`builtin:tiny-llama`, the example's prompts, rewards (`exact_answer` + `reversed_words`, weights
1 + 1), 4 prompts x group 8, 32 new tokens, temperature 1, beta 0, loss_type dapo, rewards scaled
per group, learning rate 1e-4 with 5 warm-up steps then constant, no gradient checkpointing,
`--steps` optimizer steps each, seeded by `--seed` (ours: `training.seed`; TRL: `seed`, which
orders its prompts and seeds its sampling):

- ours: `maximus.Trainer` on examples/grpo.yaml as shipped (only `output_dir`, `max_steps` and
  `eval` changed: no held-out evaluation, so both sides train on every prompt and nothing but
  steps runs beside the other side);
- TRL: `GRPOTrainer` with the same settings (`_grpo_sides.trl_grpo_trainer`), the same adapter
  loaded trainable (LoRA + the saved embedding and head), and our learning-rate schedule
  (`maximus.train.trainer.lr_factor`: Transformers' `constant_with_warmup` would start at 0 and
  climb by 1/5 per step, ours starts at 1/6), with torch AdamW as Transformers builds it.

Each side records, per optimizer step, the mean reward of its sampled completions and the wall
seconds its steps took so far (ours: metrics.jsonl `step_time_s`; TRL: step begin to step end).
The plot draws both against wall time (faint: each step; bold: the mean of the last 10 steps),
and the table compares them at equal wall times.

    python benchmarks/grpo_reward_time.py [--steps 120] [--seed 0] [--threads 1] [--out docs/benchmarks/grpo_reward_time.png]
"""
from __future__ import annotations

import argparse
import json
import os
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
    maximus.Trainer(maximus.Config.from_dict(cfg)).train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("reward") is not None and "step_time_s" in r]
    wall, points = 0.0, []
    for r in rows:
        wall += r["step_time_s"]
        points.append({"step": r["step"], "wall_s": wall, "reward": r["reward"]})
    return points


def run_trl(steps: int, out: Path, seed: int, callbacks=()) -> list[dict]:
    """TRL's side: its points (step, wall seconds, reward); `callbacks`: more TrainerCallbacks."""
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
    points, clock = [], {"wall": 0.0, "begin": 0.0}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock["begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            clock["wall"] += time.perf_counter() - clock["begin"]

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                points.append({"step": state.global_step, "wall_s": clock["wall"], "reward": logs["reward"]})

    trainer = trl_grpo_trainer(materialize(cfg["model"]), rows, out, prompts=t["batch_size"] // g.get("steps_per_generation", 1),
                               group=g["group_size"],
                               completion=g["max_completion_tokens"], max_steps=steps,
                               reward_funcs=[exact_answer, reversed_words], callbacks=[Clock(), *callbacks],
                               gradient_checkpointing=False, adapter=ROOT / cfg["init_adapter"],
                               learning_rate=t["learning_rate"], lr_lambda=lambda step: lr_factor(step, training, steps),
                               temperature=g["temperature"], scale_rewards=g["scale_rewards"],
                               reward_weights=g["reward_weights"], seed=seed)
    trainer.train()
    return points


def reward_at(points: list[dict], wall_s: float) -> float | None:
    """The trailing mean reward of the last step finished by `wall_s` (None before the first)."""
    smooth = trailing_mean([p["reward"] for p in points])
    done = [s for p, s in zip(points, smooth) if p["wall_s"] <= wall_s]
    return done[-1] if done else None


def plot(curves: dict[str, list[dict]], out: Path, title: str) -> None:
    fig, ax = reward_axes((7.5, 3.8))
    for (name, points), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        wall, values = [p["wall_s"] for p in points], [p["reward"] for p in points]
        ax.plot(wall, values, color=color, linewidth=0.7, alpha=0.3)
        ax.plot(wall, trailing_mean(values), color=color, linewidth=1.8,
                label=f"{name}: {len(points)} steps in {wall[-1]:.0f} s (bold: mean of the last {WINDOW} steps)")
    ax.set_xlabel("training wall time (s, sum of step times)")
    ax.set_ylabel("mean reward of the sampled completions")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    save_plot(fig, ax, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0, help="both sides' seed (prompt order and sampling)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each side")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "grpo_reward_time.png")
    parser.add_argument("--json", type=Path, help="also write both sides' points here")
    parser.add_argument("--replot", type=Path, help="only redraw (and tabulate) the points of an earlier --json")
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)  # one side, in its own process
    parser.add_argument("--points", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        import torch

        torch.set_num_threads(args.threads)
        with tempfile.TemporaryDirectory() as tmp:
            points = (run_ours if args.side == "ours" else run_trl)(args.steps, Path(tmp) / args.side, args.seed)
        args.points.write_text(json.dumps(points))
        return
    if args.replot:
        report(json.loads(args.replot.read_text()), args)
        return
    ensure_quickstart_adapter()
    from _grpo_sides import cpu_report

    print(cpu_report(), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        files = {side: Path(tmp) / f"{side}.json" for side in ("ours", "trl")}
        procs = {side: subprocess.Popen([sys.executable, __file__, "--side", side, "--steps", str(args.steps),
                                         "--seed", str(args.seed), "--threads", str(args.threads),
                                         "--points", str(path)], cwd=ROOT, env=env,
                                        stdout=subprocess.DEVNULL)
                 for side, path in files.items()}
        for side, proc in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"the {side} side failed (exit {proc.returncode})")
        curves = {"ours (maximus)": json.loads(files["ours"].read_text()),
                  "TRL GRPOTrainer": json.loads(files["trl"].read_text())}
    if args.json:
        args.json.write_text(json.dumps(curves, indent=1))
    report(curves, args)


def report(curves: dict[str, list[dict]], args) -> None:
    """The table at equal wall times and the plot."""
    ours, trl = curves.values()
    horizon = min(ours[-1]["wall_s"], trl[-1]["wall_s"])
    print(f"\n{args.steps} steps each, seed {args.seed}, {args.threads} thread(s) per side, both at once")
    print("| wall time (s) | ours: steps done | ours: reward (mean of last 10) | TRL: steps done | TRL: reward |")
    print("|---:|---:|---:|---:|---:|")
    for share in (0.25, 0.5, 0.75, 1.0):
        at = share * horizon
        cells = []
        for points in (ours, trl):
            reward = reward_at(points, at)
            cells += [str(sum(p["wall_s"] <= at for p in points)), "-" if reward is None else f"{reward:.3f}"]
        print(f"| {at:.0f} | " + " | ".join(cells) + " |")
    for name, points in curves.items():
        print(f"{name}: {len(points)} steps in {points[-1]['wall_s']:.1f} s, {points[-1]['wall_s'] / len(points):.2f} s/step, "
              f"final mean of last {WINDOW}: {trailing_mean([p['reward'] for p in points])[-1]:.3f}")
    plot(curves, args.out, f"examples/grpo.yaml, ours vs TRL GRPOTrainer (no vLLM), run side by side, {args.threads} thread "
                           f"each\n2-core AMD EPYC (AVX2, loaded), 2026-12-02, benchmarks/grpo_reward_time.py --steps {args.steps} --seed {args.seed}")


if __name__ == "__main__":
    main()
