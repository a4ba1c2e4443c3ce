"""Smart Memory offload: activation offload path, host-side AdamW, optimizer factory (CPU, real libraries)."""
from __future__ import annotations

import copy as copy_module
import json

import bitsandbytes as bnb
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from maximus.errors import ConfigError
from maximus.memory.checkpointing import apply_checkpointing
from maximus.structure import find_decoder_layers
from maximus.memory.offload import ActivationOffloader, FrozenWeightStreamer, OffloadedAdamW, build_optimizer

SHAPES = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_lora():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1))
    model.train()
    return model


IDS = torch.randint(0, SHAPES["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))


def forward(model):
    torch.manual_seed(2)
    return model(input_ids=IDS, labels=IDS, use_cache=False).loss


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def reference():
    model = tiny_lora()
    loss = forward(model)
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("policy", ["full", "selective", ["full", "none", "selective"]])
def test_activation_offload_is_exact_and_counts_the_layer_inputs(policy, reference):
    model = tiny_lora()
    offloader = ActivationOffloader()
    report = apply_checkpointing(model, policy, micro_batch=2, seq_len=32, offload_activations=True, offloader=offloader)
    checkpointed = sum(m != "none" for m in report.modes)
    loss = forward(model)
    # Between forward and backward the device storage of every offloaded input is released.
    assert [e.tensor_ref().untyped_storage().nbytes() for e in offloader._entries] == [0] * checkpointed
    assert offloader.stats.offloaded_tensors == checkpointed
    assert offloader.stats.offloaded_bytes == checkpointed * 2 * 32 * 256 * 4
    loss.backward()
    torch.testing.assert_close(loss.detach(), reference[0], rtol=0, atol=0)
    ours = grads(model)
    for name, grad in reference[1].items():
        torch.testing.assert_close(ours[name], grad, rtol=0, atol=0, msg=name)
    # Each input came back once; all but the first one backward meets were prefetched a layer ahead.
    assert offloader.stats.restored_tensors == checkpointed
    assert offloader.stats.prefetched_tensors == checkpointed - 1
    assert offloader._entries == []


def test_forward_without_backward_does_not_leak_and_next_step_is_exact(reference):
    model = tiny_lora()
    offloader = ActivationOffloader()
    apply_checkpointing(model, "full", micro_batch=2, seq_len=32, offload_activations=True, offloader=offloader)
    forward(model)  # graph dropped: its three host copies must be released by the next forward
    loss = forward(model)
    assert len(offloader._entries) == 3
    loss.backward()
    torch.testing.assert_close(loss.detach(), reference[0], rtol=0, atol=0)
    assert offloader.stats.offloaded_tensors == 6 and offloader.stats.restored_tensors == 3
    assert offloader._entries == []


def test_offload_reported_as_free_device_memory():
    model = tiny_lora()
    plain = apply_checkpointing(model, "full", micro_batch=2, seq_len=32)
    offloaded = apply_checkpointing(model, "full", micro_batch=2, seq_len=32, offload_activations=True)
    assert plain.total_saved_bytes > 3 * 2 * 32 * 256 * 4  # the layer inputs (+ RoPE tables)
    assert offloaded.total_saved_bytes == plain.total_saved_bytes - sum(c.saved_bytes["full"] for c in plain.layer_costs)
    assert all(layer._maximus_offloader is not None for layer in find_decoder_layers(model)[1])


# ---------------------------------------------------------------------------------------------
# Optimizer state offload


def params_and_grads(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(64, 16, generator=gen).to(dtype)),
              torch.nn.Parameter(torch.randn(16, generator=gen).to(dtype)),
              torch.nn.Parameter(torch.randn(8, generator=gen).to(dtype))]
    return params, gen


def run_steps(optimizer, params, gen, steps=4, skip_last_grad=False):
    for step in range(steps):
        optimizer.zero_grad()
        for k, p in enumerate(params):
            if skip_last_grad and k == len(params) - 1 and step % 2:
                continue
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        optimizer.step()


def test_offloaded_adamw_matches_torch_adamw_bitwise():
    ours, gen_a = params_and_grads(0)
    theirs, gen_b = params_and_grads(0)
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]
    opt = OffloadedAdamW(groups(ours), lr=1e-2, betas=(0.8, 0.95))
    ref = torch.optim.AdamW(groups(theirs), lr=1e-2, betas=(0.8, 0.95), foreach=False)
    run_steps(opt, ours, gen_a, skip_last_grad=True)
    run_steps(ref, theirs, gen_b, skip_last_grad=True)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The state lives in separate host tensors, and the checkpoint format is torch AdamW's.
    state = opt.state_dict()
    assert state["state"].keys() == ref.state_dict()["state"].keys() == {0, 1, 2}
    assert all(opt.state[m]["exp_avg"].data_ptr() != p.data_ptr() for p, m in opt._pairs)
    torch.testing.assert_close(state["state"][1]["exp_avg_sq"], ref.state_dict()["state"][1]["exp_avg_sq"], rtol=0, atol=0)


