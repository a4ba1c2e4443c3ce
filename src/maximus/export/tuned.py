"""A finished run as a model: its recorded config, and its base with the adapter applied (or merged)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from maximus.config import Config
from maximus.errors import CheckpointError
from maximus.model_source import ModelSource


def run_config(run_dir: Path) -> Config:
    """The config a finished run recorded in run.json, its builtin: names resolved
    (`maximus.builtin.resolve`): what `maximus eval`, `maximus export` and the UI's chat load."""
    from maximus.builtin import resolve

    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a finished Maximus run (no run.json)",
                              "pass the output_dir of a completed maximus-train run")
    data = json.loads(path.read_text())
    return resolve(Config.from_dict(data["config"], source=str(path)))


def load_tuned(run_dir: Path, *, device: torch.device | None = None, dtype: torch.dtype = torch.float32, merge: bool = False,
               progress=None, quantized: bool = False, cfg: Config | None = None, source: ModelSource | None = None):
    """(model, tokenizer) of a finished run: base in `dtype` plus the adapter; or the fully
    fine-tuned model. The base is never 4-bit unless `quantized` (NF4, as a QLoRA run trained:
    chat), so a QLoRA adapter merges into real weights. `cfg`: the run's config when the caller has
    read it already (`run_config`); `source`: its base model resolved (`maximus.model_source`), else
    resolved here when the base loads. `progress`: called with "loading" and "merging"
    (`maximus.export.progress.ExportProgress`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from maximus.models import load_base_model

    if merge and quantized:
        raise ValueError("a 4-bit base cannot take a merged adapter")
    run_dir = Path(run_dir)
    cfg = cfg or run_config(run_dir)
    device = device or torch.device("cpu")
    if progress is not None:
        progress("loading")
    if (run_dir / "model").is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(run_dir / "model"), dtype=dtype, use_safetensors=True,
                                                     trust_remote_code=cfg.trust_remote_code).to(device)
        tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "model"))
        return model, tokenizer
    adapter = run_dir / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise CheckpointError(f"{run_dir} has no adapter/ (adapter_config.json missing)", "was the run finished?")
    from peft import PeftModel

    base = load_base_model(cfg, device, dtype, method="qlora" if quantized else "lora", source=source)
    if cfg.optimization.kronecker is not None:
        from maximus.attention import install_kronecker

        base = install_kronecker(base, cfg.optimization.kronecker)
    model = PeftModel.from_pretrained(base, str(adapter))
    if merge:
        if progress is not None:
            progress("merging")
        model = model.merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    model.eval()
    return model, tokenizer
