"""Preference pairs (prompt, chosen, rejected) for DPO-style objectives.

Plain form (strings): `[BOS] + prompt`, then each answer + EOS; no chat template, as for
prompt/completion records. Chat form (any of prompt / chosen / rejected is a message list): a
string prompt becomes one user message, a string answer one assistant message, and
`prompt + answer` is rendered with the chat template; when `prompt` is absent it is the longest
shared start of the two conversations. Only the answer's assistant turns are in the loss (never
the prompt, even with train_on_inputs).

Fitting into seq_len tokens: when prompt + longer answer is too long, the prompt keeps its last
`max(seq_len - longer answer, seq_len // 2)` tokens (cut from the left, so the text right before
the answer stays), and answers are cut from the right to fill what remains.
"""
from __future__ import annotations

from dataclasses import dataclass

from maximus.data.encoding import IGNORE_INDEX, Document, Encoder
from maximus.data.formats import PreferenceExample


@dataclass
class PreferencePair:
    """Tokenized pair; each side is its own document starting with the (same) prompt."""

    chosen: Document
    rejected: Document

    def row(self) -> dict:
        return {"chosen_input_ids": self.chosen.input_ids, "chosen_labels": self.chosen.labels,
                "rejected_input_ids": self.rejected.input_ids, "rejected_labels": self.rejected.labels}


def encode_preference(encoder: Encoder, example: PreferenceExample) -> PreferencePair:
    """Tokenize both sides of a pair (prompt tokens have label -100)."""
    prompt, chosen, rejected = example.prompt, example.chosen, example.rejected
    if not any(isinstance(x, list) for x in (prompt, chosen, rejected)):
        prompt_ids = encoder.prefix_ids + encoder.tokens(prompt)
        return PreferencePair(*(encoder.prompt_completion(prompt_ids, encoder.tokens(answer) + [encoder.eos_id],
                                                          train_on_inputs=False)
                                for answer in (chosen, rejected)))
    prompt_messages, chosen, rejected = chat_prompt_and_answers(prompt, chosen, rejected)
    start = len(prompt_messages)
    return PreferencePair(encoder.chat(prompt_messages + chosen, start, train_on_inputs=False),
                          encoder.chat(prompt_messages + rejected, start, train_on_inputs=False))


def chat_prompt_and_answers(prompt, chosen, rejected) -> tuple[list, list, list]:
    """Message lists (prompt, chosen answer, rejected answer) for the chat form."""
    def as_answer(x):
        return x if isinstance(x, list) else [{"role": "assistant", "content": x}]

    chosen, rejected = as_answer(chosen), as_answer(rejected)
    if prompt is None:  # implicit prompt: the shared start of both conversations
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        return chosen[:shared], chosen[shared:], rejected[shared:]
    prompt_messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return prompt_messages, chosen, rejected


def fit_pair(pair: PreferencePair, seq_len: int) -> tuple[PreferencePair, bool]:
    """Truncate the pair to seq_len tokens per side (see module doc). Returns (pair, was_truncated)."""
    def prompt_length(doc: Document) -> int:
        return next((i for i, label in enumerate(doc.labels) if label != IGNORE_INDEX), len(doc.labels))

    sides = [pair.chosen, pair.rejected]
    prompts = [prompt_length(d) for d in sides]
    answers = [len(d.input_ids) - p for d, p in zip(sides, prompts)]
    if max(p + a for p, a in zip(prompts, answers)) <= seq_len:
        return pair, False
    keep = min(max(prompts), max(seq_len - max(answers), seq_len // 2))
    fitted = []
    for doc, p in zip(sides, prompts):
        cut = max(0, p - keep)  # tokens dropped from the left of this side's prompt
        ids, labels = doc.input_ids[cut:], doc.labels[cut:]
        fitted.append(Document(ids[:seq_len], labels[:seq_len]))
    return PreferencePair(*fitted), True
