"""Record shapes: auto detection, conversion, exact token/label layout, and missing-field errors."""
from __future__ import annotations

import pytest

from maximus.config import DatasetSpec
from maximus.data import IGNORE_INDEX, build_datasets
from maximus.data.encoding import Encoder
from maximus.data.formats import ChatExample, PreferenceExample, PromptCompletion, TextExample, detect_format, to_example
from maximus.data.templates import ALPACA_PROMPT_NO_INPUT, ALPACA_PROMPT_WITH_INPUT
from maximus.errors import DataError

SPEC = DatasetSpec(path="x")


@pytest.mark.parametrize("fields, expected", [
    ({"text": "hi"}, "text"),
    ({"instruction": "i", "input": "", "output": "o"}, "alpaca"),
    ({"prompt": "p", "completion": "c"}, "prompt_completion"),
    ({"messages": [{"role": "user", "content": "u"}]}, "chat"),
    ({"conversations": [{"from": "human", "value": "u"}]}, "sharegpt"),
    ({"conversations": [{"role": "user", "content": "u"}]}, "chat"),
    ({"prompt": "p", "chosen": "a", "rejected": "b"}, "preference"),
])
def test_auto_detection(fields, expected):
    assert detect_format(fields, SPEC, "f.jsonl") == expected


def test_detection_respects_renamed_fields_and_explicit_format():
    assert detect_format({"body": "x"}, DatasetSpec(path="x", text_field="body"), "f") == "text"
    assert detect_format({"q": "x", "a": "y"}, DatasetSpec(path="x", prompt_field="q", completion_field="a"), "f") \
        == "prompt_completion"
    assert detect_format({"anything": 1}, DatasetSpec(path="x", format="text"), "f") == "text"


def test_detection_error_message():
    with pytest.raises(DataError) as err:
        detect_format({"question": "q", "answer": "a"}, SPEC, "qa.jsonl")
    assert str(err.value) == (
        "cannot detect the format of qa.jsonl: fields ['answer', 'question']; set format: in the dataset entry "
        "(hint: format: one of text, alpaca, sharegpt, chat, prompt_completion, preference, pairs, prompt; rename fields with "
        "text_field, prompt_field, completion_field, messages_field, chosen_field, rejected_field, query_field, "
        "positive_field)")


def test_conversions():
    assert to_example({"text": "hi"}, "text", SPEC, "w") == TextExample("hi", "w")
    assert to_example({"instruction": "Add", "input": "1 2", "output": "3"}, "alpaca", SPEC, "w") == \
        PromptCompletion(ALPACA_PROMPT_WITH_INPUT.format(instruction="Add", input="1 2"), "3", "w")
    assert to_example({"instruction": "Hi", "output": "Hello"}, "alpaca", SPEC, "w").prompt == \
        ALPACA_PROMPT_NO_INPUT.format(instruction="Hi")
    assert to_example({"prompt": "2+2=", "completion": 4}, "prompt_completion", SPEC, "w") == \
        PromptCompletion("2+2=", "4", "w")
    sharegpt = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"},
                                  {"from": "gpt", "value": "a"}]}
    assert to_example(sharegpt, "sharegpt", SPEC, "w") == ChatExample(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "w")
    pair = to_example({"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
                      "preference", SPEC, "w")
    assert pair == PreferenceExample("p", [{"role": "assistant", "content": "a"}], "b", "w")


def test_alpaca_prompt_text_is_the_stanford_template():
    assert ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nSay hi.\n\n### Response:\n")


@pytest.mark.parametrize("fmt, fields, message", [
    ("alpaca", {"instruction": "i"}, "d.jsonl:7: missing field 'output' for format alpaca (record has ['instruction'])"),
    ("text", {"body": "x"}, "d.jsonl:7: missing field 'text' for format text (record has ['body'])"),
    ("prompt_completion", {"prompt": "p"},
     "d.jsonl:7: missing field 'completion' for format prompt_completion (record has ['prompt'])"),
    ("chat", {"msgs": []}, "d.jsonl:7: missing field 'messages' for format chat (record has ['msgs'])"),
    ("preference", {"prompt": "p", "chosen": "a"},
     "d.jsonl:7: missing field 'rejected' for format preference (record has ['chosen', 'prompt'])"),
    ("preference", {"chosen": "a", "rejected": "b"},
     "d.jsonl:7: missing field 'prompt' for format preference (record has ['chosen', 'rejected'])"),
    ("sharegpt", {"conversations": [{"from": "bot", "value": "x"}]},
     "d.jsonl:7: invalid record for format sharegpt: message 0 has unknown 'from': 'bot' (expected one of human, "
     "user, gpt, assistant, system, tool, function_call, observation)"),
    ("chat", {"messages": [{"role": "user"}]},
     "d.jsonl:7: invalid record for format chat: message 0 of 'messages' needs 'role' and 'content'"),
    ("text", {"text": ["a"]}, "d.jsonl:7: invalid record for format text: field 'text' must be a string, got list"),
])
def test_record_errors_name_file_line_and_field(fmt, fields, message):
    with pytest.raises(DataError) as err:
        to_example(fields, fmt, SPEC, "d.jsonl:7")
    assert err.value.message == message


def test_missing_field_error_through_build_and_skip(write_jsonl, spec, tok):
    path = write_jsonl([{"instruction": "a", "output": "b"}, {"instruction": "c"}, {"instruction": "d", "output": "e"}])
    with pytest.raises(DataError) as err:
        build_datasets([spec(path)], tok, seq_len=64, eval_split=0)
    assert err.value.message == f"{path}:2: missing field 'output' for format alpaca (record has ['instruction'])"
    splits = build_datasets([spec(path, on_error="skip")], tok, seq_len=64, eval_split=0)
    assert splits.stats["skipped"] == 1 and splits.stats["documents"] == 2


def test_text_document_tokens_and_labels(tok):
    doc = Encoder(tok).encode(TextExample("The fox", "w"))
    assert doc.input_ids == tok("The fox", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert doc.labels == doc.input_ids


def test_prompt_completion_masks_prompt_unless_train_on_inputs(tok):
    prompt_ids = tok("2+2=", add_special_tokens=False)["input_ids"]
    answer_ids = tok("4", add_special_tokens=False)["input_ids"]
    doc = Encoder(tok).encode(PromptCompletion("2+2=", "4", "w"))
    assert doc.input_ids == prompt_ids + answer_ids + [0]
    assert doc.labels == [IGNORE_INDEX] * len(prompt_ids) + answer_ids + [0]
    everything = Encoder(tok, train_on_inputs=True).encode(PromptCompletion("2+2=", "4", "w"))
    assert everything.labels == everything.input_ids


def test_bos_prefix_is_taken_from_the_tokenizer(tok):
    from tokenizers import processors

    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert tok("a")["input_ids"][0] == bos  # the tokenizer now adds BOS like Llama's
    doc = Encoder(tok).encode(PromptCompletion("Q", "A", "w"))
    assert doc.input_ids == [bos] + tok("Q", add_special_tokens=False)["input_ids"] + \
        tok("A", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert doc.input_ids.count(bos) == 1  # the completion did not get a second BOS
