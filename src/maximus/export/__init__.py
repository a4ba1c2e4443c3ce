"""`maximus export RUN --out PATH --format merged | adapter | gguf | gguf-lora | ollama`.

- merged: the adapter merged into its base, a standalone Hugging Face directory (the default);
- adapter: the PEFT adapter as it is, with a README on loading, serving and merging it;
- gguf: one GGUF file for llama.cpp / LM Studio (every family of the model matrix; f16 ... q4_0),
  `to_gguf.py` and `gguf_arch.py`;
- gguf-lora: the base alone as a GGUF file plus the adapter as a llama.cpp LoRA file
  (`gguf_adapter.py`), for `llama-cli -m model.gguf --lora adapter.gguf`;
- ollama: the GGUF plus a Modelfile (template from the chat template, stop tokens), `ollama.py`.

Every format writes through `maximus.export.target`: a new path, an empty directory or, with
`--overwrite`, a previous export of ours; nothing else is ever replaced.
"""
from __future__ import annotations

from maximus.export.local import export_gguf, export_gguf_lora, export_ollama
from maximus.export.merged import export_adapter, export_merged
from maximus.export.tuned import load_tuned, run_config

__all__ = ["export_adapter", "export_gguf", "export_gguf_lora", "export_merged", "export_ollama", "load_tuned", "run_config"]
