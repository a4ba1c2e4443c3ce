"""`format: chat` loss masks token for token against TRL's assistant-only mask (Transformers'
`return_assistant_tokens_mask` over TRL's `*_training.jinja` templates, which mark the assistant
turns with `{% generation %}`) on the ChatML, Llama 3, Gemma and Phi-3 templates, and a Mistral
template rebuilt here (the hub is unreachable); and no second EOS when EOS ends every turn."""
from __future__ import annotations

import os

import pytest
import trl

from maximus.data import IGNORE_INDEX, build_tiny_tokenizer
from maximus.data.encoding import Encoder
from test_data_chat import CHAT  # the same five-message conversation

TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")


# Mistral's instruct format ([INST] ... [/INST] answer</s>), with the generation tags TRL's
# training templates use; the system prompt goes in front of the first user turn.
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% set ns = namespace() %}"
    "{% elif m['role'] == 'user' %}[INST] {% if loop.index0 == 1 and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}{{ m['content'] }} [/INST]"
    "{% else %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}{% endfor %}")


def _tokenizer(template: str, eos: str | None = None):
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    if eos is not None:
        tok.eos_token = eos
    return tok


def _trl_mask(tok, messages) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _ours(tok, messages) -> tuple[list[int], list[int]]:
    doc = Encoder(tok).chat(messages)
    return doc.input_ids, [int(label != IGNORE_INDEX) for label in doc.labels]


@pytest.mark.parametrize("name, messages", [
    ("llama3_training", CHAT),
    ("gemma_training", CHAT[1:]),  # Gemma has no system role
    ("phi3_training", CHAT),
])
def test_mask_equals_trl_assistant_only_mask(name, messages):
    tok = _tokenizer(open(os.path.join(TEMPLATES, f"{name}.jinja")).read())
    ids, mask = _trl_mask(tok, messages)
    if ids[-1] != tok.eos_token_id:  # the encoder ends every document with EOS, in the loss after an answer
        ids, mask = ids + [tok.eos_token_id], mask + [1]
    assert _ours(tok, messages) == (ids, mask)


def test_mistral_mask_equals_the_generation_mask():
    tok = _tokenizer(MISTRAL)
    tok.bos_token = "<|pad|>"
    assert _ours(tok, CHAT) == _trl_mask(tok, CHAT)


def test_chatml_with_eos_im_end_has_one_eos_and_trl_mask_but_the_header_newline():
    """Qwen / SmolLM: EOS is `<|im_end|>` and every turn ends `<|im_end|>\\n`: no second EOS is
    appended. TRL's ChatML template starts the generation block before the newline that ends
    `<|im_start|>assistant`; that newline belongs to the generation prompt the model is given at
    inference, so it is not trained here: the only difference from TRL's mask."""
    tok = _tokenizer(open(os.path.join(TEMPLATES, "qwen2_5_training.jinja")).read(), eos="<|im_end|>")
    ids, mask = _ours(tok, CHAT)
    trl_ids, trl_mask = _trl_mask(tok, CHAT)
    assert ids == trl_ids
    assert tok.decode(ids).endswith("6, of course.<|im_end|>\n") and ids.count(tok.eos_token_id) == 5
    header_newlines = [i for i in range(1, len(ids)) if tok.decode(ids[i:i + 1]) == "\n"
                       and tok.decode(ids[:i + 1]).endswith("<|im_start|>assistant\n")]
    assert len(header_newlines) == 2
    assert [m for i, m in enumerate(trl_mask) if i not in header_newlines] == \
        [m for i, m in enumerate(mask) if i not in header_newlines]
    assert [mask[i] for i in header_newlines] == [0, 0] and [trl_mask[i] for i in header_newlines] == [1, 1]
