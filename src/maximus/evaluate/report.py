"""The end-of-run table (base / base + K-shot / tuned) and the verdict against prompting.

`verdict(after, prompted, metrics)` compares the tuned model with the prompted base on each task
metric (a difference counts when it passes 1 point: 1 percentage point for metrics in 0..1, one
unit of chrF) and on the held-out loss, and says it in one line:

- "fine-tuned beats 4-shot prompting: exact match 71 % vs 38 %, held-out loss 0.61 vs 1.92"
- "4-shot prompting is within 1 point of the fine-tune: you may not need it (held-out loss ...)"
- "4-shot prompting beats the fine-tune: ...: you may not need it"
- "mixed: fine-tuned beats 4-shot prompting on ..., prompting wins on ..."

Without task metrics the held-out loss decides. `summary_lines` draws the table that the trainer
prints and `maximus eval` prints.
"""
from __future__ import annotations

from maximus.evaluate.metrics import POINT

LABELS = {"exact_match": "exact match", "rouge_l": "ROUGE-L", "chrf": "chrF"}

#: Rows of the table besides the task metrics: (key, format) for what the objectives report.
FIXED_ROWS = (("loss", "{:.4f}"), ("perplexity", "{:.2f}"), ("reward", "{:.3f}"),
              ("rewards/accuracy", "{:.1%}"), ("rewards/margin", "{:.3f}"))


def metric_text(name: str, value: float | None) -> str:
    """A metric as the table and the verdict show it: exact match in %, ROUGE-L x 100, chrF as is."""
    if value is None:
        return "-"
    if name == "exact_match":
        return f"{value:.0%}".replace("%", " %")
    if name == "rouge_l":
        return f"{100 * value:.1f}"
    if name == "chrf":
        return f"{value:.1f}"
    return f"{value:.3f}"


def prompting_label(prompted: dict) -> str:
    k = prompted.get("few_shot", 0)
    return f"{k}-shot prompting" if k else "system-prompted base"


def column_label(prompted: dict) -> str:
    k = prompted.get("few_shot", 0)
    return f"base + {k}-shot" if k else "base + prompt"


def verdict(after: dict, prompted: dict, metrics: list[str]) -> dict | None:
    """{"text", "winner": fine-tuned | prompting | tie | mixed, "few_shot", "points": {metric:
    tuned - prompted in points}, "loss": [tuned, prompted]}; None without both columns."""
    if not after or not prompted:
        return None
    label = prompting_label(prompted)
    points = {}
    for name in metrics:
        a, p = after.get(name), prompted.get(name)
        if a is not None and p is not None:
            points[name] = (a - p) / POINT.get(name, 0.01)
    la, lp = after.get("loss"), prompted.get("loss")
    loss = f"held-out loss {la:.2f} vs {lp:.2f}" if la is not None and lp is not None else None

    def said(names):
        return ", ".join(f"{LABELS.get(n, n)} {metric_text(n, after[n])} vs {metric_text(n, prompted[n])}" for n in names)

    wins = [n for n, d in points.items() if d > 1]
    losses = [n for n, d in points.items() if d < -1]
    if wins and losses:
        winner = "mixed"
        text = f"mixed: fine-tuned beats {label} on {said(wins)}; prompting wins on {said(losses)}"
        text += f"; {loss}" if loss else ""
    elif wins:
        winner, text = "fine-tuned", f"fine-tuned beats {label}: {said(wins)}" + (f", {loss}" if loss else "")
    elif losses:
        winner = "prompting"
        text = f"{label} beats the fine-tune: {said(losses)}" + (f", {loss}" if loss else "") + ": you may not need it"
    elif points:
        winner = "tie"
        text = f"{label} is within 1 point of the fine-tune: you may not need it" + (f" ({loss})" if loss else "")
    elif la is not None and lp is not None:
        winner = "fine-tuned" if la < lp else "prompting"
        text = (f"fine-tuned beats {label}: {loss}" if la < lp
                else f"{label} beats the fine-tune: {loss}: you may not need it")
    else:
        return None
    return {"text": text, "winner": winner, "few_shot": prompted.get("few_shot", 0), "points": points,
            "loss": [la, lp]}


def cost_line(before: dict, prompted: dict) -> str | None:
    """The prompting baseline's time against the base's evaluation, per solved example shown."""
    b, p, k = before.get("seconds"), prompted.get("seconds"), prompted.get("few_shot", 0)
    if not b or p is None:
        return None
    per = f", {p / b / k:.2f}x per example shown" if k else ""
    return f"prompting baseline: {p:.1f} s, {p / b:.2f}x the base's evaluation ({b:.1f} s){per}"


def deployed_label(deployed: dict) -> str:
    """A deployed file's column title: its quant type as the export wrote it (`maximus eval --gguf`)."""
    return f"deployed {deployed.get('quant') or 'gguf'}" + (" + lora" if deployed.get("adapter") else "")


def summary_lines(before: dict, after: dict, prompted: dict | None, result: dict | None, *,
                  metrics: list[str], prompts: list[str], deployed: list[dict] = ()) -> list[str]:
    """The table: a row per reported value (held-out loss, task metrics, rewards, recall), a
    column per model (`deployed`: exported GGUF files scored in llama.cpp, after the tuned
    model), then failures and notes, the verdict line and the prompts' generations."""
    prompted = prompted or {}
    columns = [("base (before)", before)] + ([(column_label(prompted), prompted)] if prompted else []) + \
        [("tuned (after)", after)] + [(deployed_label(d), d) for d in deployed]
    widths = [max(16, len(title) + 1) for title, _ in columns]  # a long title (deployed q4_k_m + lora) widens its column
    lines = [f"{'':<26}" + "".join(f"{title:>{w}}" for (title, _), w in zip(columns, widths))]
    extra = sorted(k for k in after if k.startswith("reward/")) + \
        sorted((k for k in after if k.startswith("recall@")), key=lambda k: (len(k), k))
    rows = [*FIXED_ROWS[:2], *((m, None) for m in metrics), *FIXED_ROWS[2:3],
            *((k, "{:.3f}") for k in extra if k.startswith("reward/")), *FIXED_ROWS[3:],
            *((k, "{:.1%}") for k in extra if k.startswith("recall@"))]
    for key, fmt in rows:
        if not any(key in d for _, d in columns):
            continue
        cells = []
        for _, d in columns:
            value = d.get(key)
            failed = key in d.get("metrics_failed", {})
            cells.append("failed" if failed else "-" if value is None else
                         metric_text(key, value) if fmt is None else fmt.format(value))
        lines.append(f"{'held-out ' + LABELS.get(key, key):<26}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    for title, d in columns:
        for name, error in d.get("metrics_failed", {}).items():
            lines.append(f"metric {name} failed on {title}: {error}")
    if after.get("metrics_note") or before.get("metrics_note"):
        lines.append(f"held-out metrics: none scored: {after.get('metrics_note') or before.get('metrics_note')}")
    if result:
        lines.append(f"verdict: {result['text']}")
    cost = cost_line(before, prompted) if prompted else None
    if cost:
        lines.append(cost)
    for i, prompt in enumerate(prompts):
        lines.append(f"prompt: {prompt if isinstance(prompt, str) else str(prompt)!r}")  # an ImagePrompt: [files] text
        for when, d in (("before", before), ("after", after)):
            generations = d.get("generations") or []
            if i < len(generations):
                lines.append(f"  {when}: {generations[i]!r}" if when == "before" else f"  after:  {generations[i]!r}")
    return lines
