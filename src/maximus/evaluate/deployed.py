"""The deployed model: an exported GGUF file (or a `--format gguf-lora` export: the base file with
its adapter applied by llama.cpp) scored in llama.cpp (llama-cpp-python), on the same held-out rows
and examples as the Transformers model.

- loss: the mean next-token cross-entropy of the rows' target tokens (labels), from llama.cpp's
  logits over each document (a packed row is split where its positions restart, as training
  masks document starts), in float64 from llama.cpp's float32 logits;
- task metrics (`eval.metrics`): greedy completions of the held-out prompts decoded by llama.cpp,
  scored by the same metric functions (`maximus.evaluate.tasks.TaskEval.score`).

The token ids are the Hugging Face tokenizer's: the GGUF export carries the same vocabulary
(its tokenization is tested equal in tests/export), so both models score the same tokens.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from maximus.errors import ConfigError
from maximus.structure import IGNORE_INDEX


def _documents(row: dict) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per document of a row (positions restart at 0 where one begins)."""
    ids, labels = list(row["input_ids"]), list(row["labels"])
    positions = list(row.get("position_ids") or range(len(ids)))
    starts = [i for i, p in enumerate(positions) if p == 0] or [0]
    bounds = starts + [len(ids)]
    return [(ids[a:b], labels[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def shared_prefix(held, ids: list[int]) -> int:
    """How many first tokens `ids` has in common with `held` (what a cache holds), at most all but
    its last, so that at least one token is decoded and gives the last position's logits."""
    limit, keep = min(len(held), len(ids) - 1), 0
    while keep < limit and held[keep] == ids[keep]:
        keep += 1
    return keep


class LlamaCppModel:
    """One GGUF file loaded in llama.cpp with every position's logits kept (CPU). Consecutive
    documents share their common first tokens' cache, as llama.cpp's own prompt cache does."""

    def __init__(self, path: str | Path, *, context: int, threads: int | None = None, lora: str | Path | None = None):
        try:
            import llama_cpp
        except ImportError:
            raise ConfigError("maximus eval --gguf scores the file in llama.cpp, and llama-cpp-python is not installed",
                              "pip install 'maximusllm[llamacpp]'") from None
        self.path = Path(path)
        # the batch (prompt) threads too: llama.cpp's default takes every core, whose spinning
        # workers crawl on a machine shared with other jobs
        from llama_cpp._utils import suppress_stdout_stderr

        # the LoRA loader reports each tensor's buffer choice on stderr even when not verbose
        with suppress_stdout_stderr(disable=lora is None):
            self.llm = llama_cpp.Llama(str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                       logits_all=True, verbose=False, lora_path=None if lora is None else str(lora))
        self.vocab = self.llm.n_vocab()

    def _feed(self, ids: list[int]) -> None:
        """Make the context hold exactly `ids`, with every position's logits: the tokens it already
        holds in common with `ids` (a chat template's system prompt, a shared instruction) are kept
        with their cache and logits, and only the rest is decoded (at least the last token)."""
        keep = shared_prefix(self.llm.input_ids[: self.llm.n_tokens], ids)
        self.llm.n_tokens = keep  # `eval` drops the cache from here on
        self.llm.eval(ids[keep:])

    def loss_sum(self, ids: list[int], labels: list[int]) -> tuple[float, int]:
        """(sum of -log p(labels[t + 1] | ids[: t + 1]), number of such targets) for one document."""
        targets = [(t, labels[t + 1]) for t in range(len(ids) - 1) if labels[t + 1] != IGNORE_INDEX]
        if not targets:
            return 0.0, 0
        self._feed(ids)
        logits = np.asarray(self.llm.scores[: len(ids)], dtype=np.float64)
        total = 0.0
        for t, target in targets:
            row = logits[t]
            peak = row.max()
            total += float(peak + math.log(np.exp(row - peak).sum()) - row[target])
        return total, len(targets)

    def complete(self, prompts: list[list[int]], *, max_new_tokens: int, stops: list[int], tokenizer) -> list[str]:
        """Greedy completions of token-id prompts, decoded without special tokens."""
        texts = []
        for prompt in prompts:
            self._feed(list(prompt))
            new: list[int] = []
            for _ in range(max_new_tokens):
                token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
                if token in stops:
                    break
                new.append(token)
                self.llm.eval([token])
            texts.append(tokenizer.decode(new, skip_special_tokens=True))
        return texts

    def close(self) -> None:
        self.llm.close()


def gguf_lora_files(path: str | Path) -> tuple[Path, Path | None]:
    """(GGUF model file, llama.cpp LoRA file or None) of a deployed export: a GGUF file, or a
    `--format gguf-lora` directory (`model.gguf` + `adapter.gguf`)."""
    from maximus.export.gguf_adapter import ADAPTER_FILE, BASE_FILE

    path = Path(path)
    if path.is_dir():
        return path / BASE_FILE, path / ADAPTER_FILE
    return path, None


def gguf_quant(path: str | Path) -> str | None:
    """The `--quant` a Maximus export wrote into the file's metadata (None for another file); for a
    gguf-lora directory, its base file's."""
    import gguf

    from maximus.export.target import GGUF_MARKER_KEY

    path = gguf_lora_files(path)[0]
    field = gguf.GGUFReader(str(path)).fields.get(GGUF_MARKER_KEY)
    if field is None:
        return None
    return json.loads(bytes(field.parts[field.data[0]]).decode()).get("quant")


def score_gguf(path: str | Path, tokenizer, rows: list[dict], tasks=None, *, context: int, stops: list[int],
               threads: int | None = None, per_row: bool = False) -> dict:
    """The deployed file's report beside the Transformers model's (`maximus.evaluate.evaluate_sft`):
    `loss` / `perplexity` / `tokens` over `rows`, the task metrics of `tasks`, `file`, `quant`, `seconds`;
    with `per_row`, also `rows`: [loss sum, targets] of each document that has targets, in order."""
    started = time.perf_counter()
    model_file, adapter = gguf_lora_files(path)
    model = LlamaCppModel(model_file, context=context, threads=threads, lora=adapter)
    try:
        sums = [model.loss_sum(ids, labels) for row in rows for ids, labels in _documents(row)]
        sums = [[s, n] for s, n in sums if n]
        total, count = sum(s for s, _ in sums), sum(n for _, n in sums)
        loss = total / max(count, 1)
        result: dict = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
        if per_row:
            result["rows"] = sums
        if tasks is not None:
            result.update(tasks.score(None, device=None, complete=lambda prompts: model.complete(
                prompts, max_new_tokens=tasks.max_new_tokens, stops=stops, tokenizer=tokenizer)))
    finally:
        model.close()
    result.update(file=str(path), quant=gguf_quant(path), seconds=round(time.perf_counter() - started, 3))
    if adapter is not None:
        result["adapter"] = str(adapter)
    return result


def deployed_files(run_dir: str | Path) -> list[Path]:
    """The GGUF exports kept in the run directory (`RUN/exports/*.gguf`, an Ollama export's
    `RUN/exports/*/model.gguf`, where `maximus ui` writes them) that a Maximus export wrote; a
    gguf-lora export (`RUN/exports/*/` with `model.gguf` and `adapter.gguf`) is its directory."""
    from maximus.export.gguf_adapter import ADAPTER_FILE
    from maximus.export.to_gguf import is_maximus_gguf

    root = Path(run_dir) / "exports"
    if not root.is_dir():
        return []
    found = sorted(root.glob("*.gguf")) + sorted(root.glob("*/model.gguf"))
    return [p.parent if (p.parent / ADAPTER_FILE).is_file() and p.parent != root else p
            for p in found if is_maximus_gguf(p)]
