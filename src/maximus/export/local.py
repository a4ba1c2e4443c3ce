"""Formats for local runtimes: one GGUF file (llama.cpp, LM Studio) or an Ollama directory
(the GGUF plus a Modelfile that `ollama create NAME -f Modelfile` uses as it is)."""
from __future__ import annotations

from pathlib import Path

import torch

from maximus.errors import ExportError
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


def export_gguf(run_dir: str | Path, out: str | Path, *, quant: str = "f16", overwrite: bool = False,
                progress: ExportProgress | None = None) -> tuple[Path, list[str]]:
    """Write the run's merged model as the GGUF file `out`. Returns (path, notices). `progress`
    hears each stage and the tensor count (`maximus.export.progress`).

    Raises ExportError for an unsupported quant, architecture or tokenizer, and for an `out` that
    is not a new path or (with `overwrite`) a previous GGUF export."""
    run_dir, out = Path(run_dir), Path(out)
    if out.suffix != ".gguf":
        raise ExportError(f"--out {out} should name a .gguf file", "e.g. --out model-q8_0.gguf")
    check_quant(quant)
    check_file_target(out, overwrite=overwrite, is_ours=is_maximus_gguf)
    progress = progress or ExportProgress()
    cfg, model, tokenizer = _merged_for_gguf(run_dir, progress)
    notices: list[str] = []
    source = {"run": str(run_dir.absolute()), "base": cfg.model}
    write_file(out, lambda tmp: notices.extend(write_gguf(model, tokenizer, tmp, quant=quant, name=run_dir.name,
                                                          source=source, progress=progress)),
               overwrite=overwrite, is_ours=is_maximus_gguf)
    progress("done")
    return out, notices


def export_ollama(run_dir: str | Path, out: str | Path, *, quant: str = "q8_0", overwrite: bool = False,
                  progress: ExportProgress | None = None) -> tuple[Path, list[str]]:
    """Write `out/` = `model.gguf` + `Modelfile` (FROM, TEMPLATE from the chat template, stop tokens).
    Returns (path, notices). Raises ExportError like `export_gguf`, and for a chat template Ollama's
    template language cannot express."""
    run_dir, out = Path(run_dir), Path(out)
    check_quant(quant)
    check_directory_target(out, overwrite=overwrite)
    progress = progress or ExportProgress()
    cfg, model, tokenizer = _merged_for_gguf(run_dir, progress)
    from maximus.export.gguf_vocab import build_vocab

    text = modelfile("model.gguf", tokenizer, add_bos=build_vocab(tokenizer, model.get_input_embeddings().num_embeddings).add_bos)
    notices: list[str] = []

    def fill(tmp: Path) -> None:
        notices.extend(write_gguf(model, tokenizer, tmp / "model.gguf", quant=quant, name=run_dir.name,
                                  source={"run": str(run_dir.absolute()), "base": cfg.model}, progress=progress))
        (tmp / "Modelfile").write_text(text)

    written = write_directory(out, fill, overwrite=overwrite,
                              meta={"format": "ollama", "run": str(run_dir.absolute()), "quant": quant})
    progress("done")
    return written, notices
