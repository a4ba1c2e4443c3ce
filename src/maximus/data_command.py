"""`maximus data check --config run.yaml [--json] [--plot PNG]`: the run's data checked as the trainer reads it
(same tokenizer, formats, template, masks, seq_len and split), before paying for a GPU.

Prints the check summary and the template preview (trained tokens in colour on a terminal), or
with ``--json`` one JSON object (`maximus.data.check.DataReport.to_dict`). Exit 0 when every check
is under its threshold or `data.on_problem` is `warn`; 2 with one line under `data.on_problem: error`.
"""
from __future__ import annotations

import json
import sys

from maximus.arguments import ArgumentParser


def data_report(cfg):
    """The `maximus.data.check.DataReport` of a run's config (`builtin:` names resolved): its
    tokenizer loaded and its data built as `maximus-train` builds them."""
    from maximus.data import build_run_datasets
    from maximus.data.check import check_run
    from maximus.model_source import resolve_source
    from maximus.models import load_tokenizer

    source = None if cfg.tokenizer else resolve_source(cfg)  # the model's own tokenizer: its source, once
    tokenizer = load_tokenizer(cfg, source)
    return check_run(cfg, build_run_datasets(cfg, tokenizer, source=source), tokenizer)


def data_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="maximus data", description="Check a run's data before training on it.")
    sub = parser.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check", help="duplicates, leakage, truncation, untrainable rows, broken text, chat "
                           "structure, preference pairs; the template preview")
    check.add_argument("--config", "-c", required=True, help="the run's YAML config")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.add_argument("--plot", metavar="PNG", help="also draw the training documents' token lengths against "
                       "seq_len to this file (a run draws it as data_lengths.png)")
    check.add_argument("overrides", nargs="*", help="key.sub=value overrides, validated like the file")
    args = parser.parse_args(argv)
    from maximus.builtin import resolve
    from maximus.config import Config
    from maximus.data.check import preview_text

    cfg = resolve(Config.from_yaml(args.config, args.overrides))
    report = data_report(cfg)
    if args.plot:
        from pathlib import Path

        from maximus.data.length_plot import plot_lengths

        plot_lengths(report.lengths, report.seq_len, Path(args.plot), title=f"{Path(cfg.model).name}: tokens per "
                     "training document")
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        for line in report.lines():
            print(line)
        colour = sys.stdout.isatty()
        for preview in report.preview:
            print(f"--- {preview['where']} (trained tokens {'in green' if colour else 'between ⟦ ⟧'})")
            print(preview_text(preview, colour))
    report.raise_problems()
    return 0
