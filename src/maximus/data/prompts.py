"""The `prompt` format (`objective: grpo`): prompts to sample from, and the columns rewards read.

A record holds a prompt, in `prompt_field` (default `prompt`):

- a string: tokenized as the prompt side of `prompt_completion` is (`[BOS] + prompt`), so a
  policy tuned on prompt/completion data sees its prompts exactly as in training;
- a list of chat messages (`[{role, content}, ...]`): rendered with the tokenizer's chat template
  and `add_generation_prompt=True` (the fallback template is installed when there is none).

Every other field of the record is a column passed to the reward functions by name, as TRL does
(`answer`, `solution`, ...). A row is a plain dict:

    {"prompt_ids": [int, ...], "prompt": str | messages, "columns": {name: value}, "where": "file:line"}

Prompts longer than `seq_len` tokens keep their last `seq_len` tokens (the end of a prompt is
what a completion continues) and are counted as `truncated`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from maximus.errors import DataError

from maximus.data.formats import Messages, _invalid, _message_list, _missing


@dataclass
class PromptExample:
    """A prompt to sample completions for, and the record's other fields."""

    prompt: Union[str, Messages]
    columns: dict
    where: str


def to_prompt_example(fields: dict, spec, where: str) -> PromptExample:
    """Interpret one record of format `prompt`. Raises DataError naming `where` and the field."""
    name = spec.prompt_field
    value = fields.get(name)
    if value is None:
        raise _missing(name, "prompt", where, fields)
    if isinstance(value, list):
        prompt = _message_list(value, name, "prompt", where)
    elif isinstance(value, str):
        if not value.strip():
            raise _invalid(where, "prompt", f"field '{name}' is empty")
        prompt = value
    else:
        raise _invalid(where, "prompt", f"field '{name}' must be a string or a list of messages, "
                       f"got {type(value).__name__}")
    return PromptExample(prompt, {k: v for k, v in fields.items() if k != name}, where)


def encode_prompt(encoder, example: PromptExample) -> dict:
    """The row of a prompt example (module doc), untruncated."""
    from maximus.data.chat import render
    from maximus.data.templates import ensure_chat_template

    if isinstance(example.prompt, str):
        ids = encoder.prefix_ids + encoder.tokens(example.prompt)
    else:
        ensure_chat_template(encoder.tokenizer)
        text = render(encoder.tokenizer, example.prompt, add_generation_prompt=True)
        ids = list(encoder.tokenizer(text, add_special_tokens=False)["input_ids"])
    return {"prompt_ids": ids, "prompt": example.prompt, "columns": example.columns, "where": example.where}


def fit_prompt_rows(rows: list[dict], seq_len: int) -> tuple[list[dict], int, int]:
    """(rows with at most `seq_len` prompt tokens, how many were cut, prompt tokens kept)."""
    out, truncated, tokens = [], 0, 0
    for row in rows:
        if len(row["prompt_ids"]) > seq_len:
            row = {**row, "prompt_ids": row["prompt_ids"][-seq_len:]}
            truncated += 1
        tokens += len(row["prompt_ids"])
        out.append(row)
    return out, truncated, tokens


def check_prompt_format(fmt: str, path) -> None:
    """`objective: grpo` reads prompts only; any other explicit format is a mistake."""
    if fmt != "prompt":
        raise DataError(f"objective grpo needs prompt records (a prompt, plus columns for the rewards); {path} has "
                        f"format {fmt}", "set `format: prompt` (other fields are passed to the reward functions)")
