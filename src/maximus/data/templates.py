"""Prompt templates: the Alpaca prompt and the chat templates Maximus falls back to.

Chat data is rendered with the tokenizer's own chat template (`tokenizer.apply_chat_template`).
A tokenizer without one (most base models) gets `FALLBACK_CHAT_TEMPLATE`, set on the tokenizer so
that training and generation see the same text. The fallback uses no new special tokens (adding
tokens would resize the embeddings); each assistant turn ends with the tokenizer's EOS token so
that generation stops there:

    ### System:
    You are terse.

    ### User:
    What is 2+2?

    ### Assistant:
    4<eos>
"""
from __future__ import annotations

ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
"""The Stanford Alpaca prompt for records with a non-empty `input`; the `output` follows it."""

ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
"""The Stanford Alpaca prompt for records whose `input` is missing or empty."""


def alpaca_prompt(instruction: str, input_text: str | None) -> str:
    """The Alpaca prompt text (everything before the response) for one record."""
    if input_text:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


# BOS only when the tokenizer has one distinct from EOS (GPT-2 style tokenizers use one token for both,
# and a leading <|endoftext|> would only waste a position).
FALLBACK_CHAT_TEMPLATE = (
    "{% if bos_token and bos_token != eos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\n\n' }}{% endif %}"
    "{{ '### ' + message['role'] | capitalize + ':\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{% if messages %}{{ '\n\n' }}{% endif %}{{ '### Assistant:\n' }}{% endif %}"
)
"""Markdown-style turns, EOS after each assistant turn; used when the tokenizer has no template."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML (as used by Qwen), for tokenizers that have `<|im_start|>` / `<|im_end|>` tokens, e.g. the
one `build_tiny_tokenizer(chat_template=CHATML_TEMPLATE)` returns."""


def ensure_chat_template(tokenizer) -> bool:
    """Give `tokenizer` the fallback chat template if it has none. Returns True when it was set.

    Setting it on the tokenizer (rather than only using it here) means the tokenizer saved with
    the run renders prompts for generation exactly as they were rendered for training."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return True
