"""The planner plans for the rows the data really has (`maximus.memory.lengths`,
`maximus.train.order`): the largest micro-batch the loader forms, the longer side of a DPO pair,
a GRPO prompt plus max_completion_tokens; seq_len stays the cap."""
import json
from pathlib import Path

import pytest

from maximus import Config, Trainer
from maximus.errors import DataError
from maximus.memory import plan_run
from maximus.memory.lengths import RowLengths
from maximus.train.order import RowOrder, read_lengths, row_length, run_lengths

from tiny import build_tiny_model_dir, one_thread, tiny_config, write_prompt_completion  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")
REWARDS = Path(__file__).parents[1] / "train" / "grpo_test_rewards.py"


def _pairs(path, n=24):
    words = "red green blue gold stone river cloud tiger".split()
    with open(path, "w") as f:
        for i in range(n):
            w = words[i % 8:] + words[:i % 8]
            f.write(json.dumps({"prompt": f"Sort: {' '.join(w[:3])}\nAnswer:", "chosen": " " + " ".join(sorted(w[:3])),
                                "rejected": " " + " ".join(w[:2 + i % 3])}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("data_plan")
    return build_tiny_model_dir(root / "model"), root


def test_the_largest_micro_batch_follows_padding_and_flattening():
    steps = ((3, 9, 2, 2), (5, 5, 5, 1))
    padded = RowLengths(steps=steps, cap=16)
    assert padded.longest == 9
    # micro-batches of 2 in loader order: (3,9) -> 18 padded tokens, the largest
    assert (padded.largest_micro_batch(2).tokens, padded.largest_micro_batch(2).longest) == (18, 9)
    assert padded.largest_micro_batch(4).tokens == 36 and padded.largest_micro_batch(1).tokens == 9
    flat = RowLengths(steps=steps, cap=16, flatten=lambda rows, tokens: True)
    assert flat.largest_micro_batch(4).tokens == 16 and flat.largest_micro_batch(2).tokens == 12  # 3+9 / 5+5+5+1
    assert flat.largest_micro_batch(2).row_tokens == 6


def test_run_lengths_walk_the_trainers_sampler(tiny):
    model, root = tiny
    data = write_prompt_completion(root / "sft.jsonl", n=20)
    cfg = Config.from_dict(tiny_config(model, data, root / "out", training={"packing": False, "max_steps": 7,
                                                                            "batch_size": 4}))
    from maximus.data import build_run_datasets
    from maximus.models import load_tokenizer

    rows = build_run_datasets(cfg, load_tokenizer(cfg)).train
    lengths = run_lengths(cfg, rows, steps=7, world_size=2)
    order = RowOrder(len(rows), 4, cfg.training.seed)
    expected = []
    for step in range(1, 8):  # 7 steps cross an epoch boundary of the 18 training rows
        step_rows = [len(rows[i]["input_ids"]) for i in order.step(step)]
        expected += [tuple(step_rows[:2]), tuple(step_rows[2:])]
    assert lengths.steps == tuple(expected)
    assert lengths.flatten is not None  # unpacked SFT rows go in unpadded under padding-free attention
    assert read_lengths(cfg, world_size=2).steps == lengths.steps


def test_run_lengths_count_the_documents_of_packed_rows_by_transformers_rule(tiny):
    import torch
    from transformers.masking_utils import find_packed_sequence_indices

    from maximus.data import build_run_datasets
    from maximus.models import load_tokenizer

    model, root = tiny
    data = write_prompt_completion(root / "sft.jsonl", n=20)
    cfg = Config.from_dict(tiny_config(model, data, root / "out-packed",
                                       training={"packing": True, "seq_len": 128, "max_steps": 2, "batch_size": 4}))
    rows = build_run_datasets(cfg, load_tokenizer(cfg)).train
    order = RowOrder(len(rows), 4, cfg.training.seed)

    def documents(row):
        seq = find_packed_sequence_indices(torch.tensor([row["position_ids"]]))
        return 1 if seq is None else int(seq.max()) + 1

    expected = tuple(tuple(documents(rows[i]) for i in order.step(step)) for step in (1, 2))
    assert run_lengths(cfg, rows, steps=2).documents == expected
    assert max(max(step) for step in expected) > 1  # rows hold several documents


def test_dpo_is_planned_for_the_pairs_as_they_are_and_run_json_records_it(tiny, tmp_path):
    model, root = tiny
    data = _pairs(tmp_path / "pairs.jsonl")
    run = tiny_config(model, data, tmp_path / "out", objective="dpo",
                      dataset={"path": str(data), "format": "preference"},
                      training={"seq_len": 256, "batch_size": 4, "micro_batch_size": 4, "max_steps": 2},
                      eval={"enabled": False})
    cfg = Config.from_dict(run)
    lengths = read_lengths(cfg)
    longest = lengths.longest
    assert 8 < longest < 40  # short pairs, far below the cap
    plan = plan_run(cfg, device="cpu", lengths=lengths)
    assert plan.rows_tokens_max == longest and plan.seq_len == lengths.largest_micro_batch(4).row_tokens
    assert plan.micro_batch_tokens_max == lengths.largest_micro_batch(4).tokens
    at_cap = plan_run(cfg, device="cpu")
    assert at_cap.rows_tokens_max is None and at_cap.seq_len == 256 and plan.peak_bytes < at_cap.peak_bytes
    # padded pairs: the same as planning rows of the longest pair's length
    assert plan.seq_len == longest
    short = Config.from_dict(dict(run, training={**run["training"], "seq_len": longest}))
    assert plan.peak_bytes == plan_run(short, device="cpu").peak_bytes
    assert f"planned for the data's rows: the longest has {longest:,} tokens (training.seq_len 256 is the cap)" \
        in plan.text()

    Trainer(cfg).train()
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    assert summary["plan"]["rows_tokens_max"] == longest
    assert summary["plan"]["micro_batch_tokens_max"] == plan.micro_batch_tokens_max
    measured, predicted = summary["memory"]["peak_bytes"], summary["plan"]["peak_bytes"]
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


def test_grpo_plans_the_longest_prompt_plus_the_completion(tiny, tmp_path):
    model, root = tiny
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "count " + "x " * n}) + "\n" for n in (1, 2, 3, 9)))
    cfg = Config.from_dict(tiny_config(model, data, tmp_path / "out", objective="grpo",
                                       dataset={"path": str(data), "format": "prompt"},
                                       grpo={"group_size": 2, "max_completion_tokens": 12,
                                             "rewards": ["length"]},
                                       training={"seq_len": 128, "batch_size": 2, "micro_batch_size": 2},
                                       eval={"enabled": False}))
    lengths = read_lengths(cfg)
    from maximus.data import build_run_datasets
    from maximus.models import load_tokenizer

    prompts = build_run_datasets(cfg, load_tokenizer(cfg)).train
    assert lengths.longest == max(row_length(r) for r in prompts) + 12
    plan = plan_run(cfg, device="cpu", lengths=lengths)
    assert plan.rows_tokens_max == lengths.longest < 128 + 12
    # Both prompts of a step sampled at once (the batched sampler): K,V x layers x kv x dim x prompts x group
    assert plan.generation["prompts_at_once"] == 2
    assert plan.generation["kv_cache"] == 2 * 2 * 2 * 16 * 2 * 2 * lengths.longest * 4