def test_offloaded_adamw_state_resumes_into_plain_adamw_and_back():
    ours, gen = params_and_grads(1)
    opt = OffloadedAdamW(ours, lr=1e-2)
    run_steps(opt, ours, gen, steps=2)
    copy = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    plain = torch.optim.AdamW(copy, lr=1e-2, foreach=False)
    plain.load_state_dict(copy_module.deepcopy(opt.state_dict()))  # load_state_dict may share tensors
    again = OffloadedAdamW(ours, lr=1e-2)
    again.load_state_dict(copy_module.deepcopy(opt.state_dict()))
    for optimizer, ps in ((again, ours), (plain, copy)):
        for p in ps:
            p.grad = torch.full_like(p, 0.5)
        optimizer.step()
    for a, b in zip(ours, copy):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_offloaded_adamw_keeps_fp32_master_for_bf16_params():
    params, gen = params_and_grads(2, torch.bfloat16)
    opt = OffloadedAdamW(params, lr=1e-4)
    master = opt._pairs[0][1]
    before = master.clone()
    run_steps(opt, params, gen, steps=3)
    assert master.dtype == torch.float32 and params[0].dtype == torch.bfloat16
    # Updates of 1e-4 vanish in bf16 (8 bits of mantissa) but accumulate in the fp32 master.
    assert (master - before).abs().max() > 2e-4
    torch.testing.assert_close(params[0], master.to(torch.bfloat16), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The factory


def test_build_optimizer_names():
    def build(name, offload):
        p = torch.nn.Parameter(torch.zeros(4096))
        return build_optimizer([p], name, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, offload=offload)

    assert type(build("adamw", False)) is torch.optim.AdamW
    assert type(build("adamw", True)) is OffloadedAdamW
    assert type(build("adamw_8bit", False)) is bnb.optim.AdamW8bit
    assert type(build("adamw_8bit", True)) is bnb.optim.PagedAdamW8bit
    assert type(build("paged_adamw_8bit", False)) is bnb.optim.PagedAdamW8bit
    opt = build("adamw", False)
    assert opt.defaults["betas"] == (0.9, 0.99) and opt.defaults["lr"] == 1e-3
    with pytest.raises(ConfigError) as info:
        build("adamw8bit", False)
    assert str(info.value) == "training.optimizer: unknown optimizer 'adamw8bit' (hint: did you mean 'adamw_8bit'?)"


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit"])
def test_bitsandbytes_8bit_adamw_steps_on_cpu_like_adamw(name):
    # AdamW's first step moves every weight by lr * g / (|g| + eps) (bias-corrected): 8-bit moments agree.
    gen = torch.Generator().manual_seed(3)
    ours = torch.nn.Parameter(torch.randn(8192, generator=gen))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt = build_optimizer([ours], name, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, offload=False)
    ref = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.0)
    for step in range(3):
        g = torch.randn(8192, generator=gen)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert opt.state[ours]["state1"].dtype == torch.uint8
    assert (ours - theirs).abs().max() < 2e-3 and (ours - theirs).abs().mean() < 2e-4


# ---------------------------------------------------------------------------------------------
# Frozen-weight streaming


@pytest.mark.parametrize("policy", ["off", "full"])
def test_frozen_weight_streaming_is_exact_and_releases_weights(policy, reference):
    model = tiny_lora()
    apply_checkpointing(model, policy, micro_batch=2, seq_len=32)
    layers = find_decoder_layers(model)[1]
    q_base = [layer.self_attn.q_proj.base_layer.weight for layer in layers]
    streamer = FrozenWeightStreamer(model)
    assert [w.untyped_storage().nbytes() for w in q_base] == [0, 0, 0]
    loss = forward(model)
    # After forward only the last layer (where backward starts) holds its weights.
    assert [w.untyped_storage().nbytes() > 0 for w in q_base] == [False, False, True]
    loss.backward()
    torch.testing.assert_close(loss.detach(), reference[0], rtol=0, atol=0)
    ours = grads(model)
    for name, grad in reference[1].items():
        torch.testing.assert_close(ours[name], grad, rtol=0, atol=0, msg=name)
    # Forward: layer 0 fetched on demand, 1 and 2 prefetched; backward: 1 and 0 prefetched again.
    assert streamer.stats["fetches"] == 1 and streamer.stats["prefetches"] == 4
    with torch.no_grad():
        model.eval()
        logits = model(input_ids=IDS).logits
    assert [w.untyped_storage().nbytes() for w in q_base] == [0, 0, 0]
    streamer.remove()
    assert all(w.untyped_storage().nbytes() == 256 * 256 * 4 for w in q_base)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, logits, rtol=0, atol=0)


def test_parameter_offload_trains_a_model_loaded_from_safetensors(tiny_llama, pc_data, tmp_path):
    """`offload.params: on` through the real trainer, the model loaded from safetensors in its saved
    dtype: the weights come back memory-mapped, whose storage cannot be resized, and the streamer must
    still release and restore them. Same losses as the run without the streamer."""
    from maximus import Config, Trainer
    from tiny import tiny_config

    losses = {}
    for mode in ("off", "on"):
        cfg = tiny_config(tiny_llama, pc_data, tmp_path / mode, optimization={"offload": {"params": mode}},
                          eval={"enabled": False})
        Trainer(Config.from_dict(cfg)).train()
        rows = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        losses[mode] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses["on"]) == 4
    assert losses["on"] == pytest.approx(losses["off"], abs=1e-6)
