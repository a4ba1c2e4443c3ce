"""The per-rank memory of context parallelism: Ulysses' exchange buffers and the longest row
over N cards (predicted, Llama-3.1-8B QLoRA r=32, the figures of docs/long_context.md)."""
import pytest

from maximus.memory.context_exchange import exchange_bytes_per_token
from maximus.memory.context_parallel import fewest_cards, longest_context_over_ranks, longest_over_cards
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
    from maximus.config import GPU_CARDS

    budget = GPU_CARDS["H100"][0]  # an 80 GB card as the card table has it (79 GiB)
    one = longest_context_over_ranks(EIGHT_B, budget, 1, method="qlora", lora_r=32)
    assert one == max_seq_len_for_budget(EIGHT_B, budget, method="qlora", lora_r=32) >= 500_000
    two, eight = (longest_context_over_ranks(EIGHT_B, budget, n, method="qlora", lora_r=32) for n in (2, 8))
    assert two % 4 == 0 and eight % 16 == 0
    assert one < two < eight and eight >= 4_000_000
    # 80e9 bytes exactly: the margin covers the exchange buffers too, and the row falls just short
    assert 3_900_000 < longest_context_over_ranks(EIGHT_B, resolve_budget("80GB"), 8, method="qlora",
                                                  lora_r=32) < 4_000_000
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


def _llama_8b_spec(world_size: int, seq_len: int, degree):
    from maximus.memory.run_spec import RunSpec
    from maximus.memory.shape import model_shape

    return RunSpec(shape=model_shape(EIGHT_B), world_size=world_size).searching(
        method="qlora", batch_size=world_size, seq_len=seq_len, context_parallel=degree)


def test_auto_picks_the_fewest_processes_whose_share_fits_and_agrees_with_the_longest_row():
    from maximus.config import GPU_CARDS
    from maximus.memory.planner import plan_for_budget

    budget = GPU_CARDS["H100"][0]
    longest = longest_over_cards(EIGHT_B, budget, 8, method="qlora", lora_r=16)
    seq_len = longest[2] // 16 * 16 + 16  # just past two cards' longest row: four are the fewest
    plan = plan_for_budget(_llama_8b_spec(8, seq_len, "auto"), budget)
    assert plan.context_parallel == fewest_cards(longest, seq_len) == 4
    assert plan.world_size == 2 and plan.effective_batch == 8 and plan.peak_bytes <= budget * 0.9
    assert f"context parallel 4" in plan.summary()
    assert plan.to_dict()["context_parallel"] == 4
    short = plan_for_budget(_llama_8b_spec(8, 4096, "auto"), budget)
    assert short.context_parallel == 1 and short.world_size == 8  # one card holds it: the batch splits


def test_a_split_estimate_is_one_ranks_share_plus_the_exchange_buffers():
    from maximus.memory.estimate import estimate_step
    from maximus.memory.run_spec import Candidate

    spec = _llama_8b_spec(1, 65536, 1)
    cand = Candidate(method="qlora", seq_len=65536, checkpointing="full")
    split = estimate_step(spec, __import__("dataclasses").replace(cand, context_parallel=4))
    local = estimate_step(spec, __import__("dataclasses").replace(cand, seq_len=16384))
    buffers = exchange_bytes_per_token(spec.shape, 4) * 16384
    assert split.peak_bytes == local.peak_bytes + buffers
    assert split.breakdown["activations"] == local.breakdown["activations"] + buffers


def test_bad_splits_are_one_line_naming_the_key_and_value():
    import pytest

    from maximus.errors import BudgetError, ConfigError
    from maximus.memory.planner import plan_for_budget

    with pytest.raises(ConfigError) as bad_row:
        plan_for_budget(_llama_8b_spec(1, 1000, 16), resolve_budget("80GB"))
    assert bad_row.value.one_line() == ("training.seq_len 1000 cannot be split evenly over training.context_parallel "
                                        "16 ranks (it must be a multiple of 32 tokens) (hint: use a training.seq_len "
                                        "divisible by 32)")
    with pytest.raises(BudgetError) as none_fits:
        plan_for_budget(_llama_8b_spec(2, 1 << 22, "auto"), resolve_budget("24GB"))
    assert none_fits.value.one_line() == (
        "training.context_parallel auto: no split of rows of 4,194,304 tokens over 1 / 2 of the 2 processes fits "
        "22.35 GiB per process (hint: launch more processes (torchrun --nproc_per_node), raise "
        "optimization.target_vram, or lower training.seq_len)")


