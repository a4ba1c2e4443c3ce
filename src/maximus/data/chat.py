"""Render a conversation with the tokenizer's chat template and find the tokens of assistant turns.

Masking rule: the loss covers, for each assistant message, the text the template writes for that
message after the generation prompt (`add_generation_prompt=True`) of the conversation so far,
up to the end of that message: its content, the end-of-turn marker (e.g. `<|im_end|>` or EOS) and
anything else the template writes with it (e.g. a trailing newline). Everything else (system,
user, tool turns, role headers, a default system prompt the template adds) gets no loss.

How: render the whole conversation once, then for assistant message i render
`messages[:i]` + generation prompt (start of the turn) and `messages[:i + 1]` (end of the turn);
both are prefixes of the full text for every ordinary template, which gives each turn's character
span. The full text is tokenized once with offsets, and a token is in the loss when it overlaps a
span (the rule of `apply_chat_template(return_assistant_tokens_mask=True)`, which needs
`{% generation %}` tags few templates have). Templates that rewrite earlier turns (so the prefix
property fails) fall back to finding the message content in the full text, plus the end-of-turn
text that follows it.

Templates without system-prompt support (they raise, or drop the message) get the system
content prepended to the first user message, separated by a blank line.
"""
from __future__ import annotations

from maximus.data.formats import Messages
from maximus.data.templates import ensure_chat_template


def render(tokenizer, messages: Messages, add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages` (no tokenization)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def fit_system_messages(tokenizer, messages: Messages) -> tuple[Messages, str]:
    """`messages` (with system turns folded into the first user turn when the template cannot show
    them) and the full rendered text. Template errors (jinja2.TemplateError) propagate."""
    systems = [m["content"] for m in messages if m["role"] == "system"]
    if not systems:
        return messages, render(tokenizer, messages)
    try:
        full = render(tokenizer, messages)
        if all(content in full for content in systems):
            return messages, full
    except Exception:  # jinja2.TemplateError from raise_exception('System role not supported'), etc.
        pass
    folded = fold_system_messages(messages)
    return folded, render(tokenizer, folded)


def fold_system_messages(messages: Messages) -> Messages:
    """Move system contents to the start of the first user message (or a new first user message)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    rest = [dict(m) for m in messages if m["role"] != "system"]
    for message in rest:
        if message["role"] == "user":
            message["content"] = f"{system}\n\n{message['content']}"
            return rest
    return [{"role": "user", "content": system}, *rest]


def text_of(content) -> str:
    """The text of a message content: a string, or a list of parts (its text parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def assistant_spans(tokenizer, messages: Messages, full: str, train_from_message: int = 0) -> list[tuple[int, int]]:
    """Character spans [start, end) in `full` (the template's text of all of `messages`) of the
    assistant messages with index >= train_from_message. The text that ends the last message is
    `full` itself, so a one-turn conversation costs one render more than `full`, not two."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < train_from_message:
            continue
        end_text = full if i + 1 == len(messages) else render(tokenizer, messages[: i + 1])
        start_text = render(tokenizer, messages[:i], add_generation_prompt=True) if i > 0 else None
        if (start_text is not None and end_text.startswith(start_text) and full.startswith(end_text)
                and len(start_text) >= cursor):
            span = (len(start_text), len(end_text))
        else:
            span = _find_content(message["content"], end_text, full, cursor)
        if span[1] > span[0]:
            spans.append(span)
        cursor = max(cursor, span[1])
    return spans


def _find_content(content, end_text: str, full: str, cursor: int) -> tuple[int, int]:
    """Fallback span: the message content found after `cursor`, extended by the end-of-turn text
    the template writes after it (taken from the render that ends with this message). A content
    given as a list of parts (images and text) is looked up by its text."""
    content = text_of(content)
    start = full.find(content, cursor)
    if start < 0 or not content:
        return (cursor, cursor)
    end = start + len(content)
    tail_at = end_text.rfind(content)
    tail = end_text[tail_at + len(content):] if tail_at >= 0 else ""
    # The end-of-turn text as far as the full conversation has it too: a template that writes
    # more after the final message (Phi-3's EOS) still ends an earlier turn with `<|end|>\n`;
    # a partial match is cut back to its last line break (not into the next turn's `<|user|>`).
    common = 0
    while common < len(tail) and end + common < len(full) and full[end + common] == tail[common]:
        common += 1
    if common < len(tail):
        common = tail.rfind("\n", 0, common) + 1
    return (start, end + common)


def tokenize_with_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Token ids of `text` (no special tokens added: the template wrote them) and, per token,
    whether it overlaps one of `spans`."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
    except (NotImplementedError, ValueError, KeyError):
        return _tokenize_pieces(tokenizer, text, spans)  # tokenizers without offsets (slow, Python-only ones)
    ids = list(encoded["input_ids"])
    mask = [False] * len(ids)
    span_index = 0
    for t, (start, end) in enumerate(offsets):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index == len(spans):
            break
        if end > spans[span_index][0] and end > start:
            mask[t] = True
    return ids, mask


def _tokenize_pieces(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    cursor = 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, trainable in ((text[cursor:start], False), (text[start:end], True)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids.extend(piece_ids)
                mask.extend([trainable] * len(piece_ids))
        cursor = end
    return ids, mask


def encode_chat(tokenizer, messages: Messages, train_from_message: int = 0) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and the per-token assistant mask.

    `train_from_message`: only assistant messages at this index or later are marked (preference
    pairs mark the answer, not assistant turns inside the prompt)."""
    ids, mask, _ = encode_chat_text(tokenizer, messages, train_from_message)
    return ids, mask


def encode_chat_text(tokenizer, messages: Messages,
                     train_from_message: int = 0) -> tuple[list[int], list[bool], tuple[int, ...]]:
    """`encode_chat`'s ids and mask, and the indices of the messages whose content the template
    left out of the text (it dropped them silently; the data check reports them)."""
    fitted, full = fit_system_messages(tokenizer, messages)
    if fitted is not messages:  # system turns were folded away: shift the index to match
        inserted_user = not any(m["role"] == "user" for m in messages)
        train_from_message = sum(m["role"] != "system" for m in messages[:train_from_message]) + inserted_user
    ids, mask = tokenize_with_spans(tokenizer, full, assistant_spans(tokenizer, fitted, full, train_from_message))
    dropped = tuple(i for i, m in enumerate(messages) if text_of(m["content"]).strip() not in full)
    return ids, mask, dropped


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of `prompt` as a chat model sees it at inference: one user turn plus the
    generation prompt, tokenized as training tokenizes a rendered conversation (the template
    writes the special tokens). A tokenizer without a template gets the training fallback."""
    ensure_chat_template(tokenizer)
    text = render(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
