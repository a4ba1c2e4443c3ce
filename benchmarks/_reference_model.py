"""The benchmark reference model of docs/benchmarks/reference.md, built once and cached on disk.

A Llama-architecture model with a Llama-3-sized vocabulary (128,256 rows) but a small body
(hidden 512, 8 layers), so that on a 2-core CPU the output layer weighs in a step as it does in
real models. Weights are random (`torch.manual_seed(0)`): memory and speed depend on shapes,
not on weight values. It is saved with `save_pretrained` (safetensors, bf16: 156 M parameters,
about 312 MB on disk) together with a small byte-level BPE tokenizer; benchmarks feed random
token ids in [0, vocab_size), so the tokenizer only has to exist for loaders that want one.

    from _reference_model import reference_model_dir
    path = reference_model_dir()        # builds on first use (~10 s), then reuses the cache
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

#: The shape of docs/benchmarks/reference.md.
REFERENCE_CONFIG = dict(
    vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
    tie_word_embeddings=False, rope_theta=500000.0,
)
SEED = 0

#: Llama-3-8B's shape (random weights) for the GPU runs of `speed.py --shape 8b`: 8.0 B parameters,
#: 16 GB in bf16 on disk. Built on the GPU in bf16 (a float32 build on the CPU would take 32 GB and
#: minutes), so its values do not match a CPU build; only shapes matter for memory and speed.
LLAMA3_8B_CONFIG = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    tie_word_embeddings=False, rope_theta=500000.0,
)
SHAPES = {"reference": REFERENCE_CONFIG, "8b": LLAMA3_8B_CONFIG}
#: Bump when the saved content changes, so old caches are not reused.
_VERSION = "1"
_DONE = "BUILD_COMPLETE"


def default_cache_dir() -> Path:
    """`$MAXIMUS_CACHE/reference-llama-128k-v<version>` (default cache root `~/.cache/maximus`)."""
    from maximus.files import cache_root

    return cache_root() / f"reference-llama-128k-v{_VERSION}"


def build_reference_model(dtype: torch.dtype = torch.bfloat16):
    """The reference `LlamaForCausalLM`, randomly initialised from seed 0, in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**REFERENCE_CONFIG)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)  # initialised in float32, then cast: same values for every dtype
    return model.to(dtype)


def reference_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Directory holding the saved reference model and tokenizer; written on first call.

    The build goes to a temporary sibling directory and is renamed into place after a marker file
    is written, so an interrupted build is never mistaken for a finished one.
    """
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _saved(path, lambda: build_reference_model(torch.bfloat16))


def shaped_model_path(shape: str, cache_dir: str | Path | None = None) -> Path:
    """Where `shaped_model_dir` keeps the model of `SHAPES[shape]` (built or not)."""
    if cache_dir is not None:
        return Path(cache_dir)
    return default_cache_dir() if shape == "reference" else default_cache_dir().with_name(f"llama-{shape}-v{_VERSION}")


def shaped_model_dir(shape: str, cache_dir: str | Path | None = None, device: str = "cpu") -> Path:
    """The saved model of `SHAPES[shape]`: the reference model, or an 8B-shaped one built in bf16 on
    ``device`` (seed 0) and cached under ``cache_dir`` (default: beside the reference model)."""
    if shape == "reference":
        return reference_model_dir(cache_dir)

    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(SEED)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                return LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))
        finally:
            torch.set_default_dtype(default)

    return _saved(shaped_model_path(shape, cache_dir), build)


def _saved(path: Path, build) -> Path:
    if (path / _DONE).is_file():
        return path
    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = build()
    model.config.use_cache = False
    model.save_pretrained(str(tmp), safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(str(tmp))
    (tmp / _DONE).write_text("ok\n")
    del model
    if path.exists():  # a concurrent or broken build: replace it
        shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    """Build (or find) the saved model of one shape; prints ``RESULT {"path": ..., "build_s": ...}``.
    `benchmarks/speed.py` and `long_context.py` build the 8B shape in this child process, so the
    process that measures never held the build's GPU memory."""
    import argparse
    import json
    import time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="reference")
    parser.add_argument("--device", default="cpu", help="where the 8B shape is built (cuda: bf16 on the GPU)")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = shaped_model_dir(args.shape, args.cache_dir, args.device)
    print("RESULT " + json.dumps({"path": str(path), "build_s": time.perf_counter() - start}), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    from _child import guarded_main

    sys.exit(guarded_main(main))
