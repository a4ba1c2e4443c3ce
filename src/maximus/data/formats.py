"""Record shapes: detect a record's format and turn it into one of four example kinds.

| format              | fields (defaults; renamable in the spec)          | becomes             |
|---------------------|---------------------------------------------------|---------------------|
| `text`              | `text`                                            | `TextExample`       |
| `alpaca`            | `instruction`, `input` (optional), `output`       | `PromptCompletion`  |
| `prompt_completion` | `prompt`, `completion`                            | `PromptCompletion`  |
| `chat`              | `messages`: [{role, content}]                     | `ChatExample`       |
| `sharegpt`          | `conversations`: [{from, value}]                  | `ChatExample`       |
| `preference`        | `prompt` (optional in chat form), `chosen`, `rejected` | `PreferenceExample` |
| `pairs`             | `query`, `positive`                               | `PairExample`       |
| `prompt`            | `prompt` (string or messages), any other columns  | `PromptExample` (`maximus.data.prompts`; objective grpo) |

`auto` detection looks at the fields of the first record of each source, in this order:
chosen+rejected -> preference, query+positive -> pairs, messages / conversations -> chat, or sharegpt when the first
message has `from` (instead of `role`),
instruction+output -> alpaca, prompt+completion -> prompt_completion, text -> text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from maximus.errors import DataError

from maximus.data.templates import alpaca_prompt

FORMATS = ("text", "alpaca", "sharegpt", "chat", "prompt_completion", "preference", "pairs", "prompt")

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_call": "assistant", "observation": "tool"}

Messages = list[dict]  # [{"role": str, "content": str}, ...]


@dataclass
class TextExample:
    """Plain text; every token is trained on."""

    text: str
    where: str


@dataclass
class PromptCompletion:
    """A prompt (no loss unless train_on_inputs) followed by a completion (loss)."""

    prompt: str
    completion: str
    where: str


@dataclass
class ChatExample:
    """A conversation; assistant turns get the loss."""

    messages: Messages
    where: str


@dataclass
class PreferenceExample:
    """A prompt with a preferred and a rejected answer. Strings, or message lists (chat form)."""

    prompt: Union[str, Messages, None]
    chosen: Union[str, Messages]
    rejected: Union[str, Messages]
    where: str


@dataclass
class PairExample:
    """A query and the document that answers it (contrastive embedding training)."""

    query: str
    positive: str
    where: str


Example = Union[TextExample, PromptCompletion, ChatExample, PreferenceExample, PairExample]


def messages_field(spec, fmt: str) -> str:
    """The field holding the conversation for `chat` / `sharegpt` records."""
    return spec.messages_field or ("conversations" if fmt == "sharegpt" else "messages")


def detect_format(fields: dict, spec, source: str) -> str:
    """The format of a source from the fields of its first record (or `spec.format` when set)."""
    if spec.format != "auto":
        return spec.format
    keys = set(fields)
    if {spec.chosen_field, spec.rejected_field} <= keys:
        return "preference"
    if {spec.query_field, spec.positive_field} <= keys:
        return "pairs"
    conversation = next((k for k in (spec.messages_field, "messages", "conversations") if k and k in keys), None)
    if conversation is not None:
        first = fields[conversation][0] if isinstance(fields[conversation], list) and fields[conversation] else {}
        return "sharegpt" if isinstance(first, dict) and "from" in first else "chat"
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if {spec.prompt_field, spec.completion_field} <= keys:
        return "prompt_completion"
    if spec.text_field in keys:
        return "text"
    raise DataError(f"cannot detect the format of {source}: fields {sorted(keys)}; set format: in the dataset entry",
                    f"format: one of {', '.join(FORMATS)}; rename fields with text_field, prompt_field, "
                    "completion_field, messages_field, chosen_field, rejected_field, query_field, positive_field")


def to_example(fields: dict, fmt: str, spec, where: str) -> Example:
    """Interpret one record. Raises DataError naming `where` and the missing or invalid field."""
    if fmt == "text":
        return TextExample(_text(fields, spec.text_field, fmt, where), where)
    if fmt == "alpaca":
        instruction = _text(fields, "instruction", fmt, where)
        input_text = _text(fields, "input", fmt, where, required=False)
        output = _text(fields, "output", fmt, where)
        return PromptCompletion(alpaca_prompt(instruction, input_text), output, where)
    if fmt == "prompt_completion":
        return PromptCompletion(_text(fields, spec.prompt_field, fmt, where),
                                _text(fields, spec.completion_field, fmt, where), where)
    if fmt == "chat":
        return ChatExample(_messages(fields, messages_field(spec, fmt), fmt, where), where)
    if fmt == "sharegpt":
        return ChatExample(_messages(fields, messages_field(spec, fmt), fmt, where, sharegpt=True), where)
    if fmt == "preference":
        return _preference(fields, spec, where)
    if fmt == "pairs":
        return PairExample(_text(fields, spec.query_field, fmt, where), _text(fields, spec.positive_field, fmt, where),
                           where)
    raise DataError(f"unknown dataset format '{fmt}'", f"use one of {', '.join(FORMATS)}")


def _missing(field: str, fmt: str, where: str, fields: dict) -> DataError:
    return DataError(f"{where}: missing field '{field}' for format {fmt} (record has {sorted(fields)})",
                     "fix the record, rename fields in the dataset entry (e.g. text_field:), "
                     "or set `on_error: skip`")


def _invalid(where: str, fmt: str, what: str) -> DataError:
    return DataError(f"{where}: invalid record for format {fmt}: {what}", "fix the record, or set `on_error: skip`")


def _text(fields: dict, name: str, fmt: str, where: str, required: bool = True) -> str | None:
    value = fields.get(name)
    if value is None:
        if required:
            raise _missing(name, fmt, where, fields)
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # CSV-like sources and numeric answers ("42") are still text
    if not isinstance(value, str):
        raise _invalid(where, fmt, f"field '{name}' must be a string, got {type(value).__name__}")
    return value


def _messages(fields: dict, name: str, fmt: str, where: str, sharegpt: bool = False) -> Messages:
    value = fields.get(name)
    if value is None:
        raise _missing(name, fmt, where, fields)
    return _message_list(value, name, fmt, where, sharegpt)


def _message_list(value, name: str, fmt: str, where: str, sharegpt: bool = False) -> Messages:
    if not isinstance(value, list) or not value:
        raise _invalid(where, fmt, f"field '{name}' must be a non-empty list of messages")
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or role_key not in message or content_key not in message:
            raise _invalid(where, fmt, f"message {i} of '{name}' needs '{role_key}' and '{content_key}'")
        role, content = message[role_key], message[content_key]
        if sharegpt:
            if role not in SHAREGPT_ROLES:
                raise _invalid(where, fmt, f"message {i} has unknown 'from': {role!r} "
                               f"(expected one of {', '.join(SHAREGPT_ROLES)})")
            role = SHAREGPT_ROLES[role]
        if not isinstance(role, str) or not isinstance(content, str):
            raise _invalid(where, fmt, f"message {i} of '{name}': '{role_key}' and '{content_key}' must be strings")
        messages.append({"role": role, "content": content})
    return messages


def _preference(fields: dict, spec, where: str) -> PreferenceExample:
    def side(name: str):
        value = fields.get(name)
        if value is None:
            raise _missing(name, "preference", where, fields)
        if isinstance(value, list):
            return _message_list(value, name, "preference", where)
        return _text(fields, name, "preference", where)

    chosen, rejected = side(spec.chosen_field), side(spec.rejected_field)
    prompt = fields.get(spec.prompt_field)
    chat_form = isinstance(chosen, list) or isinstance(rejected, list)
    if prompt is None:
        if not chat_form:  # a prompt may only be left out when it is the shared start of two conversations
            raise _missing(spec.prompt_field, "preference", where, fields)
    else:
        prompt = side(spec.prompt_field)
    return PreferenceExample(prompt, chosen, rejected, where)
