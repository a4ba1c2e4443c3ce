"""`maximus-train` and `maximus <subcommand>`: user mistakes become one line and exit code 2.

Subcommands: train, eval, export, generate, plan, embed, data, ui. Tracebacks are kept for bugs only.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from maximus.arguments import ArgumentParser
from maximus.errors import ConfigError, MaximusError

USER_ERROR_EXIT = 2


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import logging
    import warnings

    # bitsandbytes logs a warning on every CPU import when the optional hub `kernels` are absent.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*kernels.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass
    try:
        import datasets

        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    except Exception:  # pragma: no cover
        pass


def _run(fn, argv) -> int:
    try:
        return fn(argv) or 0
    except MaximusError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr, flush=True)
        return getattr(exc, "exit_code", USER_ERROR_EXIT)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------------------------------- train
def _train(argv: list[str]) -> int:
    parser = ArgumentParser(prog="maximus-train", description="Fine-tune a causal LM from a YAML config.")
    parser.add_argument("--config", "-c", required=True, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, validated like the file")
    args = parser.parse_args(argv)
    from maximus.config import Config

    cfg = Config.from_yaml(args.config, args.overrides)
    _quiet_libraries()
    from maximus.train.trainer import Trainer

    Trainer(cfg).train()
    return 0


# ---------------------------------------------------------------------------------------- eval
def _eval(argv: list[str]) -> int:
    parser = ArgumentParser(prog="maximus eval", description="Score a finished run against its base model: exact "
                            "held-out loss, the run's eval.metrics and prompting baseline (eval.few_shot), the verdict.")
    parser.add_argument("run_dir")
    parser.add_argument("--dataset", metavar="FILE", action="append",
                        help="held-out data to score on instead of the run's (repeatable; any form `dataset` takes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--gguf", metavar="FILE", action="append",
                        help="also score this GGUF export in llama.cpp (llama-cpp-python) on the same rows: the "
                        "'deployed' column (repeatable; default: the GGUF exports in RUN/exports/)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the run's loss (with these held-out points) and "
                        "memory (peak per step, budget, planner prediction) to this file")
    args = parser.parse_args(argv)
    _quiet_libraries()
    import torch

    from maximus.data import build_run_datasets, trains_on_chat
    from maximus.evaluate import evaluate_sft
    from maximus.evaluate.report import summary_lines, verdict
    from maximus.evaluate.tasks import task_eval_for_run, task_metrics
    from maximus.export import load_tuned, run_config
    from maximus.kernels import cpu_threads
    from maximus.model_source import resolve_source

    run_dir = Path(args.run_dir)
    cfg = run_config(run_dir)
    if cfg.objective == "contrastive":
        raise ConfigError(f"maximus eval reports next-token loss, and {args.run_dir} trained a contrastive embedding model",
                          "its held-out recall before/after is in run.json under eval; embed texts with maximus embed")
    cfg.eval.enabled = True
    if args.dataset:
        cfg.eval.dataset = args.dataset
    cpu_threads(torch.device("cpu"))  # the cores free now, as training picks them: far faster on a busy machine
    # The base model's source, once, for the adapter's base and the data (a full fine-tune loads none).
    source = None if (run_dir / "model").is_dir() else resolve_source(cfg)
    model, tokenizer = load_tuned(run_dir, dtype=torch.float32, cfg=cfg, source=source)
    data = build_run_datasets(cfg, tokenizer, objective="sft", source=source)
    tasks = task_eval_for_run(cfg, tokenizer, data)
    kwargs = dict(cfg=cfg, tasks=tasks, device=torch.device("cpu"), dtype=torch.float32, batch_size=4,
                  chat=trains_on_chat(data.stats))
    after = evaluate_sft(model, tokenizer, data.eval, **kwargs)
    result = {"after": after}
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            result["before"] = evaluate_sft(model, tokenizer, data.eval, **kwargs)
            if tasks is not None and tasks.prompted:
                result["prompted"] = tasks.score_prompted(model, device=torch.device("cpu"), dtype=torch.float32,
                                                          batch_size=4)
                result["verdict"] = verdict(after, result["prompted"], task_metrics(cfg.eval))
    deployed = _score_deployed(args.gguf, run_dir, cfg, model, tokenizer, data, tasks)
    if deployed:
        result["deployed"] = deployed
    summary = json.loads((run_dir / "run.json").read_text())
    memory = summary.get("memory", {})
    result["memory"] = {"peak_bytes": memory.get("peak_bytes"), "budget_bytes": memory.get("budget_bytes"),
                        "predicted_peak_bytes": summary.get("plan", {}).get("peak_bytes")}
    if args.plot:
        from maximus.train.progress import plot_loss

        plot_loss(run_dir / "metrics.jsonl", Path(args.plot), title=f"{Path(cfg.model).name} (maximus eval)",
                  summary={**summary, "eval": {k: result[k] for k in ("before", "after", "prompted", "verdict")
                                               if k in result}})
    if args.json:
        print(json.dumps(result))
    else:
        from maximus.config import format_bytes

        for line in summary_lines(result.get("before", {}), after, result.get("prompted"), result.get("verdict"),
                                  metrics=task_metrics(cfg.eval), prompts=cfg.eval.prompts, deployed=deployed):
            print(line)
        m = result["memory"]
        print(f"training memory: peak {format_bytes(m['peak_bytes'])} measured, budget {format_bytes(m['budget_bytes'])}, "
              f"planner prediction {format_bytes(m['predicted_peak_bytes'])}")
        if args.plot:
            print(f"wrote {args.plot}")
    return 0


def _score_deployed(files: list[str] | None, run_dir: Path, cfg, model, tokenizer, data, tasks) -> list[dict]:
    """`--gguf` files (else the run's own GGUF exports, when llama-cpp-python is installed) scored
    in llama.cpp on the held-out rows and examples the Transformers model was scored on."""
    import importlib.util

    from maximus.evaluate import _stop_ids
    from maximus.evaluate.deployed import deployed_files, score_gguf

    if files:
        paths = [Path(f) for f in files]
        from maximus.evaluate.deployed import gguf_lora_files

        for path in paths:
            model_file, adapter = gguf_lora_files(path)
            if not model_file.is_file() or (adapter is not None and not adapter.is_file()):
                what = "a directory without model.gguf and adapter.gguf" if path.is_dir() else "no such file"
                raise ConfigError(f"--gguf {path}: {what}", "pass a .gguf file or a --format gguf-lora directory "
                                  "written by maximus export")
    elif importlib.util.find_spec("llama_cpp") is not None:
        paths = deployed_files(run_dir)
    else:
        return []
    context = cfg.training.seq_len + cfg.eval.max_new_tokens + 8
    return [score_gguf(p, tokenizer, data.eval, tasks, context=context, stops=_stop_ids(model, tokenizer))
            for p in paths]


# ---------------------------------------------------------------------------------------- export
def _export(argv: list[str]) -> int:
    parser = ArgumentParser(prog="maximus export", description="Export a finished run: merged Hugging Face "
                            "model (default), its PEFT adapter, a GGUF file for llama.cpp, or an Ollama model.")
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True, help="target: new, empty, or a previous export (--overwrite); "
                        "a .gguf file for --format gguf")
    parser.add_argument("--format", default="merged", choices=["merged", "adapter", "gguf", "gguf-lora", "ollama"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="merged: weight dtype")
    parser.add_argument("--quant", default=None, help="gguf / gguf-lora (its base) / ollama: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0; "
                        "k-quants (q4_k_m ...) with llama-cpp-python installed (default: the run's training.qat target, else f16 for "
                        "gguf, q8_0 for ollama)")
    parser.add_argument("--correction-rank", type=int, default=0, metavar="N", help="gguf-lora: also write, beside "
                        "the adapter, the rank-N correction of the base's --quant rounding (q8_0, q4_0, q4_k_m) in the "
                        "metric of the inputs over the run's first 64 training rows; the adapter file grows by "
                        "N x (rows + columns) numbers per adapted matrix")
    parser.add_argument("--adapter-dtype", default=None, choices=["f32", "f16"], help="gguf-lora: the type of the "
                        "LoRA file's A and B (default f32; f16 halves the file)")
    parser.add_argument("--overwrite", action="store_true", help="replace a previous export at --out (nothing else)")
    parser.add_argument("--progress", metavar="FILE", help="keep FILE (JSON: stage, done, total, text) up to date "
                        "while the export runs (maximus ui shows it)")
    args = parser.parse_args(argv)
    if args.quant is not None and args.format not in ("gguf", "gguf-lora", "ollama"):
        raise ConfigError(f"--quant applies to --format gguf, gguf-lora or ollama, not {args.format}",
                          "drop --quant or change --format")
    for flag, given in (("--correction-rank", args.correction_rank), ("--adapter-dtype", args.adapter_dtype)):
        if given and args.format != "gguf-lora":
            raise ConfigError(f"{flag} applies to the adapter file beside the base, which only --format gguf-lora "
                              f"writes, not --format {args.format}", f"use --format gguf-lora or drop {flag}")
    if args.correction_rank < 0:
        raise ConfigError(f"--correction-rank must be a rank of 1 or more, not {args.correction_rank}",
                          "drop it for no correction")
    _quiet_libraries()
    from maximus import export
    from maximus.export.progress import ExportProgress

    progress = ExportProgress(args.progress)
    if args.format == "adapter":
        out = export.export_adapter(args.run_dir, args.out, overwrite=args.overwrite, progress=progress)
        print(f"wrote {out} (PEFT adapter; see {out / 'README.md'})")
    elif args.format == "merged":
        out = export.export_merged(args.run_dir, args.out, dtype=args.dtype, overwrite=args.overwrite, progress=progress)
        print(f"wrote {out} (load with AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    else:
        fn = {"gguf": export.export_gguf, "gguf-lora": export.export_gguf_lora, "ollama": export.export_ollama}[args.format]
        extra = {k: v for k, v in (("correction_rank", args.correction_rank), ("adapter_dtype", args.adapter_dtype)) if v}
        out, notices = fn(args.run_dir, args.out, quant=args.quant, overwrite=args.overwrite, progress=progress, **extra)
        for notice in notices:
            print(notice if notice.startswith("warning: ") else f"notice: {notice}")
        how = {"gguf": f"llama-cli -m {out}", "gguf-lora": f"llama-cli -m {out / 'model.gguf'} --lora {out / 'adapter.gguf'}",
               "ollama": f"cd {out} && ollama create NAME -f Modelfile"}[args.format]
        print(f"wrote {out} (run with: {how})")
    return 0


# ---------------------------------------------------------------------------------------- generate
def _generate(argv: list[str]) -> int:
    parser = ArgumentParser(prog="maximus generate", description="Generate text from a finished run or a model "
                                     "(a run trained on conversations gets each prompt as a chat user turn).")
    parser.add_argument("source", help="run directory (adapter applied) or model directory / hub id")
    parser.add_argument("--prompt", "-p", action="append", required=True, help="prompt (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    _quiet_libraries()
    import torch

    from maximus.evaluate import generate_text

    from maximus.builtin import materialize

    source = Path(materialize(args.source))
    chat = False
    if (source / "run.json").is_file():
        from maximus.data import trains_on_chat
        from maximus.export import load_tuned

        model, tokenizer = load_tuned(source)
        chat = trains_on_chat(json.loads((source / "run.json").read_text()).get("data", {}))
    else:
        from maximus.config import Config
        from maximus.model_source import resolve_source
        from maximus.models import load_base_model, load_tokenizer

        cfg = Config.from_dict({"model": str(source), "dataset": "-"})
        model_source = resolve_source(cfg)
        tokenizer = load_tokenizer(cfg, model_source)
        model = load_base_model(cfg, torch.device("cpu"), torch.float32, method="lora", source=model_source)
    for prompt, text in zip(args.prompt, generate_text(model, tokenizer, args.prompt, device=torch.device("cpu"),
                                                       max_new_tokens=args.max_new_tokens, chat=chat)):
        print(f"{prompt}{text}")
    return 0


def _plan(argv: list[str]) -> int:
    from maximus.plan_command import plan_main

    return plan_main(argv)


def _embed(argv: list[str]) -> int:
    _quiet_libraries()
    from maximus.embed_command import embed_main

    return embed_main(argv)


def _data(argv: list[str]) -> int:
    _quiet_libraries()
    from maximus.data_command import data_main

    return data_main(argv)


def _ui(argv: list[str]) -> int:
    from maximus.ui.command import ui_main

    return ui_main(argv)


COMMANDS = {"train": _train, "eval": _eval, "export": _export, "generate": _generate, "plan": _plan, "embed": _embed,
            "data": _data, "ui": _ui}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: maximus {" + ",".join(COMMANDS) + "} ...\n\n"
              "  train     fine-tune from a YAML config (same as maximus-train)\n"
              "  plan      predict peak memory and the cheapest GPU for a model and setting\n"
              "  data      check a run's data (duplicates, leakage, truncation, ...) as it will train\n"
              "  eval      score a finished run against its base model (and prompting), on any file\n"
              "  export    a run as a merged Hugging Face model, its adapter, GGUF or Ollama\n"
              "  generate  generate text from a run or a model\n"
              "  embed     Matryoshka embeddings of texts to .npy\n"
              "  ui        plan, train, stop, chat with and export runs in the browser")
        return 0
    if argv[0] in ("-V", "--version"):
        from maximus import __version__

        print(f"maximus {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (hint: did you mean '{close[0]}'?)" if close else ""
        print(f"error: unknown command '{name}'{hint}", file=sys.stderr)
        return USER_ERROR_EXIT
    return _run(COMMANDS[name], rest)


def train_main(argv: list[str] | None = None) -> int:
    return _run(_train, list(sys.argv[1:] if argv is None else argv))


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    _exit(main())


def main_entry() -> None:
    _exit(main())


def train_entry() -> None:
    _exit(train_main())
