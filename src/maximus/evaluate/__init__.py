"""Evaluation against the base model: always the exact loss, never an approximation.

- `heldout_loss`: mean next-token cross-entropy over the held-out rows (exact chunked loss) and
  perplexity.
- `evaluate_sft`: what an SFT run reports before and after training: the held-out loss, the task
  metrics of `eval.metrics` (`maximus.evaluate.tasks`, `maximus.evaluate.metrics`), generations
  for `eval.prompts`, and the seconds it took.
- `generate_text` / `greedy_texts`: greedy generations (through the chat template for runs
  trained on conversations).
- The prompting baseline (`eval.few_shot`) is `TaskEval.score_prompted`; the end-of-run table and
  the verdict against it are in `maximus.evaluate.report`.
"""
from __future__ import annotations

import math
import time

import torch

from maximus.forward import autocast_for, sft_loss_sum


@torch.no_grad()
def heldout_loss(model, rows: list[dict], *, pad_token_id: int, device: torch.device, dtype: torch.dtype,
                 batch_size: int = 4, max_batches: int | None = None, chunk_size: int | None = None) -> dict:
    """{"loss", "perplexity", "tokens"} over `rows` with the exact loss (sum / token count)."""
    from maximus.data import collate

    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    try:
        for i, start in enumerate(range(0, len(rows), batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size], pad_token_id).items()}
            with autocast_for(device, dtype):
                loss_sum, n_target = sft_loss_sum(model, batch, mode="exact", chunk_size=chunk_size)
            total += loss_sum.double()
            count += int(n_target)
    finally:
        model.train(was_training)
    loss = float(total / max(count, 1))
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}


def evaluate_sft(model, tokenizer, rows: list[dict], *, cfg, tasks=None, device: torch.device, dtype: torch.dtype,
                 batch_size: int, chat: bool) -> dict:
    """An SFT model's held-out report: `loss` / `perplexity` / `tokens` over `rows` (when there are
    any), the task metrics of `tasks` (a `TaskEval`), `generations` for `eval.prompts`, `seconds`."""
    started = time.perf_counter()
    result: dict = {}
    if rows:
        result.update(heldout_loss(model, rows, pad_token_id=tokenizer.pad_token_id, device=device, dtype=dtype,
                                   batch_size=batch_size, max_batches=cfg.eval.max_batches))
    if tasks is not None:
        result.update(tasks.score(model, device=device, batch_size=batch_size))
    if cfg.eval.prompts:
        result["generations"] = generate_text(model, tokenizer, cfg.eval.prompts, device=device,
                                              max_new_tokens=cfg.eval.max_new_tokens, chat=chat,
                                              vision=vision_encoder_for(cfg, model, rows))
    if result:
        result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def _stop_ids(model, tokenizer) -> list[int]:
    """EOS ids that end a greedy completion: the tokenizer's and the model's generation config's."""
    stops = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops += list(configured) if isinstance(configured, (list, tuple)) else [configured]
    return [int(t) for t in dict.fromkeys(stops) if t is not None]


def vision_encoder_for(cfg, model, rows: list[dict]):
    """The `VisionEncoder` of a vision-language model's run (the one its rows were built with,
    else one from its processor), or None for a text model."""
    from maximus.structure import causal_lm_of
    from maximus.vision import is_vision_config

    if not is_vision_config(causal_lm_of(model).config):
        return None
    if rows and "images" in rows[0]:
        return rows[0]["images"].encoder
    from maximus.data.vision import VisionEncoder
    from maximus.vision import load_processor

    return VisionEncoder(load_processor(cfg.tokenizer or cfg.model, cfg.trust_remote_code), cfg.vision.max_pixels,
                         image_root=cfg.vision.image_root)


@torch.no_grad()
def greedy_texts(model, tokenizer, prompts: list, *, device: torch.device, max_new_tokens: int,
                 batch_size: int = 1) -> list[str]:
    """Greedy completion of each prompt (token ids), up to `max_new_tokens`, stopping at EOS (the
    tokenizer's and the model's generation config's), decoded without special tokens.

    `batch_size` prompts decode together, padded on the left (decoding is memory-bound, so a batch
    costs about what one prompt does); the completions equal one-at-a-time decoding (tested).
    A prompt may also be a dict of model inputs with a batch of one (a vision-language prompt with
    its image tensors, `maximus.data.vision.VisionEncoder.prompt`): those decode one at a time."""
    was_training = model.training
    model.eval()
    stops = _stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    outputs = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            if isinstance(chunk[0], dict):
                inputs = [{k: v.to(device) for k, v in p.items()} for p in chunk]
                widths = [int(p["input_ids"].shape[1]) for p in inputs]
            else:
                width = max(len(p) for p in chunk)
                ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in chunk], device=device)
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
                inputs, widths = [{"input_ids": ids, "attention_mask": mask}], [width]
            for batch, width in zip(inputs, widths):
                out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                     eos_token_id=stops, use_cache=True)
                outputs += [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]
    finally:
        model.train(was_training)
    return outputs


def generate_text(model, tokenizer, prompts: list, *, device: torch.device, max_new_tokens: int = 32,
                  chat: bool = False, vision=None) -> list[str]:
    """Greedy generations for `prompts`. With `chat` (runs trained on conversations, see
    `maximus.data.trains_on_chat`) each prompt is one user turn through the chat template, as the
    model saw its training data; otherwise the raw text, as for text and prompt/completion runs.

    `vision` (a `maximus.data.vision.VisionEncoder`, for a vision-language model): each prompt is
    one user turn through the processor, an image prompt (`maximus.config.ImagePrompt`) with its
    images before the text. Raises ConfigError for an image prompt without `vision`."""
    from maximus.data import chat_prompt_ids

    if vision is not None:
        ids = [vision.prompt_for(p) for p in prompts]
    else:
        if any(not isinstance(p, str) for p in prompts):
            from maximus.errors import ConfigError

            raise ConfigError("eval.prompts: an image prompt needs a vision-language model",
                              "give images only to a model with a vision tower; use a text prompt")
        ids = [chat_prompt_ids(tokenizer, p) if chat else tokenizer(p, add_special_tokens=True).input_ids
               for p in prompts]
    return greedy_texts(model, tokenizer, ids, device=device, max_new_tokens=max_new_tokens)
