"""The planner's model of GRPO generation: the KV cache against the one Transformers really
allocates, the backward's rows, and the budget check."""
import pytest
import torch

import maximus
from maximus.errors import BudgetError
from maximus.memory.generation import (check_generation, generation_peak_bytes, kv_cache_bytes, merged_weight_bytes,
                                       rollout_rows)
from maximus.memory.planner import plan_for_budget
from maximus.memory.spec_from_config import grpo_settings
from tiny import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("grpo_mem") / "model", kv_heads=2, layers=2, hidden=64)


def test_kv_cache_bytes_equal_the_cache_transformers_allocates_for_a_group(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    group, prompt, new = 5, 7, 9
    ids = torch.randint(3, 200, (1, prompt)).repeat(group, 1)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, return_dict_in_generate=True, use_cache=True, pad_token_id=0)
    cache = out.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    # The cache holds every position but the last generated token's (it is never fed back).
    assert held == kv_cache_bytes(model.config, sequences=group, tokens=prompt + new - 1, dtype_bytes=4)


def test_rollout_rows_and_the_generation_budget_check(model_dir, tmp_path):
    cfg = maximus.Config.from_dict({"model": str(model_dir), "dataset": "unused.jsonl", "objective": "grpo",
                                    "training": {"batch_size": 3, "seq_len": 100},
                                    "grpo": {"group_size": 64, "max_completion_tokens": 4000, "rewards": ["exact_answer"]}})
    assert rollout_rows(grpo_settings(cfg)) == (3 * 64, 4100)
    assert rollout_rows(grpo_settings(cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"steps_per_generation": 4})}))) == (48, 4100)
    plan = plan_for_budget(model_dir, None, batch_size=8, seq_len=128, micro_batch_size=1, dtype="fp32", device="cpu")
    parts = check_generation(model_dir, plan, grpo_settings(cfg), budget=None)
    resident = plan.breakdown["weights"] + plan.breakdown["adapters"] + plan.breakdown["optimizer"]
    # No budget: all 3 prompts x 64 completions in one decode loop, LoRA merged into a float32
    # copy of the projections for sampling (merged_weight_bytes: every q/k/v/o/gate/up/down weight).
    merged = merged_weight_bytes(model_dir)
    plain = generation_peak_bytes(model_dir, resident_bytes=resident, group_size=64, tokens=4100, dtype_bytes=4, prompts=3)
    assert parts == {**plain, "prompts_at_once": 3, "merge_lora": True, "merged_weights": merged,
                     "total": plain["total"] + merged}
    from transformers import AutoModelForCausalLM

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert merged == sum(4 * p.numel() for n, p in model.named_parameters() if n.split(".")[-2] in names)
    one = 2 * 2 * 2 * 16 * 64 * 4100 * 4  # layers x kv heads x head_dim x tokens, K and V, for one group
    assert parts["kv_cache"] == 3 * one
    # One [rows, V] float32 logits tensor at a time (tests/train/test_grpo_sampling.py measures it)
    assert parts["logits"] == 3 * 64 * 300 * 4 and plain["total"] == resident + parts["kv_cache"] + parts["logits"]
    # A budget between two and three groups' caches: two prompts at once, merged if the copy fits too.
    budget = resident + 2 * one + 2 * 64 * 300 * 4 + 2**20
    assert merged < 2**20
    assert check_generation(model_dir, plan, grpo_settings(cfg), budget=budget)["prompts_at_once"] == 2
    assert check_generation(model_dir, plan, grpo_settings(cfg), budget=budget)["merge_lora"]
    tight = resident + 3 * one + 3 * 64 * 300 * 4  # all three groups exactly: no room for the copy
    assert check_generation(model_dir, plan, grpo_settings(cfg), budget=tight) == {**plain, "prompts_at_once": 3, "merge_lora": False}
    with pytest.raises(BudgetError, match=r"^GRPO generation needs about 129.\d\d MiB \(KV cache 128.12 MiB for 64 x 4100 "
                                          r"tokens, on top of .* of weights and optimizer state\), over the budget of "
                                          r"32.00 MiB \(hint: lower grpo.group_size"):
        check_generation(model_dir, plan, grpo_settings(cfg), budget=32 * 2**20)
