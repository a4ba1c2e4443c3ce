"""`maximus embed MODEL_OR_RUN_DIR --input texts.txt|texts.jsonl --out vecs.npy [--dim 64]`.

Writes one L2-normalised float32 row per input text, in input order, to a NumPy ``.npy`` file.
The source is a finished run directory (``run.json`` + ``adapter/`` or ``model/``: loaded with
its adapter by :func:`maximus.export.load_tuned`) or a local Hugging Face model directory
(safetensors weights only).

Pooling defaults to the run's own (`contrastive.pooling` of a run trained with
`objective: contrastive`), else `mean`; `--pooling` overrides it.

Input formats: ``.txt`` = one text per line (a blank line is an error, so row ``i`` of the output
is always line ``i + 1``); ``.jsonl`` = one JSON object per line, the text under ``--field``.
"""
from __future__ import annotations

import json
from pathlib import Path

from maximus.arguments import ArgumentParser
from maximus.errors import DataError, ModelError


def read_texts(path: Path, field: str = "text") -> list[str]:
    """The texts of a ``.txt`` (one per line) or ``.jsonl`` (``field`` of each object) file.

    Raises:
        DataError: missing file, unknown extension, blank line, bad JSON, missing field, no text.
    """
    if not path.is_file():
        raise DataError(f"input file {path} not found", hint="pass --input a .txt (one text per line) or .jsonl file")
    if path.suffix not in (".txt", ".jsonl"):
        raise DataError(f"input file {path} is neither .txt nor .jsonl",
                        hint="use one text per line (.txt) or one JSON object per line (.jsonl)")
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            raise DataError(f"line {number} of {path} is blank",
                            hint="remove blank lines: each line is one text and one row of the output")
        if path.suffix == ".txt":
            texts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"line {number} of {path} is not valid JSON ({err.msg})",
                            hint="write one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise DataError(f"line {number} of {path} has no string field {field!r}",
                            hint="choose the text field with --field")
        texts.append(record[field])
    if not texts:
        raise DataError(f"input file {path} has no texts", hint="write one text per line")
    return texts


def load_model_and_tokenizer(source: Path):
    """(model, tokenizer) of a finished run (adapter applied) or of a local model directory."""
    if (source / "run.json").is_file():
        from maximus.export import load_tuned

        return load_tuned(source)
    if not (source / "config.json").is_file():
        raise ModelError(f"{source} is neither a Maximus run directory (run.json) nor a model directory (config.json)",
                         hint="pass a run's output_dir or a directory written by save_pretrained")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(str(source))
    except OSError as err:
        raise ModelError(f"cannot load the model in {source}: {str(err).splitlines()[0]}",
                         hint="the directory needs config.json, *.safetensors weights and tokenizer files") from None
    return model.eval(), tokenizer


def default_pooling(source: Path) -> str:
    """The pooling a run was trained with (`objective: contrastive`), else ``mean``."""
    if not (source / "run.json").is_file():
        return "mean"
    try:
        config = json.loads((source / "run.json").read_text(encoding="utf-8")).get("config", {})
    except (OSError, json.JSONDecodeError):
        return "mean"
    if config.get("objective") == "contrastive":
        return config.get("contrastive", {}).get("pooling", "mean")
    return "mean"


def embed_main(argv: list[str]) -> int:
    """Entry point of ``maximus embed``; returns the exit code (user errors raise MaximusError)."""
    parser = ArgumentParser(prog="maximus embed",
                                     description="Embed texts with a model's final hidden states (Matryoshka prefixes).")
    parser.add_argument("source", metavar="MODEL_OR_RUN_DIR", help="finished run directory or local model directory")
    parser.add_argument("--input", required=True, help=".txt (one text per line) or .jsonl file")
    parser.add_argument("--field", default="text", help="text field of each .jsonl object (default: text)")
    parser.add_argument("--out", required=True, help="output .npy file: float32 [texts, dim], rows L2-normalised")
    parser.add_argument("--dim", type=int, default=None, help="keep the first DIM hidden dimensions (default: all)")
    parser.add_argument("--pooling", default=None, choices=["mean", "last"],
                        help="default: the run's contrastive.pooling, else mean")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512, help="tokens per text (longer texts are truncated)")
    args = parser.parse_args(argv)

    texts = read_texts(Path(args.input), args.field)
    model, tokenizer = load_model_and_tokenizer(Path(args.source))
    pooling = args.pooling or default_pooling(Path(args.source))
    import numpy as np

    from maximus.embed import embed

    vectors = embed(model, tokenizer, texts, dim=args.dim, pooling=pooling,
                    batch_size=args.batch_size, max_length=args.max_length)
    out = Path(args.out)
    if out.suffix != ".npy":
        out = out.with_name(out.name + ".npy")  # what np.save would do anyway; say it
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, vectors.numpy())
    print(f"wrote {out}: {vectors.shape[0]} x {vectors.shape[1]} float32 ({pooling} pooling, L2-normalised)")
    return 0