def test_a_grpo_runs_measured_peak_is_its_prediction_with_the_head_over_the_completions(tmp_path):
    """A vocabulary large enough for the head to matter (8,192 x hidden 64): GRPO's log-prob pass
    runs the head over the completion tokens only, and so does the estimate; charging it for
    every prompt + completion position (the former term) over-predicts by more than 10 %."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer
    from maximus.memory.estimate import estimate_peak
    from tiny import save_random_model

    tok = build_tiny_tokenizer(vocab_size=300)
    model = save_random_model(tmp_path / "model", LlamaForCausalLM, LlamaConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None), tok)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "count " + "x " * n}) + "\n" for n in (20, 24, 28, 30)))
    cfg = Config.from_dict(tiny_config(model, data, tmp_path / "out", objective="grpo",
                                       dataset={"path": str(data), "format": "prompt"},
                                       grpo={"group_size": 4, "max_completion_tokens": 8,
                                             "rewards": [f"{REWARDS}:word_count"]},
                                       training={"batch_size": 2, "micro_batch_size": 8, "max_steps": 1,
                                                 "memory_meter": "every_step"}, eval={"enabled": False}))
    Trainer(cfg).train()
    summary = json.loads((tmp_path / "out" / "run.json").read_text())
    measured, plan = summary["memory"]["peak_bytes"], summary["plan"]
    assert abs(plan["peak_bytes"] / measured - 1) < 0.10, (plan["peak_bytes"], measured)
    every_position = estimate_peak(model, method="lora", dtype="fp32", micro_batch=8, seq_len=plan["seq_len"],
                                   lora_r=4, device="cpu", lean_lora=True, objective="grpo", completion_tokens=None)
    assert every_position.peak_bytes / measured - 1 > 0.10, (every_position.peak_bytes, measured)


def test_rows_all_cut_to_seq_len_give_one_note(tiny, tmp_path):
    model, root = tiny
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": "red green blue gold stone river cloud tiger " * 2}) + "\n"
                            for _ in range(6)))
    cfg = Config.from_dict(tiny_config(model, data, tmp_path / "out", dataset={"path": str(data), "format": "text"},
                                       training={"seq_len": 8, "packing": False}, eval={"enabled": False}))
    plan = plan_run(cfg, device="cpu", lengths=read_lengths(cfg))
    cut = [n for n in plan.notes if "was cut to it" in n]
    assert cut == ["every training row reached training.seq_len (8 tokens) and was cut to it: the plan assumes "
                   "rows of 8 tokens"]


def test_an_empty_dataset_names_its_file(tiny, tmp_path):
    model, root = tiny
    # every prompt is longer than seq_len: cut to it, no row keeps a token of its answer
    data = write_prompt_completion(tmp_path / "nothing.jsonl", n=6)
    cfg = Config.from_dict(tiny_config(model, data, tmp_path / "out", training={"seq_len": 8, "packing": False},
                                       eval={"enabled": False}))
    with pytest.raises(DataError) as err:
        read_lengths(cfg)
    assert err.value.message.startswith(f"dataset is empty after filtering: {data}")


def test_many_short_documents_mark_the_micro_batch_masked():
    """Padding-free attention's rule, as the planner reads it: a padded micro-batch whose rows hold
    more than 32 documents averaging under 64 tokens goes through one masked SDPA call (padding is
    one more document per shorter row); fewer or longer documents are attended one by one."""
    from maximus.attention.varlen import per_document

    steps = ((128,) * 8,)
    packed = RowLengths(steps=steps, cap=128, documents=((5,) * 8,), per_document=per_document)
    assert packed.largest_micro_batch(8).masked and not packed.largest_micro_batch(4).masked  # 40 / 20 documents
    assert packed.token_split(1024).largest.masked and not packed.token_split(512).largest.masked
    one_each = RowLengths(steps=steps, cap=128, documents=((1,) * 8,), per_document=per_document)
    assert not one_each.largest_micro_batch(8).masked  # nothing packed: plain causal SDPA
    padded = RowLengths(steps=((16, 20) * 20,), cap=128, per_document=per_document)
    assert padded.largest_micro_batch(40).masked  # 40 rows + 20 padding documents of 20 tokens
    assert not RowLengths(steps=steps, cap=128, documents=((5,) * 8,)).largest_micro_batch(8).masked  # no rule
