"""What the user sees and what the run directory keeps: the live bar, metrics.jsonl, loss.png."""
from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import time
from pathlib import Path

from maximus.config import format_bytes


class MetricsLog:
    """Append-only metrics.jsonl: one JSON object per optimizer step, flushed as written so a killed
    run keeps every step it finished. On resume, lines past the resumed step are dropped."""

    def __init__(self, path: Path, resume_step: int = 0, sinks=None):
        self.path = path
        self.sinks = sinks  # `maximus.train.metric_loggers.Sinks`: every row also goes there
        rows = read_metrics(path)
        kept = [r for r in rows if r.get("step", 0) <= resume_step]
        tmp = path.with_name(".metrics.jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.sinks:
            self.sinks.step(row)

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill
    return rows


def run_figure(rows: list[dict], summary: dict | None = None, title: str = ""):
    """The figure of loss.png, from metrics.jsonl rows and the run summary (run.json's dict).

    Top: train loss per step, and the held-out loss (exact): before training at step 0, every
    `eval.every` steps, after training at the last step. Bottom: the measured peak memory of each
    step (MiB) against the budget (`target_vram`) and the planner's predicted peak, where the run
    has them. Returns a matplotlib Figure (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summary or {}
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r and r["loss"] is not None and math.isfinite(r["loss"])]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    before = summary.get("eval", {}).get("before", {}).get("loss")
    after = summary.get("eval", {}).get("after", {}).get("loss")
    last = summary.get("steps") or max((s for s, _ in train), default=0)
    if before is not None:
        evals.insert(0, (0, before))
    if after is not None:
        evals.append((last, after))
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(7, 6.5), dpi=110, sharex=True, height_ratios=(3, 2))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss (exact)")
    prompted = summary.get("eval", {}).get("prompted") or {}
    if prompted.get("loss") is not None:
        from maximus.evaluate.report import column_label

        ax.axhline(prompted["loss"], color="tab:purple", linestyle="--", linewidth=1.0,
                   label=f"{column_label(prompted)} held-out loss {prompted['loss']:.2f}")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "Maximus training loss")
    ax.grid(alpha=0.3)
    result = summary.get("eval", {}).get("verdict") or {}
    ax.legend(title=textwrap.fill(result["text"], 60) if result.get("text") else None, title_fontsize="small")

    mib = 2 ** 20
    peaks = [(r["step"], r["peak_memory_bytes"] / mib) for r in rows if r.get("peak_memory_bytes")]
    if peaks:
        mem.plot(*zip(*peaks), ".-", label="measured peak per step", linewidth=1.0)
    budget = summary.get("memory", {}).get("budget_bytes")
    predicted = summary.get("plan", {}).get("peak_bytes")
    if budget:
        mem.axhline(budget / mib, color="tab:red", linestyle="--", label=f"budget {format_bytes(budget)}")
    if predicted:
        mem.axhline(predicted / mib, color="tab:green", linestyle=":", label=f"planner prediction {format_bytes(predicted)}")
    mem.set_xlabel("optimizer step")
    mem.set_ylabel("memory (MiB)")
    mem.grid(alpha=0.3)
    if mem.get_lines():
        mem.legend()
    fig.tight_layout()
    return fig


def plot_loss(metrics_path: Path, out: Path, title: str = "", summary: dict | None = None) -> None:
    """loss.png (written atomically): see `run_figure`."""
    import matplotlib.pyplot as plt

    fig = run_figure(read_metrics(metrics_path), summary, title)
    tmp = out.with_name(".loss.png.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)


class ProgressDisplay:
    """Live progress: step/total, loss, (GRPO) mean reward, lr, tokens/s, memory now / peak / budget, ETA.

    `rich` draws a bar on a terminal; elsewhere (CI, logs) a plain line every `every` steps."""

    def __init__(self, total_steps: int, start_step: int = 0, mode: str = "auto", every: int = 1,
                 budget_bytes: int | None = None, stream=None):
        self.total = total_steps
        self.start = start_step
        self.every = every
        self.budget = budget_bytes
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "rich" if self.stream.isatty() else "plain"
        self.mode = mode
        self._t0 = time.perf_counter()
        self._memory: tuple[int | None, int | None] = (None, None)  # the last metered step's
        self._progress = None
        if mode == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                      console=Console(file=self.stream), transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def _eta(self, step: int) -> str:
        done = step - self.start
        if done <= 0:
            return "?"
        left = (time.perf_counter() - self._t0) / done * (self.total - step)
        return time.strftime("%H:%M:%S", time.gmtime(left))

    def info(self, row: dict) -> str:
        if "peak_memory_bytes" in row:  # a step run without the meter shows the last metered one's
            self._memory = (row.get("memory_bytes"), row["peak_memory_bytes"])
        current, peak = self._memory
        mem = f"mem {format_bytes(current)}/{format_bytes(peak)}"
        if self.budget:
            mem += f"/{format_bytes(self.budget)}"
        loss = row.get("loss")
        loss_s = f"{loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else "skipped"
        reward = f"reward {row['reward']:.3f}  " if isinstance(row.get("reward"), float) else ""  # objective grpo
        return f"loss {loss_s}  {reward}lr {row.get('lr', 0):.2e}  {row.get('tokens_per_s', 0):,.0f} tok/s  {mem}"

    def update(self, row: dict) -> None:
        step = row["step"]
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=self.info(row))
        elif self.mode == "plain" and (step % self.every == 0 or step == self.total):
            print(f"step {step}/{self.total}  {self.info(row)}  eta {self._eta(step)}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        elif self.mode != "none":
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
