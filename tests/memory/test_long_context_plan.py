"""The estimator and planner model tiled recompute and lean LoRA (issue 17): the lean layer's bytes
are what autograd really saves, the planner tiles only when it must, and the longest context of
Llama-3.1-8B QLoRA r=32 reaches the goals beside Unsloth's figures."""
from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from maximus.errors import BudgetError, ConfigError
from maximus.kernels.lean_lora import install_lean_lora
from maximus.memory.estimate import estimate_peak, lean_layer_bytes_per_token
from maximus.memory.shape import model_shape
from maximus.plan_command import plan_main
from maximus.memory.planner import max_seq_len_for_budget, plan_for_budget, resolve_budget

from tiny import one_thread  # noqa: F401  (a fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")

EIGHT_B = "meta-llama/Llama-3.1-8B"


def _saved_per_token(config: LlamaConfig, dtype: torch.dtype, autocast: bool, tokens: int = 32):
    """(layer, its MLP) bytes per token autograd saves in decoder layer 0 of a lean LoRA r=8 model."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    install_lean_lora(model.train())
    layer = model.base_model.model.model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, where = {}, [None]

    def pack(t):
        s = t.untyped_storage()
        if where[0] and s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), (s.nbytes(), where[0]))
        return t
    layer.register_forward_pre_hook(lambda *a: where.__setitem__(0, "layer"))
    layer.mlp.register_forward_pre_hook(lambda *a: where.__setitem__(0, "mlp"))
    layer.mlp.register_forward_hook(lambda *a: where.__setitem__(0, "layer"))
    layer.register_forward_hook(lambda *a: where.__setitem__(0, None))
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        model(input_ids=ids)
    total = sum(n for n, _ in seen.values()) / tokens
    mlp = sum(n for n, w in seen.values() if w == "mlp") / tokens
    return total, mlp


@pytest.mark.parametrize("dims", [dict(hidden_size=128, intermediate_size=320, num_attention_heads=4,
                                       num_key_value_heads=2),
                                  dict(hidden_size=96, intermediate_size=256, num_attention_heads=6,
                                       num_key_value_heads=3, head_dim=32)])
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)])
def test_lean_layer_bytes_are_what_autograd_saves(dims, dtype, autocast):
    config = LlamaConfig(vocab_size=64, num_hidden_layers=1, **dims)
    measured = _saved_per_token(config, dtype, autocast)
    b = 2 if dtype == torch.bfloat16 else 4
    # the rank-r products are in the adapters' compute dtype: autocast's, else float32
    predicted = lean_layer_bytes_per_token(model_shape(config), b, 8, 7, 3, lora_bytes=b if autocast else 4)
    assert predicted == measured


def test_longest_context_of_the_8b_beats_unsloth_and_the_old_estimate():
    def longest(budget, **kw):
        return max_seq_len_for_budget(EIGHT_B, resolve_budget(budget), method="qlora", lora_r=32, **kw)
    # untiled with PEFT's layers and Transformers' RMSNorm (19,486 and 1,595 when issue 17 was filed;
    # the estimator has been refined since) stays below Unsloth
    before = dict(tile_tokens="off", lean_lora=False, lean_norm=False)
    assert longest("16GB", **before) == 24142
    assert longest("8GB", **before) == 1961
    sixteen, eight = longest("16GB"), longest("8GB")
    assert sixteen >= 60000 and eight >= 3000  # goals; Unsloth: 40,724 and 2,972
    assert (sixteen, eight) == (89718, 6879)
    assert longest("16GB", tile_tokens="off") < sixteen  # tiling is part of it
    # and so is the lean norm: with Transformers' float32 RMSNorm backward the tiled layer's peak is the norm
    assert longest("16GB", lean_norm=False) == 44298 < sixteen


def test_the_planner_tiles_only_when_the_budget_needs_it():
    roomy = plan_for_budget(EIGHT_B, resolve_budget("80GB"), method="qlora", lora_r=32, batch_size=1, seq_len=16384)
    assert roomy.tile_tokens is None
    tight = plan_for_budget(EIGHT_B, resolve_budget("16GB"), method="qlora", lora_r=32, batch_size=1, seq_len=60000)
    assert tight.tile_tokens is not None and set(tight.recompute) == {"full"}
    assert f"runs over {-(-60000 // tight.tile_tokens)} tiles of {tight.tile_tokens} tokens" in tight.notes[-1]
    again = estimate_peak(EIGHT_B, method="qlora", lora_r=32, seq_len=60000, checkpointing="full",
                          offload_activations=tight.offload_activations, offload_optimizer=tight.offload_optimizer,
                          loss_chunk_tokens=tight.loss_chunk_size, tile_tokens=tight.tile_tokens, lean_lora=True)
    assert again.peak_bytes == tight.peak_bytes
    untiled = estimate_peak(EIGHT_B, method="qlora", lora_r=32, seq_len=60000, checkpointing="full",
                            offload_activations=tight.offload_activations, offload_optimizer=tight.offload_optimizer,
                            loss_chunk_tokens=tight.loss_chunk_size, lean_lora=True)
    assert untiled.peak_bytes > resolve_budget("16GB") * 0.9 >= again.peak_bytes
    with pytest.raises(BudgetError):
        plan_for_budget(EIGHT_B, resolve_budget("16GB"), method="qlora", lora_r=32, batch_size=1, seq_len=60000,
                        tile_tokens="off")


def test_a_tile_over_the_micro_batch_is_one_tile_and_noted_and_a_bad_tile_is_an_error():
    plan = plan_for_budget(EIGHT_B, resolve_budget("80GB"), method="qlora", batch_size=2, seq_len=2048,
                           micro_batch_size=2, gradient_checkpointing="full", tile_tokens=8192)
    assert plan.tile_tokens == 8192
    assert "tile_tokens 8192 >= the micro-batch's 4096 tokens: one tile (the MLP runs untiled)" in plan.notes
    untiled = plan_for_budget(EIGHT_B, resolve_budget("80GB"), method="qlora", batch_size=2, seq_len=2048,
                              micro_batch_size=2, gradient_checkpointing="full", tile_tokens="off")
    assert untiled.peak_bytes == plan.peak_bytes
    for bad in (0, -3):
        with pytest.raises(ConfigError) as err:
            plan_for_budget(EIGHT_B, None, method="qlora", tile_tokens=bad)
        assert err.value.one_line() == (f"optimization.tile_tokens must be a positive number of tokens, auto or off, "
                                        f"got {bad} (hint: use e.g. tile_tokens: 4096, or off)")


def test_plan_command_prints_the_longest_context_per_card(capsys):
    assert plan_main(["--model", EIGHT_B, "--method", "qlora", "--lora-r", "32", "--seq", "4096", "--batch", "1",
                      "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_card = {c["card"]: c["longest_context_tokens"] for c in report["cards"]}
    budget = {c["card"]: c["memory_bytes"] for c in report["cards"]}
    for card in ("T4", "A100-80GB"):
        # optimization.offload.params: auto (the default): frozen weights stream where nothing else fits
        assert by_card[card] == max_seq_len_for_budget(EIGHT_B, budget[card], method="qlora", lora_r=32,
                                                       offload_params="auto")
    assert plan_main(["--model", EIGHT_B, "--method", "qlora", "--lora-r", "32", "--seq", "4096", "--batch", "1"]) == 0
    text = capsys.readouterr().out
    assert "longest context: tokens per sequence that fit the card at micro-batch 1" in " ".join(text.split())
    assert f"{by_card['A100-80GB']:,}" in text


def test_a_context_that_fits_no_plan_names_the_longest_that_would():
    with pytest.raises(BudgetError) as err:
        plan_for_budget(EIGHT_B, resolve_budget("16GB"), method="qlora", lora_r=32, batch_size=1, seq_len=100000)
    assert err.value.message.endswith("; the longest sequence that fits is 89,718 tokens at micro-batch 1")
    plan_for_budget(EIGHT_B, resolve_budget("16GB"), method="qlora", lora_r=32, batch_size=1, seq_len=89718)
    # with the user's fixed settings: untiled, the longest is shorter
    with pytest.raises(BudgetError) as err:
        plan_for_budget(EIGHT_B, resolve_budget("16GB"), method="qlora", lora_r=32, batch_size=1, seq_len=100000,
                        tile_tokens="off")
    n = max_seq_len_for_budget(EIGHT_B, resolve_budget("16GB"), method="qlora", lora_r=32, tile_tokens="off")
    assert n < 89718 and err.value.message.endswith(f"; the longest sequence that fits is {n:,} tokens at micro-batch 1")
