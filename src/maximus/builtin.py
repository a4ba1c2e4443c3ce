"""The embedded default: a tiny model and a task the project builds itself, offline, in seconds.

`model: builtin:tiny-llama` and `dataset: builtin:reverse-words` in a config resolve to a
directory under the cache (``$MAXIMUS_CACHE`` or ``~/.cache/maximus``) that is written once,
deterministically, then reused. Every command that reads a config resolves them with `resolve`
(`maximus-train`, `maximus plan` with or without ``--measure``, `maximus eval` and `maximus export`
through `maximus.export.run_config`, `maximus ui`'s planner and run check through `maximus plan`);
a run records the names as written, so its run.json stays valid when the cache is cleared.

- `tiny-llama`: a randomly initialised Llama-architecture model (4 layers, hidden 128, seeded)
  with a byte-level BPE tokenizer trained on the task's own text. Random weights: the "base" knows
  nothing, so the before/after table shows what fine-tuning taught it.
- `reverse-words`: a procedurally generated instruction task (prompt/completion jsonl): reverse
  a list of 3-5 words. Held-out accuracy (exact match) goes from 0 % to most of the way in a few
  hundred steps on two CPU cores.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from maximus.errors import ConfigError
from maximus.files import cache_root

PREFIX = "builtin:"
WORDS = ("apple banana cherry grape lemon mango olive peach pear plum river stone cloud storm flame "
         "frost light night green blue red gold silver north south east west tiger zebra horse eagle "
         "shark whale robin maple cedar").split()
_VERSION = "1"


def reverse_words_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(3, 5))
        out.append({"prompt": f"Reverse: {' '.join(words)}\nAnswer:", "completion": " " + " ".join(reversed(words))})
    return out


def _atomic_dir(final: Path, build) -> Path:
    """`final`, built once by `build(dir)` into a temporary sibling of ours (our name and pid),
    marked complete and renamed into place. A `final` without the mark was not written here (a
    build is renamed in only once complete): it is refused, never removed."""
    if (final / ".complete").is_file():
        return final
    if final.exists() or final.is_symlink():
        raise ConfigError(f"{final} exists and holds no complete build of the embedded default (no .complete)",
                          "move it away, or set MAXIMUS_CACHE to another directory; nothing was changed")
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    (tmp / ".complete").write_text(_VERSION)
    try:
        os.replace(tmp, final)
    except OSError:  # another process won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / ".complete").is_file():
            raise
    return final


def builtin_dir(name: str) -> Path:
    """Where the builtin `name` is built: under the cache, tagged by name and builder version."""
    tag = hashlib.sha1(f"{name}-{_VERSION}".encode()).hexdigest()[:8]
    return cache_root() / "builtin" / f"{name}-{tag}"


def _build_reverse_words(d: Path) -> None:
    with open(d / "train.jsonl", "w", encoding="utf-8") as f:
        for rec in reverse_words_records(4000, seed=1234):
            f.write(json.dumps(rec) + "\n")


def _build_tiny_llama(d: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    texts = [r["prompt"] + r["completion"] for r in reverse_words_records(2000, seed=99)]
    tokenizer = build_tiny_tokenizer(texts, vocab_size=320)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(d), safe_serialization=True)
    tokenizer.save_pretrained(str(d))


BUILDERS = {"tiny-llama": _build_tiny_llama, "reverse-words": _build_reverse_words}


def is_builtin(ref) -> bool:
    """Whether `ref` (a config's model, tokenizer or dataset path) names an embedded default."""
    return isinstance(ref, str) and ref.startswith(PREFIX)


def materialize(ref: str) -> str:
    """Path of a builtin model or dataset directory (built on first use); other refs unchanged."""
    if not is_builtin(ref):
        return ref
    name = ref[len(PREFIX):]
    if name not in BUILDERS:
        raise ConfigError(f"unknown builtin '{ref}'", f"available: {', '.join(PREFIX + k for k in BUILDERS)}")
    return str(_atomic_dir(builtin_dir(name), BUILDERS[name]))


def _resolve_specs(specs):
    """`specs` (a config's dataset list) with builtin: paths materialised; the same list when none is."""
    out = [s.model_copy(update={"path": materialize(s.path)}) if is_builtin(s.path) else s for s in specs]
    return out if any(a is not b for a, b in zip(out, specs)) else specs


def resolve(cfg):
    """A copy of `cfg` whose builtin: references (model, tokenizer, dataset, eval.dataset) point
    at materialised directories; `cfg` itself when it names none. The one resolution every
    command that reads a config calls."""
    changes = {}
    if is_builtin(cfg.model):
        changes["model"] = materialize(cfg.model)
    if is_builtin(cfg.tokenizer):
        changes["tokenizer"] = materialize(cfg.tokenizer)
    datasets = cfg.datasets
    specs = _resolve_specs(datasets)
    if specs is not datasets:
        changes["dataset"] = specs
    held_out = cfg.eval.dataset or []
    held_out_specs = _resolve_specs(held_out)
    if held_out_specs is not held_out:
        changes["eval"] = cfg.eval.model_copy(update={"dataset": held_out_specs})
    if not changes:
        return cfg
    return cfg.model_copy(update=changes)
