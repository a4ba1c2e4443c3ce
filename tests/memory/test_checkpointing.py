"""Gradient Checkpointing 2.0 on tiny random Llama / Mistral / Qwen2 models with real PEFT LoRA."""
from __future__ import annotations

import weakref

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from maximus.errors import BudgetError, ConfigError, ModelError
from maximus.memory.checkpointing import (
    LayerCost,
    apply_checkpointing,
    choose_recompute_modes,
    measure_layer_costs,
    remove_checkpointing,
)
from maximus.structure import find_decoder_layers

# hidden 256 so that `selective` has matmuls worth keeping (inner dimension >= 256).
SHAPES = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
BATCH, SEQ = 2, 32


def tiny_lora(config_cls=LlamaConfig, model_cls=LlamaForCausalLM, dropout=0.1, **extra):
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPES, **extra))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout))
    model.train()
    return model


def batch():
    return torch.randint(0, SHAPES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def loss_and_grads(model):
    ids = batch()
    torch.manual_seed(2)  # same LoRA dropout masks in every run
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(result, reference):
    loss, grads = result
    ref_loss, ref_grads = reference
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 7 * SHAPES["num_hidden_layers"]
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(tiny_lora())


@pytest.mark.parametrize("policy", ["off", "full", "selective", "auto", ["full", "none", "selective"]])
def test_loss_and_every_lora_grad_match_no_checkpointing(policy, reference):
    model = tiny_lora()
    report = apply_checkpointing(model, policy, micro_batch=BATCH, seq_len=SEQ)
    assert len(report.modes) == 3
    assert_same(loss_and_grads(model), reference)


def test_full_matches_transformers_gradient_checkpointing_oracle():
    oracle = tiny_lora()
    oracle.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    expected = loss_and_grads(oracle)
    model = tiny_lora()
    apply_checkpointing(model, "full", micro_batch=BATCH, seq_len=SEQ)
    assert not model.base_model.model.is_gradient_checkpointing  # ours, not Transformers' mechanism
    assert_same(loss_and_grads(model), expected)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def backward_matmuls_and_mlp_calls(policy):
    model = tiny_lora(dropout=0.0)
    apply_checkpointing(model, policy, micro_batch=BATCH, seq_len=SEQ)
    mlp_calls = []
    for layer in find_decoder_layers(model)[1]:
        layer.mlp.register_forward_pre_hook(lambda *a: mlp_calls.append(1))  # the replay stops early, before post-hooks
    ids = batch()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    forward_calls = len(mlp_calls)
    with _CountMatmuls() as counter:
        loss.backward()
    return counter.count, len(mlp_calls) - forward_calls


def test_recompute_happens_and_selective_keeps_the_base_matmuls():
    none_mm, none_replays = backward_matmuls_and_mlp_calls("off")
    full_mm, full_replays = backward_matmuls_and_mlp_calls("full")
    sel_mm, sel_replays = backward_matmuls_and_mlp_calls("selective")
    assert (none_replays, full_replays, sel_replays) == (0, 3, 3)
    # Per layer full replays 7 base + 7 lora_A + 7 lora_B matmuls, selective only the rank-4 lora_B ones;
    # the replay stops as soon as the last saved tensor (down_proj's lora_B input) is rebuilt, one matmul early.
    assert full_mm - none_mm == 3 * (21 - 1)
    assert sel_mm - none_mm == 3 * (7 - 1)


def test_state_dict_keys_and_adapter_save_load_unchanged(tmp_path):
    model = tiny_lora()
    keys_before = list(model.state_dict())
    apply_checkpointing(model, "auto", micro_batch=BATCH, seq_len=SEQ)
    assert list(model.state_dict()) == keys_before
    layer = find_decoder_layers(model)[1][0]
    assert type(layer).__name__ == "LlamaDecoderLayer" and layer._maximus_recompute in ("none", "selective", "full")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    model.save_pretrained(tmp_path)
    torch.manual_seed(0)
    fresh = LlamaForCausalLM(LlamaConfig(**SHAPES))
    loaded = PeftModel.from_pretrained(fresh, tmp_path)
    ours = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    theirs = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert ours.keys() == theirs.keys() and len(ours) == 42
    for k in ours:
        torch.testing.assert_close(theirs[k], ours[k], rtol=0, atol=0)
    remove_checkpointing(model)
    assert type(layer) is type(find_decoder_layers(fresh)[1][0]) and "_maximus_recompute" not in layer.__dict__


def test_eval_and_no_grad_run_the_layer_as_is():
    model = tiny_lora(dropout=0.0)
    ids = batch()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    apply_checkpointing(model, "full", micro_batch=BATCH, seq_len=SEQ)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=0)
    assert out.past_key_values.get_seq_length() == SEQ  # the cache still works in generation