def test_fsdp_under_a_split_shards_over_the_whole_world():
    """FSDP2 shards over every process, the ranks that share rows included (the trainer's 2-D mesh
    flattened): a rank of 2 batch shares x 2 row shares holds the weights, gradients and optimizer
    state of a 4-way shard, and the activations of its half rows plus the exchange buffers."""
    from dataclasses import replace

    from maximus.memory.estimate import estimate_step
    from maximus.memory.run_spec import Candidate, RunSpec
    from maximus.memory.shape import model_shape

    spec = RunSpec(shape=model_shape(EIGHT_B), world_size=2).searching(method="lora", seq_len=8192)
    cand = Candidate(method="lora", seq_len=8192, checkpointing="full", sharded=True)
    split = estimate_step(spec, replace(cand, context_parallel=2))
    four_way = estimate_step(replace(spec, world_size=4), replace(cand, seq_len=4096))
    two_way = estimate_step(spec, replace(cand, seq_len=4096))
    for term in ("weights", "gradients", "optimizer"):
        assert split.breakdown[term] == four_way.breakdown[term] < two_way.breakdown[term], term
    buffers = exchange_bytes_per_token(spec.shape, 2) * 4096
    assert split.breakdown["activations"] == four_way.breakdown["activations"] + buffers
    assert split.peak_bytes == four_way.peak_bytes + buffers
    unsharded = estimate_step(spec, replace(cand, context_parallel=2, sharded=False))
    assert unsharded.breakdown["weights"] == estimate_step(spec, replace(cand, seq_len=4096, sharded=False)).breakdown["weights"]


def test_the_run_plans_fsdp_over_every_process_when_one_group_splits_each_row():
    """`training.distributed: fsdp` with `context_parallel` equal to the number of processes (one
    batch share): the plan is FSDP2 over the 4 processes, its weights and optimizer state those
    of FSDP2 over 4 batch ranks, not one whole model per rank; under DDP the plan says ddp."""
    from maximus import Config
    from maximus.memory.spec_from_config import plan_run

    def plan(distributed: str, degree: int, processes: int):
        cfg = Config.from_dict({"model": EIGHT_B, "dataset": "d.jsonl", "method": "lora",
                                "optimization": {"target_vram": "80GB"},
                                "training": {"seq_len": 65536, "batch_size": 4, "context_parallel": degree,
                                             "distributed": distributed}})
        return plan_run(cfg, device="cuda", world_size=processes // degree)

    split, ddp, batch = plan("fsdp", 4, 4), plan("ddp", 4, 4), plan("fsdp", 1, 4)
    assert (split.strategy, split.world_size, split.context_parallel) == ("fsdp", 1, 4)
    assert (ddp.strategy, batch.strategy) == ("ddp", "fsdp")
    for term in ("weights", "optimizer"):
        assert split.breakdown[term] == batch.breakdown[term] < ddp.breakdown[term] / 2, term


def test_fsdp2_under_the_split_shards_the_state_so_full_fine_tuning_holds_longer_rows():
    """Full fine-tuning of Llama-3.1-8B on 80 GB cards: FSDP2 over the ranks that share the rows
    leaves each rank 1/N of the weights, gradients and AdamW state; the longest sharded row is the
    last one a sharded plan holds at that degree (16 tokens more: none)."""
    from maximus.config import GPU_CARDS
    from maximus.memory.planner import fits_at, spec_of

    budget = GPU_CARDS["H100"][0]
    kw = dict(method="full")
    ddp, fsdp = (longest_context_over_ranks(EIGHT_B, budget, 8, sharded=s, **kw) for s in (False, True))
    assert fsdp > 2 * ddp and fsdp % 16 == 0
    spec = spec_of(EIGHT_B, kw, method="qlora").searching(context_parallel=8, sharded=True, offload_optimizer="off")
    assert spec == spec_of(EIGHT_B, kw, method="qlora").searching(context_parallel=8).strategy(sharded=True)
    fits = fits_at(spec, budget, 1)
    assert fits(fsdp) and not fits(fsdp + 16)
    # both offered: the longer counts; one card is never sharded
    both = longest_over_cards(EIGHT_B, budget, 8, lambda cards: (False, True), **kw)
    assert both[8] == fsdp and both[1] == longest_context_over_ranks(EIGHT_B, budget, 1, **kw)
    assert longest_over_cards(EIGHT_B, budget, 8, **kw)[8] == ddp  # DDP unless told otherwise


@pytest.mark.parametrize("distributed", ["auto", "fsdp", "ddp"])
def test_plan_gpus_counts_the_sharding_the_run_would_take(distributed):
    """`maximus plan --gpus 8` for full fine-tuning: under `fsdp` the cards' longest rows are the
    sharded ones, under `ddp` DDP's, under `auto` the longer of the two."""
    from maximus import Config
    from maximus.config import GPU_CARDS
    from maximus.plan_command import plan_report

    def report(method, distributed):
        cfg = Config.from_dict({"model": EIGHT_B, "dataset": "unused", "method": method,
                                "training": {"seq_len": 2048, "batch_size": 8, "distributed": distributed}})
        return {c["card"]: c["longest_context_over_cards"] for c in plan_report(cfg, gpus=8)["cards"]}

    budget = GPU_CARDS["H100"][0]
    h100 = report("full", distributed)["H100"]
    ddp = {n: longest_context_over_ranks(EIGHT_B, budget, n, method="full") for n in (1, 2, 4, 8)}
    fsdp = {n: longest_context_over_ranks(EIGHT_B, budget, n, method="full", sharded=n > 1) for n in (1, 2, 4, 8)}
    expected = {"ddp": ddp, "fsdp": fsdp, "auto": {n: max(ddp[n], fsdp[n]) for n in ddp}}[distributed]
    assert h100 == expected
    if distributed == "auto":
        assert h100[2] == ddp[2] > fsdp[2] and h100[8] == fsdp[8] > ddp[8]  # offloaded AdamW wins at 2 cards
