"""Task metrics of `eval.metrics`: greedy completions scored against the held-out answers.

Built-ins, computed by the libraries that define them (never re-implemented here):

- `exact_match`: fraction of completions equal to their reference after stripping surrounding
  whitespace (0..1);
- `rouge_l`: mean ROUGE-L F1 of `rouge-score` (Google's re-implementation of ROUGE-1.5.5;
  lower-cased, split on non-alphanumerics, no stemming), 0..1;
- `chrf`: corpus chrF of `sacrebleu` (character 6-grams, beta 2), 0..100.

A custom metric is `module:function` (or `path/file.py:function`), called once per evaluation as
``f(predictions, references, **columns) -> float`` where `columns` holds each column of the
held-out records as a list with one value per example (the convention of the GRPO rewards).
`score_all` never raises for a metric: one that raises or returns a non-number is recorded in
`failed` with its one-line error, so that evaluation, and the run, goes on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from maximus.user_code import load_function

SIGNATURE = "predictions, references, **columns"

#: How many of a metric's units make one "point" in the verdict: metrics in 0..1 count percent
#: points, chrF (already 0..100) its own units. Custom metrics are read as fractions, like rewards.
POINT = {"exact_match": 0.01, "rouge_l": 0.01, "chrf": 1.0}


def exact_match(predictions: list[str], references: list[str], **columns) -> float:
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(predictions)


def rouge_l(predictions: list[str], references: list[str], **columns) -> float:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return sum(scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)) / len(predictions)


def chrf(predictions: list[str], references: list[str], **columns) -> float:
    from sacrebleu.metrics import CHRF

    return float(CHRF().corpus_score(predictions, [references]).score)


BUILTIN: dict[str, Callable] = {"exact_match": exact_match, "rouge_l": rouge_l, "chrf": chrf}


@dataclass
class Metric:
    """A loaded metric: the name it is reported under (run.json, the table) and its function."""

    name: str
    spec: str
    fn: Callable

    @property
    def point(self) -> float:
        return POINT.get(self.name, 0.01)


def load_metrics(names: list[str]) -> list[Metric]:
    """The metrics of `eval.metrics` (names checked by the config: built-ins or module:function).
    Raises ConfigError for a custom metric that cannot be imported."""
    loaded: list[Metric] = []
    for spec in names:
        if spec in BUILTIN:
            loaded.append(Metric(spec, spec, BUILTIN[spec]))
            continue
        name, fn = load_function(spec, "eval.metrics", SIGNATURE, noun="metric")
        taken = {m.name for m in loaded}
        base, suffix = name, 2
        while name in taken or name in BUILTIN:
            name, suffix = f"{base}_{suffix}", suffix + 1
        loaded.append(Metric(name, spec, fn))
    return loaded


def score_all(metrics: list[Metric], predictions: list[str], references: list[str],
              columns: dict[str, list]) -> tuple[dict[str, float | None], dict[str, str]]:
    """({name: value, None when it failed}, {name: one-line error}) over one set of completions."""
    values: dict[str, float | None] = {}
    failed: dict[str, str] = {}
    for metric in metrics:
        try:
            value = metric.fn(list(predictions), list(references), **columns)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
                raise TypeError(f"returned {value!r}, not a finite float")
            values[metric.name] = float(value)
        except Exception as exc:  # a user's metric must never cost the run: record it and go on
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            values[metric.name] = None
            failed[metric.name] = f"{metric.spec}: {type(exc).__name__}" + (f": {message}" if message else "")
    return values, failed
