"""Evaluation against the base model: always the exact loss, never an approximation.

- `heldout_loss`: mean next-token cross-entropy over the held-out rows (exact chunked loss) and
  perplexity.
- `exact_match`: for held-out documents with a prompt (tokens without loss) and a completion,
  greedy generation of the completion and the fraction reproduced exactly.
- `generate_text`: generations for `eval.prompts`, shown before and after training (through the
  chat template for runs trained on conversations).
"""
from __future__ import annotations

import math

import torch

from maximus.forward import IGNORE_INDEX, autocast_for, sft_loss_sum


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


#: run.json's `exact_match_note` when `eval.exact_match` found no document to score.
NO_PROMPT_NOTE = ("no held-out document has a prompt (plain text, or prompts in the loss with "
                  "training.train_on_inputs): exact match needs prompt/completion, alpaca or chat data")


def prompt_completion_pairs(rows: list[dict], limit: int) -> list[tuple[list[int], list[int]]]:
    """Split held-out rows into documents (by position_ids restarts) and keep those shaped
    prompt (no loss) then completion (loss): the pairs exact-match can score.

    A prompt is at least 2 tokens without loss: packing takes every document's first token out of
    the loss (nothing in the row predicts it), so a 1-token head is what plain text looks like and
    cannot be told from a 1-token prompt. Such documents are not scored."""
    pairs = []
    for row in rows:
        ids, labels, pos = row["input_ids"], row["labels"], row.get("position_ids") or list(range(len(row["input_ids"])))
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            doc_ids, doc_labels = ids[a:b], labels[a:b]
            first = next((i for i, l in enumerate(doc_labels) if l != IGNORE_INDEX), None)
            if first is None or first < 2:
                continue
            completion = [t for t, l in zip(doc_ids[first:], doc_labels[first:]) if l != IGNORE_INDEX]
            pairs.append((doc_ids[:first], completion))
            if len(pairs) >= limit:
                return pairs
    return pairs


@torch.no_grad()
def exact_match(model, pairs, *, eos_token_id: int | None, pad_token_id: int, device: torch.device) -> float | None:
    """Fraction of completions reproduced exactly by greedy decoding (stopping at EOS)."""
    if not pairs:
        return None
    was_training = model.training
    model.eval()
    hits = 0
    try:
        for prompt, completion in pairs:
            want = [t for t in completion if t != eos_token_id]
            out = model.generate(input_ids=torch.tensor([prompt], device=device),
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                                 max_new_tokens=len(completion), do_sample=False, eos_token_id=eos_token_id,
                                 pad_token_id=pad_token_id, use_cache=True)
            got = [t for t in out[0, len(prompt):].tolist() if t != eos_token_id and t != pad_token_id]
            hits += int(got[:len(want)] == want and len(got) >= len(want))
    finally:
        model.train(was_training)
    return hits / len(pairs)


@torch.no_grad()
def generate_text(model, tokenizer, prompts: list[str], *, device: torch.device, max_new_tokens: int = 32,
                  chat: bool = False) -> list[str]:
    """Greedy generations for `prompts`. With `chat` (runs trained on conversations, see
    `maximus.data.trains_on_chat`) each prompt is one user turn through the chat template, as the
    model saw its training data; otherwise the raw text, as for text and prompt/completion runs."""
    from maximus.data import chat_prompt_ids

    was_training = model.training
    model.eval()
    outputs = []
    try:
        for prompt in prompts:
            if chat:
                ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)], device=device)
            else:
                ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=True).input_ids.to(device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, use_cache=True)
            outputs.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return outputs
