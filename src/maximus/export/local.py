"""Formats for local runtimes: one GGUF file (llama.cpp, LM Studio), an Ollama directory (the GGUF
plus a Modelfile that `ollama create NAME -f Modelfile` uses as it is), or a quantized base GGUF with
the adapter beside it as a llama.cpp LoRA file (`gguf-lora`, `maximus.export.gguf_adapter`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from maximus.errors import CheckpointError, ExportError
from maximus.export.ollama import modelfile
from maximus.export.progress import ExportProgress
from maximus.export.target import check_directory_target, check_file_target, write_directory, write_file
from maximus.export.to_gguf import check_quant, is_maximus_gguf, write_gguf
from maximus.export.tuned import load_tuned, run_config


def _merged_for_gguf(run_dir: Path, progress: ExportProgress):
    cfg = run_config(run_dir)
    if cfg.optimization.kronecker is not None:
        raise ExportError(f"{run_dir} was trained with Kronecker sketching attention, which llama.cpp does not implement",
                          "use --format merged or adapter (they keep the sketch modules)")
    model, tokenizer = load_tuned(run_dir, dtype=torch.float32, merge=True, progress=progress)
    return cfg, model, tokenizer


def _adapter_warning(run_dir: Path, fmt: str) -> list[str]:
    """A warning when `fmt` holds the adapter otherwise than the run's QAT trained for
    (`training.qat_adapter`)."""
    training = run_config(run_dir).training
    if training.qat == "off":
        return []
    if training.qat_adapter == "separate" and fmt != "gguf-lora":
        return [f"warning: {run_dir} trained its adapter beside the rounded base (training.qat_adapter: separate); "
                f"--format {fmt} merges it and rounds the sum, unlike training (use --format gguf-lora)"]
    if training.qat_adapter == "merged" and fmt == "gguf-lora":
        return [f"warning: {run_dir} trained against the rounded merged weights (training.qat_adapter: merged); "
                "--format gguf-lora keeps the adapter apart, unlike training (use --format gguf)"]
    return []


def quant_for_run(run_dir: Path, quant: str | None, fmt: str) -> tuple[str, list[str]]:
    """The `--quant` of a GGUF / Ollama / gguf-lora export of `run_dir`, and warnings: the run's
    `training.qat` target when `quant` is None (else q8_0 for ollama, f16 for the others); a warning
    when `quant` is not the type the run trained for, or the format holds the adapter otherwise
    (`_adapter_warning`). ExportError for a QAT target the format cannot hold (int4) when no `quant`
    is given."""
    target = run_config(run_dir).training.qat
    default = "q8_0" if fmt == "ollama" else "f16"
    if target == "off":
        return quant or default, []
    from maximus.qat.targets import GGUF_TARGETS

    if target not in GGUF_TARGETS:
        if quant is None:
            raise ExportError(f"{run_dir} was trained for {target} (training.qat), which --format {fmt} cannot hold "
                              f"(GGUF has no {target} type)",
                              f"pass --quant (e.g. --quant {default}) to write it anyway, or --format merged")
        return quant, [f"warning: {run_dir} was trained for {target} (training.qat), which --format {fmt} cannot "
                       f"hold; --quant {quant} rounds its weights differently than it trained for"]
    if quant is None or quant == target:
        return target, _adapter_warning(run_dir, fmt)
    return quant, [f"warning: {run_dir} was trained for {target} (training.qat); --quant {quant} rounds its weights "
                   f"differently than it trained for (omit --quant to write {target})", *_adapter_warning(run_dir, fmt)]


def export_gguf(run_dir: str | Path, out: str | Path, *, quant: str | None = None, overwrite: bool = False,
                progress: ExportProgress | None = None) -> tuple[Path, list[str]]:
    """Write the run's merged model as the GGUF file `out`. Returns (path, notices). `quant`
    defaults to the run's `training.qat` target, else f16 (`quant_for_run`). `progress` hears
    each stage and the tensor count (`maximus.export.progress`).

    Raises ExportError for an unsupported quant, architecture or tokenizer, and for an `out` that
    is not a new path or (with `overwrite`) a previous GGUF export."""
    run_dir, out = Path(run_dir), Path(out)
    if out.suffix != ".gguf":
        raise ExportError(f"--out {out} should name a .gguf file", "e.g. --out model-q8_0.gguf")
    quant, warnings = quant_for_run(run_dir, quant, "gguf")
    check_quant(quant)
    check_file_target(out, overwrite=overwrite, is_ours=is_maximus_gguf)
    progress = progress or ExportProgress()
    cfg, model, tokenizer = _merged_for_gguf(run_dir, progress)
    notices: list[str] = list(warnings)
    source = {"run": str(run_dir.absolute()), "base": cfg.model}
    write_file(out, lambda tmp: notices.extend(write_gguf(model, tokenizer, tmp, quant=quant, name=run_dir.name,
                                                          source=source, progress=progress)),
               overwrite=overwrite, is_ours=is_maximus_gguf)
    progress("done")
    return out, notices


def export_ollama(run_dir: str | Path, out: str | Path, *, quant: str | None = None, overwrite: bool = False,
                  progress: ExportProgress | None = None) -> tuple[Path, list[str]]:
    """Write `out/` = `model.gguf` + `Modelfile` (FROM, TEMPLATE from the chat template, stop tokens).
    `quant` defaults to the run's `training.qat` target, else q8_0. Returns (path, notices).
    Raises ExportError like `export_gguf`, and for a chat template Ollama's template language
    cannot express."""
    run_dir, out = Path(run_dir), Path(out)
    quant, warnings = quant_for_run(run_dir, quant, "ollama")
    check_quant(quant)
    check_directory_target(out, overwrite=overwrite)
    progress = progress or ExportProgress()
    cfg, model, tokenizer = _merged_for_gguf(run_dir, progress)
    from maximus.export.gguf_vocab import build_vocab

    text = modelfile("model.gguf", tokenizer, add_bos=build_vocab(tokenizer, model.get_input_embeddings().num_embeddings).add_bos)
    notices: list[str] = list(warnings)

    def fill(tmp: Path) -> None:
        notices.extend(write_gguf(model, tokenizer, tmp / "model.gguf", quant=quant, name=run_dir.name,
                                  source={"run": str(run_dir.absolute()), "base": cfg.model}, progress=progress))
        (tmp / "Modelfile").write_text(text)

    written = write_directory(out, fill, overwrite=overwrite,
                              meta={"format": "ollama", "run": str(run_dir.absolute()), "quant": quant})
    progress("done")
    return written, notices


def export_gguf_lora(run_dir: str | Path, out: str | Path, *, quant: str | None = None, overwrite: bool = False,
                     progress: ExportProgress | None = None, correction_rank: int = 0,
                     adapter_dtype: str = "f32") -> tuple[Path, list[str]]:
    """Write `out/` = `model.gguf` (the run's base alone, quantized at `quant`) + `adapter.gguf` (its
    LoRA adapter as a llama.cpp LoRA file in `adapter_dtype`, f32 or f16; `maximus.export.gguf_adapter`).
    `quant` defaults to the run's `training.qat` target, else f16. Returns (path, notices).

    The adapter file carries the run's correction of the base's rounding
    (`training.qat_correction_rank`), or with `correction_rank` N one computed now: the rank-N
    correction of each adapted matrix's rounding at `quant`, in the metric of its inputs over the
    run's first training rows (`maximus.qat.correction`), which the adapter did not train against.

    Raises ExportError like `export_gguf`, for a fully fine-tuned run (no adapter), for an
    adapter a llama.cpp LoRA file cannot hold (DoRA, modules_to_save, an adapted embedding), and
    for a `correction_rank` with a run that has its own correction or a `quant` whose rounding
    Maximus does not model (any but `maximus.qat.targets.GGUF_TARGETS`); ConfigError for a
    `correction_rank` with training rows that are not tokens (a preference objective's)."""
    from maximus.export.gguf_adapter import ADAPTER_FILE, BASE_FILE, write_gguf_adapter
    from maximus.models import load_base_model

    run_dir, out = Path(run_dir), Path(out)
    if (run_dir / "model").is_dir():
        raise ExportError(f"{run_dir} is a full fine-tuning run: it has no adapter to keep apart",
                          "use --format gguf")
    if not (run_dir / "adapter" / "adapter_config.json").is_file():
        raise CheckpointError(f"{run_dir} has no adapter/ (adapter_config.json missing)", "was the run finished?")
    quant, warnings = quant_for_run(run_dir, quant, "gguf-lora")
    check_quant(quant)
    check_directory_target(out, overwrite=overwrite)
    progress = progress or ExportProgress()
    cfg = run_config(run_dir)
    if cfg.optimization.kronecker is not None:
        raise ExportError(f"{run_dir} was trained with Kronecker sketching attention, which llama.cpp does not implement",
                          "use --format merged or adapter (they keep the sketch modules)")
    from peft import PeftModel
    from transformers import AutoTokenizer

    from maximus.qat.correction import load_corrections

    progress("loading")
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "adapter"))
    # with correction_rank the run has no correction of its own (_calibration_rows refuses one)
    rows = _calibration_rows(run_dir, cfg, tokenizer, quant, correction_rank) if correction_rank else None
    factors, meta = (None, {}) if correction_rank else load_corrections(run_dir / "adapter") or (None, {})
    base = load_base_model(cfg, torch.device("cpu"), torch.float32, method="lora")
    source = {"run": str(run_dir.absolute()), "base": cfg.model}
    notices: list[str] = list(warnings)
    if rows is not None:
        notices.append(f"{ADAPTER_FILE} holds a rank-{correction_rank} correction of the base's {quant} rounding "
                       f"beside the adapter, calibrated now on the run's first {len(rows)} training rows "
                       "(--correction-rank; the adapter trained without it)")
    elif factors is not None:
        notices.append(f"{ADAPTER_FILE} holds the run's rank-{meta.get('rank')} correction of the base's "
                       f"{meta.get('target')} rounding beside the adapter (training.qat_correction_rank)")
        if meta.get("target") != quant:
            notices.append(f"warning: the correction beside the adapter makes up for the {meta.get('target')} "
                           f"rounding, and --quant {quant} rounds the base otherwise (omit --quant to write "
                           f"{meta.get('target')})")

    def fill(tmp: Path) -> None:
        # the base first, alone; then the adapter loads onto that same copy (one model in memory)
        notices.extend(write_gguf(base, tokenizer, tmp / BASE_FILE, quant=quant, name=Path(str(cfg.model)).name,
                                  source={**source, "quant": quant, "role": "base"}, progress=progress))
        model = PeftModel.from_pretrained(base, str(run_dir / "adapter"))
        correction = factors
        if rows is not None:
            progress("calibrating")
            correction = _corrections_now(model, rows, quant, correction_rank)
        write_gguf_adapter(model, tmp / ADAPTER_FILE, marker=json.dumps({"format": "gguf-lora", **source}),
                           name=run_dir.name, correction=correction, dtype=adapter_dtype)

    if adapter_dtype != "f32" and cfg.training.qat_adapter == "separate" and cfg.training.qat != "off":
        notices.append(f"{ADAPTER_FILE} holds the adapter{' and its correction' if factors is not None else ''} in "
                       f"{adapter_dtype}, rounded from the float32 it trained as (--adapter-dtype)")
    record = {"format": "gguf-lora", "run": str(run_dir.absolute()), "quant": quant, "adapter_dtype": adapter_dtype}
    written = write_directory(out, fill, overwrite=overwrite,
                              meta={**record, "correction_rank": correction_rank} if correction_rank else record)
    progress("done")
    return written, notices


