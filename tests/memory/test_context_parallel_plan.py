"""The per-rank memory of context parallelism: Ulysses' exchange buffers and the longest row
over N cards (predicted, Llama-3.1-8B QLoRA r=32, the figures of docs/long_context.md)."""
from maximus.memory.context_parallel import (exchange_bytes_per_token, fewest_cards, longest_context_over_ranks,
                                             longest_over_cards)
from maximus.memory.shape import load_model_config
from maximus.memory.planner import max_seq_len_for_budget, resolve_budget

EIGHT_B = "meta-llama/Llama-3.1-8B"


def test_exchange_buffers_count_the_kept_qkv_and_four_output_copies():
    shape = load_model_config(EIGHT_B)  # 32 query heads, 8 key-value heads of 128, bf16
    assert exchange_bytes_per_token(shape, 1) == 0
    assert exchange_bytes_per_token(shape, 8) == 2 * 128 * ((32 + 2 * 8) + 4 * 32)
    # 16 ranks: 8 key-value heads do not divide, they travel repeated to 32
    assert exchange_bytes_per_token(shape, 16) == 2 * 128 * ((32 + 2 * 32) + 4 * 32)


def test_longest_row_over_cards_is_predicted_past_four_million_on_eight_80gb_cards():
    budget = resolve_budget("80GB")
    one = longest_context_over_ranks(EIGHT_B, budget, 1, method="qlora", lora_r=32)
    assert one == max_seq_len_for_budget(EIGHT_B, budget, method="qlora", lora_r=32) >= 500_000
    two, eight = (longest_context_over_ranks(EIGHT_B, budget, n, method="qlora", lora_r=32) for n in (2, 8))
    assert two % 4 == 0 and eight % 16 == 0
    assert one < two < eight and eight >= 4_000_000
    # the buffers cost: 8 cards hold less than 8 times one card's row
    assert eight < 8 * one


def test_the_degree_a_row_needs_is_the_fewest_cards_that_hold_it():
    from maximus.config import GPU_CARDS

    h100 = longest_over_cards(EIGHT_B, GPU_CARDS["H100"][0], 2, method="qlora", lora_r=32)
    assert list(h100) == [1, 2] and h100[1] < 1_000_000 <= h100[2]  # one H100 is short of 1M tokens, two are not
    assert fewest_cards(h100, 1_000_000) == 2 and fewest_cards(h100, 1000) == 1
    assert fewest_cards(h100, 10 ** 8) is None


def test_a_rank_of_four_is_predicted_under_a_third_of_one_process_activations_at_4096_tokens():
    """The benchmark model of docs/distributed.md (benchmarks/context_parallel.py), LoRA r=16, fp32."""
    from transformers import LlamaConfig

    from maximus.memory.context_parallel import rank_activation_bytes
    from maximus.memory.estimate import estimate_peak

    shape = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)
    kw = dict(method="lora", lora_r=16, checkpointing="off", dtype="fp32", device="cpu")
    one = rank_activation_bytes(shape, 4096, 1, dtype_bytes=4, **kw)
    four = rank_activation_bytes(shape, 4096, 4, dtype_bytes=4, **kw)
    assert one == estimate_peak(shape, seq_len=4096, **kw).breakdown["activations"]
    buffers = exchange_bytes_per_token(shape, 4, 4) * 1024  # fp32 copies of 1,024 local tokens
    assert four == estimate_peak(shape, seq_len=1024, **kw).breakdown["activations"] + buffers
    assert four < 0.35 * one