@pytest.mark.parametrize("config_cls,model_cls", [(MistralConfig, MistralForCausalLM), (Qwen2Config, Qwen2ForCausalLM)])
def test_mistral_and_qwen2_selective_and_full(config_cls, model_cls):
    ref = loss_and_grads(tiny_lora(config_cls, model_cls))
    for policy in ("selective", "full"):
        model = tiny_lora(config_cls, model_cls)
        apply_checkpointing(model, policy, micro_batch=BATCH, seq_len=SEQ)
        assert_same(loss_and_grads(model), ref)


def test_qlora_4bit_base_with_adapters_only_trainable(tmp_path):
    from transformers import BitsAndBytesConfig

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPES)).save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    results = {}
    for policy in ("off", "selective", "full"):
        base = LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        model.train()
        assert not model.get_input_embeddings().weight.requires_grad  # frozen inputs: non-reentrant handles them
        report = apply_checkpointing(model, policy, micro_batch=BATCH, seq_len=SEQ)
        results[policy] = (loss_and_grads(model), report)
    layer = find_decoder_layers(model)[1][0]
    assert type(layer.self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    for policy in ("selective", "full"):
        assert_same(results[policy][0], results["off"][0])
    saved = {p: results[p][1].total_saved_bytes for p in results}
    assert saved["full"] < saved["selective"] < saved["off"]


# ---------------------------------------------------------------------------------------------
# Costs: the estimate against live memory


class _LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created under the mode and still alive (weights excluded)."""

    def __init__(self, model):
        super().__init__()
        self.live: dict[int, int] = {}
        self.weights = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live and key not in self.weights:
                    self.live[key] = storage.nbytes()
                    weakref.finalize(storage, self.live.pop, key, None)
        return out


def live_bytes_after_forward(policy, seq):
    model = tiny_lora(dropout=0.0)
    report = apply_checkpointing(model, policy, micro_batch=1, seq_len=seq)
    stack = find_decoder_layers(model)[0]
    stack.norm = torch.nn.Identity()  # the final norm's saved input is not a decoder layer's
    ids = torch.randint(0, SHAPES["vocab_size"], (1, seq))
    with _LiveBytes(model) as tracker:
        hidden = stack(input_ids=ids, use_cache=False).last_hidden_state
    return sum(tracker.live.values()) - hidden.untyped_storage().nbytes(), report


@pytest.mark.parametrize("policy", ["off", "selective", "full"])
def test_estimated_saved_bytes_match_live_memory(policy):
    # 96 tokens: outside the two probe lengths (32, 64), so the fit is tested, not just replayed.
    measured, report = live_bytes_after_forward(policy, 96)
    assert measured == pytest.approx(report.total_saved_bytes, rel=0.02)


def test_extrapolated_costs_scale_with_micro_batch_and_tokens():
    model = tiny_lora(dropout=0.0)
    one, step_one = measure_layer_costs(model, micro_batch=1, seq_len=64)
    four, step_four = measure_layer_costs(model, micro_batch=4, seq_len=64)
    assert [c.saved_bytes["full"] for c in four] == [4 * c.saved_bytes["full"] for c in one]
    assert step_four == pytest.approx(4 * step_one, rel=1e-6)
    # Full recompute replays the layer forward: 2 FLOPs per weight per token, plus attention.
    h, i, kv, r = 256, 512, 128, 4
    weights = h * h * 2 + h * kv * 2 + 3 * h * i
    lora = r * (h + h) * 2 + r * (h + kv) * 2 + r * (h + i) * 3
    attention = 4 * 64 * 64 * h
    assert one[1].recompute_flops["full"] == 2 * 64 * (weights + lora) + attention
    assert one[1].recompute_flops["selective"] == 2 * 64 * r * (2 * h + 2 * kv + 2 * i + h)


# ---------------------------------------------------------------------------------------------
# Choosing per layer


def cost(none, selective, full, sel_flops, full_flops):
    return LayerCost({"none": none, "selective": selective, "full": full},
                     {"none": 0, "selective": sel_flops, "full": full_flops})


LAYERS = [cost(100, 40, 10, 5, 100) for _ in range(4)]


def test_budget_picks_least_recompute_that_fits():
    assert choose_recompute_modes(LAYERS, budget_bytes=400) == ["none"] * 4
    assert choose_recompute_modes(LAYERS, budget_bytes=340) == ["selective", "none", "none", "none"]
    assert choose_recompute_modes(LAYERS, budget_bytes=160) == ["selective"] * 4
    assert choose_recompute_modes(LAYERS, budget_bytes=130) == ["full", "selective", "selective", "selective"]
    assert choose_recompute_modes(LAYERS, budget_bytes=40) == ["full"] * 4
    # With offload the layer input lives on the host: full layers cost nothing on the device.
    assert choose_recompute_modes(LAYERS, budget_bytes=90, offload_activations=True) == ["full", "selective", "selective", "selective"]


def test_budget_below_full_recompute_is_a_budget_error():
    with pytest.raises(BudgetError) as info:
        choose_recompute_modes(LAYERS, budget_bytes=39)  # full recompute keeps 4 x 10 bytes
    assert str(info.value) == (
        "activation budget 39 B is below the 40 B that recomputing every layer in full still needs "
        "(hint: lower training.micro_batch_size or training.seq_len, raise optimization.target_vram, "
        "or set optimization.offload.activations: on)")


def test_without_budget_minimise_memory_within_extra_time():
    # step 1000 FLOPs: 25 % = 250 allows all four selective (20) and two upgrades to full (95 each).
    assert choose_recompute_modes(LAYERS, step_flops=1000) == ["full", "full", "selective", "selective"]
    assert choose_recompute_modes(LAYERS, step_flops=100) == ["selective"] * 4
    assert choose_recompute_modes(LAYERS, step_flops=40) == ["selective", "selective", "none", "none"]
    assert choose_recompute_modes(LAYERS, step_flops=10) == ["none"] * 4
    # A selective that saves little per FLOP is skipped in favour of going straight to full.
    poor = [cost(100, 95, 10, 50, 60)] * 2
    assert choose_recompute_modes(poor, step_flops=480) == ["full", "full"]
    assert choose_recompute_modes(poor, step_flops=240) == ["full", "none"]


def test_auto_report_is_within_the_time_allowance_and_serialises():
    model = tiny_lora(dropout=0.0)
    report = apply_checkpointing(model, "auto", micro_batch=1, seq_len=256)
    data = report.to_dict()
    assert data["modes"] == report.modes and len(data["saved_bytes"]) == 3
    assert 0 < data["extra_time_fraction"] <= 0.25
    assert data["total_saved_bytes"] < data["saved_bytes_without_checkpointing"] / 2
    assert set(data) >= {"policy", "modes", "saved_bytes", "recompute_flops", "step_flops", "micro_batch", "seq_len"}


# ---------------------------------------------------------------------------------------------
# Errors


def test_user_errors_are_one_line_messages():
    model = tiny_lora()
    with pytest.raises(ConfigError) as info:
        apply_checkpointing(model, "sometimes")
    assert str(info.value) == ("gradient checkpointing: unknown policy 'sometimes' (hint: use none, full, selective, "
                               "auto, or a list with none/selective/full per layer)")
    with pytest.raises(ConfigError) as info:
        apply_checkpointing(model, ["full", "none"])
    assert str(info.value) == ("gradient checkpointing: the policy lists 2 modes for 3 decoder layers "
                               "(hint: give exactly one of none/selective/full per layer)")
    with pytest.raises(ModelError) as info:
        apply_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)), "full")
    assert str(info.value).startswith("gradient checkpointing: no decoder layer list found in Sequential")


@pytest.mark.parametrize("options", [dict(use_dora=True), dict(lora_dropout=0.1)], ids=["dora", "dropout"])
def test_costs_trace_a_bf16_model_with_a_trained_float32_embedding(options):
    """A bf16 base with float32 adapters and a trained float32 `embed_tokens` copy (as
    `maximus.models` loads `lora.modules_to_save` for `training.dtype: bf16`, PEFT's forward as with
    DoRA or dropout): the embedding's float32 output meets the bf16 linears, which the trainer's
    autocast allows. Tracing the layers' costs runs under the same autocast (it used to raise
    "expected m1 and m2 to have the same dtype")."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPES, "vocab_size": 8192})).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                             modules_to_save=["embed_tokens"], **options)).train()
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    costs, step_flops = measure_layer_costs(model, micro_batch=BATCH, seq_len=SEQ)
    assert len(costs) == 3 and step_flops > 0
    assert all(c.saved_bytes["none"] > c.saved_bytes["full"] > 0 for c in costs)
