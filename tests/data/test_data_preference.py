"""Preference pairs for DPO: prompt masking, chat form, implicit prompts, truncation, rows."""
from __future__ import annotations

import pytest

from maximus.data import CHATML_TEMPLATE, IGNORE_INDEX, build_datasets, collate
from maximus.data.encoding import Document, Encoder
from maximus.data.formats import PreferenceExample
from maximus.data.preference import PreferencePair, encode_preference, fit_pair
from maximus.errors import DataError


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_plain_pair_masks_the_prompt(tok):
    pair = encode_preference(Encoder(tok, train_on_inputs=True), PreferenceExample("Q: 2+2?", " 4", " 5", "w"))
    prompt = ids(tok, "Q: 2+2?")
    assert pair.chosen.input_ids == prompt + ids(tok, " 4") + [0]
    assert pair.chosen.labels == [IGNORE_INDEX] * len(prompt) + ids(tok, " 4") + [0]  # prompt masked even so
    assert pair.rejected.input_ids == prompt + ids(tok, " 5") + [0]


def test_chat_pair_with_string_prompt(tok):
    tok.chat_template = CHATML_TEMPLATE
    pair = encode_preference(Encoder(tok), PreferenceExample(
        "Hi", [{"role": "assistant", "content": "Hello!"}], "Go away", "w"))
    expected = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                                       tokenize=True, return_dict=False)
    assert pair.chosen.input_ids == expected + [0]
    trained = [t for t, l in zip(pair.chosen.input_ids, pair.chosen.labels) if l != IGNORE_INDEX]
    assert tok.decode(trained) == "Hello!<|im_end|>\n<|endoftext|>"
    trained = [t for t, l in zip(pair.rejected.input_ids, pair.rejected.labels) if l != IGNORE_INDEX]
    assert tok.decode(trained) == "Go away<|im_end|>\n<|endoftext|>"


def test_implicit_prompt_is_the_shared_start_and_earlier_assistant_turns_are_not_trained(tok):
    tok.chat_template = CHATML_TEMPLATE
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    pair = encode_preference(Encoder(tok), PreferenceExample(
        None, history + [{"role": "assistant", "content": "good"}], history + [{"role": "assistant", "content": "bad"}], "w"))
    for side, answer in ((pair.chosen, "good"), (pair.rejected, "bad")):
        trained = [t for t, l in zip(side.input_ids, side.labels) if l != IGNORE_INDEX]
        assert tok.decode(trained) == f"{answer}<|im_end|>\n<|endoftext|>"


def test_fit_pair_cuts_prompt_left_and_answers_right():
    def side(prompt, answer):
        return Document(list(range(prompt + answer)), [IGNORE_INDEX] * prompt + list(range(prompt, prompt + answer)))

    pair, cut = fit_pair(PreferencePair(side(10, 3), side(10, 6)), seq_len=12)
    # keep = min(10, max(12 - 6, 12 // 2)) = 6 prompt tokens, from the left
    assert cut and pair.chosen.input_ids == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert pair.rejected.input_ids == list(range(4, 16))
    assert pair.rejected.labels[:6] == [IGNORE_INDEX] * 6
    pair, cut = fit_pair(PreferencePair(side(2, 20), side(2, 3)), seq_len=12)
    assert cut and pair.chosen.input_ids == list(range(12)) and pair.rejected.input_ids == list(range(5))
    same, cut = fit_pair(PreferencePair(side(2, 3), side(2, 3)), seq_len=12)
    assert not cut and same.chosen.input_ids == list(range(5))


def test_build_dpo_rows_and_collate(write_jsonl, spec, tok):
    path = write_jsonl([{"prompt": f"Q{i}:", "chosen": " yes", "rejected": " no no no no"} for i in range(10)])
    splits = build_datasets([spec(path)], tok, seq_len=64, eval_split=0.2, objective="dpo")
    assert len(splits.train) == 8 and len(splits.eval) == 2
    row = splits.train[0]
    assert set(row) == {"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"}
    batch = collate(splits.train[:3], tok.pad_token_id)
    assert batch["chosen_input_ids"].shape == batch["rejected_input_ids"].shape
    assert splits.stats["documents"] == 10 and splits.stats["truncated"] == 0
    short = build_datasets([spec(path)], tok, seq_len=4, eval_split=0, objective="dpo")
    assert short.stats["truncated"] == 10
    assert all(len(r["rejected_input_ids"]) <= 4 for r in short.train)


def test_sft_on_preference_data_learns_the_chosen_answer(write_jsonl, spec, tok):
    path = write_jsonl([{"prompt": "Q:", "chosen": " yes", "rejected": " no"}])
    splits = build_datasets([spec(path)], tok, seq_len=64, eval_split=0, objective="sft")
    row = splits.train[0]
    assert tok.decode([t for t, l in zip(row["input_ids"], row["labels"]) if l != IGNORE_INDEX]) == " yes<|endoftext|>"


def test_dpo_needs_preference_records(write_jsonl, spec, tok):
    path = write_jsonl([{"text": "a"}])
    with pytest.raises(DataError) as err:
        build_datasets([spec(path)], tok, seq_len=64, objective="dpo")
    assert err.value.message == (f"objective dpo needs preference records (prompt, chosen, rejected); {path} has "
                                 "format text")