def check_correction_rank(run_dir: Path, quant: str, rank: int) -> None:
    """ExportError where `--correction-rank` cannot apply to a gguf-lora export of `run_dir` at
    `quant`: a run that carries its own correction, a `quant` whose rounding is not modelled."""
    from maximus.qat.correction import correction_meta
    from maximus.qat.targets import GGUF_TARGETS

    meta = correction_meta(Path(run_dir) / "adapter")
    if meta is not None:
        raise ExportError(f"{run_dir} already carries its rank-{meta.get('rank')} correction of the base's "
                          f"{meta.get('target')} rounding (training.qat_correction_rank), and --correction-rank "
                          f"{rank} would replace what the adapter trained against", "drop --correction-rank")
    if quant not in GGUF_TARGETS:
        raise ExportError(f"--correction-rank {rank} corrects the base's rounding, and Maximus models the rounding "
                          f"of {', '.join(GGUF_TARGETS)}, not --quant {quant}",
                          "pass --quant q4_k_m, q4_0 or q8_0, or drop --correction-rank")


def _calibration_rows(run_dir: Path, cfg, tokenizer, quant: str, rank: int) -> list[dict]:
    """The training rows `--correction-rank` calibrates on (`maximus.qat.correction.calibration_rows`),
    after the checks that need no model."""
    from maximus.data import build_run_datasets
    from maximus.qat.correction import calibration_rows

    check_correction_rank(run_dir, quant, rank)
    return calibration_rows(build_run_datasets(cfg, tokenizer).train, cfg.objective,
                            asked=f"--correction-rank {rank}", drop="drop --correction-rank")


def _corrections_now(model, rows: list[dict], quant: str, rank: int) -> dict:
    """{path: (L, R)}: the rank-`rank` correction of each adapted matrix's `quant` rounding of
    `model` (a PEFT model, float32, CPU), in the metric of its inputs over `rows`."""
    from maximus.qat.correction import rounding_corrections
    from maximus.qat.install import install_qat

    report = install_qat(model, quant, adapter="separate")
    return rounding_corrections(model, rows, rank, report.apart, torch.device("cpu"))
