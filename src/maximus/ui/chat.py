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
- where: on the run's device (the CPU when this machine has no such device) in the run's dtype,
  with NF4 weights for a QLoRA run, as it trained (`Placement`); never more than one run's pair
  (base and tuned) loaded: chatting with another run drops the previous pair first (`Busy`
  while one of its models still answers);
- room: before a model loads, the project's estimate of its weights
  (`maximus.memory.estimate.estimate_peak`'s ``weights`` term, for that dtype and 4-bit or not)
  is compared with the free memory of the device (free GPU memory, or available RAM): a model
  that does not fit is refused in one line (`NoRoom`, 409) instead of swapping the machine;
- limits, so a tab cannot exhaust the machine: `max_new_tokens` at most `MAX_NEW_TOKENS`, the
  prompt at most `MAX_PROMPT_TOKENS`, and one generation at a time per model (a second request
  for a busy model gets `Busy`, 429).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from maximus.config import Config, format_bytes
from maximus.errors import ConfigError, MaximusError
from maximus.model_source import ModelSource, resolve_source

__all__ = ["Busy", "ChatModels", "NoRoom", "Placement", "chat_settings", "weight_bytes", "MAX_NEW_TOKENS",
           "MAX_PROMPT_TOKENS"]

MAX_NEW_TOKENS = 512
MAX_PROMPT_TOKENS = 4096
MAX_MESSAGES = 64
WHICH = ("tuned", "base")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Busy(MaximusError):
    """This model is already generating for another request."""


class NoRoom(MaximusError):
    """The model's weights do not fit the memory free on its device."""


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    chat: bool
    label: str
    device: torch.device
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Placement:
    """Where a run's chat models load: its `device` (the CPU when this machine lacks it), its
    `dtype`, and `quantized` (NF4 weights) for a QLoRA run, as run.json records the run."""

    device: torch.device
    dtype: torch.dtype
    quantized: bool

    @classmethod
    def of_run(cls, run_dir: Path) -> "Placement":
        import json

        summary = json.loads((Path(run_dir) / "run.json").read_text())
        device = torch.device(str(summary.get("device") or "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("cpu")
        elif device.type == "cuda":  # the run's child saw only its own device, as cuda:0: use this process's
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            device = torch.device("cpu")
        dtype = getattr(torch, str(summary.get("dtype") or "float32"), None)
        dtype = dtype if dtype in DTYPE_NAMES else torch.float32
        return cls(device, dtype, summary.get("method") == "qlora")


def weight_bytes(cfg: Config, placement: Placement, source: ModelSource | None = None) -> int:
    """The estimate of one chat model's weights (`estimate_peak`'s ``weights``) at `placement`:
    of `source`'s config when the base is resolved, else of `cfg.model` as the planner reads it."""
    from maximus.memory.estimate import estimate_peak

    estimate = estimate_peak(source.config if source is not None else cfg.model, method="qlora" if placement.quantized else "lora",
                             dtype=DTYPE_NAMES[placement.dtype], device=placement.device.type, micro_batch=1,
                             seq_len=64)
    return int(estimate.breakdown["weights"])


def free_bytes(device: torch.device) -> int:
    """Free memory of `device`: free GPU memory, or the host's available RAM."""
    from maximus.memory.planner import resolve_budget

    return int(resolve_budget("auto", device))


def check_room(name: str, which: str, need: int, free: int, device: torch.device) -> None:
    """`NoRoom` when `need` bytes of weights do not fit the `free` bytes of `device`."""
    if need > free:
        where = "the GPU" if device.type == "cuda" else "this machine's RAM"
        raise NoRoom(f"the {which} model of run {name} needs about {format_bytes(need)} for its weights, and "
                     f"{where} has {format_bytes(free)} free",
                     "stop a run or a program that holds memory, or chat with maximus generate on a larger machine")


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
    """The loaded models of one run at most: its tuned model and its base (see the module doc)."""

    def __init__(self):
        self._run: Path | None = None
        self._models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()

    def get(self, run_dir: Path, cfg: Config, which: str) -> LoadedModel:
        """The `which` model of the run at `run_dir` (`cfg`: its recorded config, as the guard
        passed it), loaded on first use. Raises `Busy` or `NoRoom`."""
        with self._lock:
            if self._run != run_dir:
                self._release()
                self._run = run_dir
            if which not in self._models:
                placement = Placement.of_run(run_dir)
                # The base model's source, resolved once for the estimate and the load (a full
                # fine-tune's tuned model loads from the run alone).
                full = (run_dir / "model").is_dir()
                source = None if which == "tuned" and full else resolve_source(cfg)
                try:
                    need = weight_bytes(cfg, placement, source)
                except MaximusError:  # a model the estimator cannot read: the load itself will tell
                    need = 0
                check_room(run_dir.name, which, need, free_bytes(placement.device), placement.device)
                self._models[which] = _load(run_dir, cfg, which, placement, source)
            return self._models[which]

    def loaded(self) -> tuple[Path | None, list[str]]:
        """(the run whose models are loaded, which of them)."""
        return self._run, sorted(self._models)

    def _release(self) -> None:
        busy = [w for w, m in self._models.items() if m.lock.locked()]
        if busy:
            raise Busy(f"the {busy[0]} model of run {self._run.name} is answering, and one run's models are loaded "
                       "at a time", "wait for that answer to finish")
        self._models = {}
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def stream(self, run_dir: Path, cfg: Config, settings: dict) -> Iterator[dict]:
        """Rows to send: ``{"token": text}`` as tokens come, then ``{"done": true, "text": ...,
        "tokens": N}``. Raises Busy before the first row when the model is generating already."""
        loaded = self.get(run_dir, cfg, settings["which"])
        if not loaded.lock.acquire(blocking=False):
            raise Busy(f"the {settings['which']} model of this run is answering another request",
                       "wait for it to finish; one generation at a time per model")
        try:
            ids = prompt_ids(loaded, settings["messages"])
        except BaseException:
            loaded.lock.release()
            raise
        return _generate(loaded, ids, settings)


def _load(run_dir: Path, cfg: Config, which: str, placement: Placement, source: ModelSource | None) -> LoadedModel:
    import json

    from maximus.data import trains_on_chat
    from maximus.export import load_tuned

    chat = trains_on_chat(json.loads((run_dir / "run.json").read_text()).get("data", {}))
    device, dtype = placement.device, placement.dtype
    quantized = placement.quantized and not (run_dir / "model").is_dir()
    if which == "tuned":
        model, tokenizer = load_tuned(run_dir, device=device, dtype=dtype, quantized=quantized, cfg=cfg, source=source)
        return LoadedModel(model, tokenizer, chat, "tuned", device)
    from transformers import AutoTokenizer

    from maximus.models import load_base_model

    saved = run_dir / "model" if (run_dir / "model").is_dir() else run_dir / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(str(saved))  # the run's tokenizer and chat template, as load_tuned's
    base = load_base_model(cfg, device, dtype, method="qlora" if quantized else "lora", source=source)
    label = "base"
    if cfg.init_adapter:
        from peft import PeftModel

        base, label = PeftModel.from_pretrained(base, cfg.init_adapter), "reference (init_adapter)"
    elif cfg.objective in ("dpo", "grpo"):
        label = "reference (base)"
    base.eval()
    return LoadedModel(base, tokenizer, chat, label, device)


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
    from transformers import TextIteratorStreamer

    tok = loaded.tokenizer
    input_ids = torch.tensor([ids], device=loaded.device)
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
