"""Hugging Face formats: the merged model (standalone directory) and the PEFT adapter as trained."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from maximus.errors import ExportError
from maximus.export.progress import ExportProgress
from maximus.export.target import check_directory_target, write_directory
from maximus.export.tuned import load_tuned, run_config

HF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


from maximus.vision import is_vision_config


def export_merged(run_dir: str | Path, out: str | Path, dtype: str = "fp32", *, overwrite: bool = False,
                  progress: ExportProgress | None = None) -> Path:
    """Write the merged model (safetensors + tokenizer) to `out`, a directory `AutoModelForCausalLM` loads.
    `progress` hears each stage (`maximus.export.progress`).

    Raises ExportError when `out` exists and is not empty, unless it is a previous export and
    `overwrite` is set (see `maximus.export.target`)."""
    progress = progress or ExportProgress()
    check_directory_target(Path(out), overwrite=overwrite)  # before the minutes of loading and merging
    model, tokenizer = load_tuned(Path(run_dir), dtype=torch.float32, merge=True, progress=progress)
    model = model.to(HF_DTYPES[dtype])
    model.config.use_cache = True

    def fill(tmp: Path) -> None:
        progress("writing")
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if is_vision_config(model.config):  # a VLM needs its processor beside the weights
            from maximus.vision import load_processor

            saved = Path(run_dir) / ("model" if (Path(run_dir) / "model").is_dir() else "adapter")
            load_processor(str(saved)).save_pretrained(str(tmp))
        progress("checking")  # write_directory checks the target again before the swap

    written = write_directory(Path(out), fill, overwrite=overwrite,
                              meta={"format": "merged", "run": str(Path(run_dir).absolute()), "dtype": dtype})
    progress("done")
    return written


_ADAPTER_README = """# LoRA adapter for `{base}`

Trained by Maximus (run `{run}`). Files: `adapter_config.json` + `adapter_model.safetensors`
(PEFT format) and the tokenizer the run used.{qlora}

## Load it with PEFT

```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("{out}")   # fetches the base named in adapter_config.json
tokenizer = AutoTokenizer.from_pretrained("{out}")
```

## Serve it with vLLM

```bash
vllm serve {base} --enable-lora --max-lora-rank {rank} --lora-modules {name}={out}
```

then request `"model": "{name}"`. The adapter must target modules vLLM supports for LoRA
(this one targets: {targets}).

## Merge it later

```bash
maximus export {run} --format merged --out merged/
```

or in Python: `AutoPeftModelForCausalLM.from_pretrained("{out}").merge_and_unload().save_pretrained("merged/")`.
"""


def _vllm_lora_rank(rank: int) -> int:
    """vLLM's --max-lora-rank takes one of a few sizes; the smallest that holds this adapter."""
    return next((size for size in (8, 16, 32, 64, 128, 256, 320, 512) if size >= rank), rank)


def export_adapter(run_dir: str | Path, out: str | Path, *, overwrite: bool = False,
                   progress: ExportProgress | None = None) -> Path:
    """Copy the run's PEFT adapter (and tokenizer) to `out` with a README on using it.

    Raises ExportError for a full fine-tune (it has no adapter) and for a target `out` that is
    not ours to replace."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    adapter = run_dir / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        if (run_dir / "model").is_dir():
            raise ExportError(f"{run_dir} is a full fine-tune: it has no adapter to export",
                              "use --format merged (or gguf / ollama)")
        raise ExportError(f"{run_dir} has no adapter/ (adapter_config.json missing)", "was the run finished?")
    adapter_cfg = json.loads((adapter / "adapter_config.json").read_text())
    out = Path(out)
    progress = progress or ExportProgress()

    def fill(tmp: Path) -> None:
        progress("writing")
        for src in sorted(adapter.iterdir()):
            if src.is_file():
                shutil.copy2(src, tmp / src.name)
        targets = adapter_cfg.get("target_modules") or []
        qlora = ("\n\nIt was trained on a 4-bit (QLoRA) base and applies to the base in full or half precision."
                 if cfg.method == "qlora" else "")
        (tmp / "README.md").write_text(_ADAPTER_README.format(
            base=cfg.model, run=run_dir, out=out, rank=_vllm_lora_rank(int(adapter_cfg.get("r", 16))), name=out.name or "adapter",
            targets=", ".join(sorted(targets)) if isinstance(targets, list) else targets, qlora=qlora))
        progress("checking")

    written = write_directory(out, fill, overwrite=overwrite, meta={"format": "adapter", "run": str(run_dir.absolute())})
    progress("done")
    return written
