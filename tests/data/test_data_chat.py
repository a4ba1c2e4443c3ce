"""Chat templates and assistant-only loss masks, checked against Transformers' own assistant mask."""
from __future__ import annotations

import pytest

from maximus.data import CHATML_TEMPLATE, IGNORE_INDEX, build_datasets
from maximus.data.chat import encode_chat
from maximus.data.encoding import Encoder
from maximus.data.templates import FALLBACK_CHAT_TEMPLATE
from maximus.errors import DataError

CHAT = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, of course."},
]

# Qwen-style: ChatML that adds a default system prompt when the conversation has none.
CHATML_DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Gemma-style: no system role at all.
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>model\n' }}{% endif %}")

# The same ChatML with {% generation %} tags, so Transformers can compute the assistant mask itself.
CHATML_GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Writes EOS only after the final message: earlier turns render differently once the chat goes on.
EOS_ONLY_LAST = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% if loop.last %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def trained_segments(tok, ids, labels) -> list[str]:
    """The text of each run of consecutive tokens that are in the loss."""
    segments, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            segments.append(tok.decode(current))
            current = []
    if current:
        segments.append(tok.decode(current))
    return segments


def test_fallback_template_is_installed_and_masks_assistant_turns(tok):
    assert tok.chat_template is None
    from maximus.data.templates import ensure_chat_template

    assert ensure_chat_template(tok) is True and tok.chat_template == FALLBACK_CHAT_TEMPLATE
    assert ensure_chat_template(tok) is False  # an existing template is never replaced
    doc = Encoder(tok).chat(CHAT)
    text = tok.decode(doc.input_ids)
    assert text == ("### System:\nBe terse.\n\n### User:\nWhat is 2+2?\n\n### Assistant:\n4<|endoftext|>\n\n"
                    "### User:\nAnd 3+3?\n\n### Assistant:\n6, of course.<|endoftext|>")
    assert trained_segments(tok, doc.input_ids, doc.labels) == ["4<|endoftext|>", "6, of course.<|endoftext|>"]
    assert doc.input_ids[-1] == tok.eos_token_id and doc.input_ids.count(tok.eos_token_id) == 2  # no extra EOS


def test_default_system_prompt_template_masks_it(tok):
    tok.chat_template = CHATML_DEFAULT_SYSTEM
    doc = Encoder(tok).chat(CHAT[1:])
    assert tok.decode(doc.input_ids).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert trained_segments(tok, doc.input_ids, doc.labels) == ["4<|im_end|>\n", "6, of course.<|im_end|>\n<|endoftext|>"]


def test_template_without_system_role_gets_it_folded_into_the_first_user_turn(tok):
    tok.chat_template = NO_SYSTEM
    doc = Encoder(tok).chat(CHAT)
    assert tok.decode(doc.input_ids).startswith("<|im_start|>user\nBe terse.\n\nWhat is 2+2?<|im_end|>\n<|im_start|>model\n4")
    assert trained_segments(tok, doc.input_ids, doc.labels) == ["4<|im_end|>\n", "6, of course.<|im_end|>\n<|endoftext|>"]


def test_template_that_drops_system_messages_gets_it_folded(tok):
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    doc = Encoder(tok).chat(CHAT)
    assert "Be terse.\n\nWhat is 2+2?" in tok.decode(doc.input_ids)


@pytest.mark.parametrize("messages", [
    CHAT,
    CHAT[1:],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
     {"role": "user", "content": "bye"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c c"}],
])
def test_mask_equals_transformers_assistant_tokens_mask(tok, messages):
    tok.chat_template = CHATML_GENERATION
    oracle = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = encode_chat(tok, messages)
    assert ids == oracle["input_ids"]
    assert [int(m) for m in mask] == oracle["assistant_masks"]
    assert any(mask)


def test_chatml_template_of_the_tiny_tokenizer_uses_its_special_tokens(tok):
    tok.chat_template = CHATML_TEMPLATE
    ids, _ = encode_chat(tok, CHAT[1:3])
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2


def test_template_that_is_not_prefix_stable_falls_back_to_content_search(tok):
    tok.chat_template = EOS_ONLY_LAST
    doc = Encoder(tok).chat(CHAT[1:])
    assert tok.decode(doc.input_ids) == "[user] What is 2+2?\n[assistant] 4\n[user] And 3+3?\n[assistant] 6, of course.<|endoftext|>\n"
    # Middle turn: its content (the EOS its own render ends with is not in the full text); last turn:
    # content plus the end-of-turn text. " 4" is one token that overlaps the content, so it is in.
    # The text ends with EOS (a newline after it aside): no second EOS is appended.
    assert trained_segments(tok, doc.input_ids, doc.labels) == [" 4", " 6, of course.<|endoftext|>\n"]


def test_train_on_inputs_and_no_assistant(tok):
    tok.chat_template = CHATML_TEMPLATE
    doc = Encoder(tok, train_on_inputs=True).chat(CHAT)
    assert doc.labels == doc.input_ids
    doc = Encoder(tok).chat(CHAT[:2])
    assert not doc.has_loss()


def test_sharegpt_and_chat_files_build_the_same_rows(write_jsonl, spec, tok, tmp_path):
    chat = write_jsonl([{"messages": CHAT}], "chat.jsonl")
    share = write_jsonl([{"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                             "value": m["content"]} for m in CHAT]}], "share.jsonl")
    a = build_datasets([spec(chat)], tok, seq_len=128, eval_split=0)
    b = build_datasets([spec(share)], tok, seq_len=128, eval_split=0)
    assert a.train == b.train and a.stats["chat_template_fallback"] is True


def test_template_rejection_is_a_record_error(write_jsonl, spec, tok):
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                         "{% endif %}{{ m['content'] }}{% endfor %}")
    path = write_jsonl([{"messages": CHAT[1:3]}, {"messages": [CHAT[2], CHAT[1]]}])
    with pytest.raises(DataError) as err:
        build_datasets([spec(path)], tok, seq_len=64, eval_split=0)
    assert err.value.message == (f"{path}:2: cannot tokenize record: Conversation roles must alternate "
                                 "user/assistant/user/assistant/...")
    splits = build_datasets([spec(path, on_error="skip")], tok, seq_len=64, eval_split=0)
    assert splits.stats["skipped"] == 1 and splits.stats["documents"] == 1
