"""Chat with a finished run: its tuned model and its base answer the same messages, streamed.

- tuned: `maximus.export.load_tuned` (base in full precision plus the adapter), as `maximus
  generate RUN` loads it; base: the run's base model, or for a run that started from an
  `init_adapter` (a DPO or GRPO run on top of an SFT run) that adapter, which is the reference
  those objectives compare with. Both use the run's tokenizer and chat template.
- prompt: a run trained on conversations renders the messages with its chat template and the
  generation prompt (for one user turn exactly `maximus.data.chat_prompt_ids`, what `maximus
  generate` uses); any other run continues the last user message's raw text, as it was trained.
- decoding: greedy at temperature 0 (the default: the same tokens as `maximus generate`),
  otherwise sampling with `temperature` and `top_p`.
- limits, so a tab cannot exhaust the machine: `max_new_tokens` at most `MAX_NEW_TOKENS`, the
  prompt at most `MAX_PROMPT_TOKENS`, and one generation at a time per model (a second request
  for a busy model gets `Busy`, 429); at most `KEEP_RUNS` runs stay loaded.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maximus.errors import ConfigError, MaximusError

__all__ = ["Busy", "ChatModels", "chat_settings", "MAX_NEW_TOKENS", "MAX_PROMPT_TOKENS"]

MAX_NEW_TOKENS = 512
MAX_PROMPT_TOKENS = 4096
MAX_MESSAGES = 64
KEEP_RUNS = 2
WHICH = ("tuned", "base")


class Busy(MaximusError):
    """This model is already generating for another request."""


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    chat: bool
    label: str
    lock: threading.Lock = field(default_factory=threading.Lock)


def chat_settings(body: dict) -> dict:
    """The generation settings of a chat request, checked; raises ConfigError (400)."""
    which = body.get("model", "tuned")
    if which not in WHICH:
        raise ConfigError(f"model must be tuned or base, got {which!r}", 'send "model": "tuned" or "base"')
    messages = body.get("messages")
    if (not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES
            or not all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                       and isinstance(m.get("content"), str) for m in messages)):
        raise ConfigError(f"messages must be a list of 1-{MAX_MESSAGES} {{role, content}} turns",
                          'e.g. "messages": [{"role": "user", "content": "Hello"}]')
    if messages[-1]["role"] != "user":
        raise ConfigError("the last message must be the user's", "end messages with a user turn")
    n = body.get("max_new_tokens", 64)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_NEW_TOKENS:
        raise ConfigError(f"max_new_tokens must be a whole number from 1 to {MAX_NEW_TOKENS}, got {n!r}",
                          "this server caps generations so that a tab cannot exhaust the machine")
    temperature, top_p = body.get("temperature", 0.0), body.get("top_p", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 5:
        raise ConfigError(f"temperature must be a number from 0 to 5, got {temperature!r}", "0 = greedy")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be a number in (0, 1], got {top_p!r}", "1 = off")
    return {"which": which, "messages": messages, "max_new_tokens": n, "temperature": float(temperature),
            "top_p": float(top_p)}


class ChatModels:
    """The loaded models, `KEEP_RUNS` runs at most (least recently used goes first)."""

    def __init__(self):
        self._runs: OrderedDict[Path, dict[str, LoadedModel]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, run_dir: Path, which: str) -> LoadedModel:
        with self._lock:
            models = self._runs.setdefault(run_dir, {})
            self._runs.move_to_end(run_dir)
            while len(self._runs) > KEEP_RUNS:
                self._runs.popitem(last=False)
            if which not in models:
                models[which] = _load(run_dir, which)
            return models[which]

    def stream(self, run_dir: Path, settings: dict) -> Iterator[dict]:
        """Rows to send: ``{"token": text}`` as tokens come, then ``{"done": true, "text": ...,
        "tokens": N}``. Raises Busy before the first row when the model is generating already."""
        loaded = self.get(run_dir, settings["which"])
        if not loaded.lock.acquire(blocking=False):
            raise Busy(f"the {settings['which']} model of this run is answering another request",
                       "wait for it to finish; one generation at a time per model")
        try:
            ids = prompt_ids(loaded, settings["messages"])
        except BaseException:
            loaded.lock.release()
            raise
        return _generate(loaded, ids, settings)


def _load(run_dir: Path, which: str) -> LoadedModel:
    import json

    import torch

    from maximus.data import trains_on_chat
    from maximus.export import load_tuned, run_config

    chat = trains_on_chat(json.loads((run_dir / "run.json").read_text()).get("data", {}))
    if which == "tuned":
        model, tokenizer = load_tuned(run_dir)
        return LoadedModel(model, tokenizer, chat, "tuned")
    from transformers import AutoTokenizer

    from maximus.models import load_base_model

    saved = run_dir / "model" if (run_dir / "model").is_dir() else run_dir / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(str(saved))  # the run's tokenizer and chat template, as load_tuned's

    cfg = run_config(run_dir)
    base = load_base_model(cfg, torch.device("cpu"), torch.float32, method="lora")
    label = "base"
    if cfg.init_adapter:
        from peft import PeftModel

        base, label = PeftModel.from_pretrained(base, cfg.init_adapter), "reference (init_adapter)"
    elif cfg.objective in ("dpo", "grpo"):
        label = "reference (base)"
    base.eval()
    return LoadedModel(base, tokenizer, chat, label)


def prompt_ids(loaded: LoadedModel, messages: list[dict]) -> list[int]:
    tok = loaded.tokenizer
    if loaded.chat:
        from maximus.data.chat import render
        from maximus.data.templates import ensure_chat_template

        ensure_chat_template(tok)
        ids = list(tok(render(tok, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"])
    else:
        ids = list(tok(messages[-1]["content"], add_special_tokens=True)["input_ids"])
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ConfigError(f"the prompt is {len(ids)} tokens, more than this server's {MAX_PROMPT_TOKENS}",
                          "shorten the conversation")
    return ids


def _generate(loaded: LoadedModel, ids: list[int], settings: dict) -> Iterator[dict]:
    """Generate in a thread (it releases the model's lock when done, even if the client left)."""
    import torch
    from transformers import TextIteratorStreamer

    tok = loaded.tokenizer
    input_ids = torch.tensor([ids])
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True, timeout=600)
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  max_new_tokens=settings["max_new_tokens"], pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, use_cache=True, streamer=streamer)
    if settings["temperature"] > 0:
        kwargs.update(do_sample=True, temperature=settings["temperature"], top_p=settings["top_p"])
    else:
        kwargs.update(do_sample=False)
    result: dict = {}

    def run() -> None:
        try:
            with torch.no_grad():
                result["out"] = loaded.model.generate(**kwargs)
        except Exception as exc:  # a bug or a model that cannot generate: one line to the client
            result["error"] = " ".join(str(exc).split()) or type(exc).__name__
            streamer.end()
        finally:
            loaded.lock.release()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()

    def rows() -> Iterator[dict]:
        for text in streamer:
            if text:
                yield {"token": text}
        worker.join()
        if "error" in result:
            yield {"error": f"generation failed: {result['error']}"}
            return
        new = result["out"][0, len(ids):]
        yield {"done": True, "label": loaded.label, "tokens": int(new.numel()),
               "text": tok.decode(new, skip_special_tokens=True)}

    return rows()
