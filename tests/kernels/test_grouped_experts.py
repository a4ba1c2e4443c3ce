"""Grouped expert forward (`maximus.kernels.grouped_experts`): the loss and every gradient (expert
adapters in LoRA, base weights in full fine-tuning) equal Transformers' eager experts forward in
float32, for Mixtral, Qwen3-MoE and gpt-oss; install / uninstall restore the library's forward;
disabled adapters take the library's path; `apply_kernels` installs it on CPU only."""
from __future__ import annotations

import pytest
import torch

import maximus.kernels.grouped_experts as grouped
from maximus.kernels.grouped_experts import install_grouped_experts, uninstall_grouped_experts

from tiny import build_family_model_dir, one_thread  # noqa: F401  (one_thread: a fixture, used through pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = ["mixtral", "qwen3_moe", "gpt_oss"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {t: build_family_model_dir(root / t, t) for t in MOE}


def _model(model_dir, method: str):
    """Transformers' eager experts forward; LoRA as Maximus puts it on the experts (PEFT
    `target_parameters`), with trained-looking adapters (B != 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from maximus.families import attention_implementation
    from maximus.models import expert_parameters

    config = AutoConfig.from_pretrained(model_dir)
    config.output_router_logits = True  # the router loss is in the loss: its gradient reaches the router input
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32, experts_implementation="eager",
                                                 attn_implementation=attention_implementation(config)[0])
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 target_parameters=expert_parameters(model)))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def _batch(seed: int = 0) -> dict:
    ids = torch.randint(3, 290, (2, 24), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _loss_and_grads(model, params):
    loss = model(**_batch()).loss
    return loss.detach(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("model_type", MOE)
def test_loss_and_gradients_equal_transformers_eager_experts(moe_dirs, model_type, method, path, monkeypatch):
    model = _model(moe_dirs[model_type], method)
    params = [p for p in model.parameters() if p.requires_grad]
    expert_params = [n for n, p in model.named_parameters() if p.requires_grad and ".experts." in n]
    assert expert_params, "the gradients checked include the experts'"
    theirs, their_grads = _loss_and_grads(model, params)

    calls, loops = [], []
    original, looped = grouped.grouped_experts, grouped._looped_rows
    monkeypatch.setattr(grouped, "grouped_experts", lambda *a, **k: calls.append(a[2]) or original(*a, **k))
    monkeypatch.setattr(grouped, "_looped_rows", lambda *a: loops.append(1) or looped(*a))
    if path == "loop":  # the shapes or dtype torch._grouped_mm does not take
        monkeypatch.setattr(grouped, "_grouped_mm_takes", lambda *a, **k: False)
    assert len(install_grouped_experts(model)) == 2  # both layers' experts
    ours, our_grads = _loss_and_grads(model, params)
    assert len(calls) == 2 and all(torch.unique(idx).numel() == 4 for idx in calls)  # every expert has tokens
    assert len(loops) == (2 if path == "loop" else 0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    for name, a, b in zip([n for n, p in model.named_parameters() if p.requires_grad], our_grads, their_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_uninstall_restores_the_library_forward_and_disabled_adapters_take_it(moe_dirs, model_type):
    model = _model(moe_dirs[model_type], "lora").eval()
    batch = _batch(1)
    with torch.no_grad():
        before = model(input_ids=batch["input_ids"]).logits
        with model.disable_adapter():
            base = model(input_ids=batch["input_ids"]).logits
        paths = install_grouped_experts(model)
        assert paths == [f"base_model.model.model.layers.{i}.mlp.experts" for i in range(2)]
        assert install_grouped_experts(model) == paths  # installing twice changes nothing
        ours = model(input_ids=batch["input_ids"]).logits
        with model.disable_adapter():  # PEFT's own path, bitwise
            assert torch.equal(model(input_ids=batch["input_ids"]).logits, base)
        assert uninstall_grouped_experts(model) == 2
        assert all("forward" not in m.__dict__ for m in model.modules())
        after = model(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(ours, before, rtol=0, atol=1e-5)
    assert torch.equal(after, before)


def test_apply_kernels_installs_it_on_cpu_unless_switched_off(moe_dirs):
    from maximus.kernels import apply_kernels
    from maximus.kernels.choices import KernelChoices, decide_kernels

    model = _model(moe_dirs["qwen3_moe"], "lora")
    notice = "notice: lean LoRA: the expert weights' adapters (PEFT target_parameters) run PEFT's own LoRA"
    off = apply_kernels(model, "eager", torch.device("cpu"), KernelChoices(lean_lora=True, grouped_experts=False))
    assert off.grouped_experts == 0 and notice in off.notices
    report = apply_kernels(model, "eager", torch.device("cpu"))
    assert report.grouped_experts == 2 and report.to_dict()["grouped_experts"] == 2 and notice not in report.notices
    decide = dict(lean_lora=True, lean_norm=True, grouped_experts=True)
    assert not decide_kernels(mode="eager", device_type="cuda", **decide).grouped_experts  # grouped_mm stays there
    assert not decide_kernels(mode="compile", device_type="cpu", **decide).grouped_experts


def test_clamped_swiglu_equals_gpt_oss_gate_at_and_beyond_its_limits(moe_dirs):
    from transformers import AutoModelForCausalLM

    experts = AutoModelForCausalLM.from_pretrained(moe_dirs["gpt_oss"]).model.layers[0].mlp.experts
    gate_up = torch.randn(40, 2 * experts.intermediate_size, generator=torch.Generator().manual_seed(0)) * 3 * experts.limit
    gate_up[0, :6] = torch.tensor([experts.limit, experts.limit, -experts.limit, -experts.limit, 0.0, 0.0])  # on the bounds
    gate_up.requires_grad_(True)
    grad = torch.randn(40, experts.intermediate_size, generator=torch.Generator().manual_seed(1))
    theirs = experts._apply_gate(gate_up)
    ours = grouped._gate(experts, gate_up, grouped._silu_gate(experts))
    assert ours.grad_fn.name().endswith("_ClampedSwiGLUBackward")
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours, gate_up, grad)[0], torch.autograd.grad(theirs, gate_up, grad)[0],
                               rtol=1e-6, atol=1e-6)
    wide = gate_up.detach()[1:].double().requires_grad_(True)  # off the bounds, where the gate is differentiable
    assert torch.autograd.gradcheck(lambda x: grouped._ClampedSwiGLU.apply(x, float(experts.alpha), float(experts.limit)),
                                    (wide,))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_silu_gate_equals_the_default_gate(moe_dirs, model_type):
    from transformers import AutoModelForCausalLM

    experts = AutoModelForCausalLM.from_pretrained(moe_dirs[model_type]).model.layers[0].mlp.experts
    assert grouped._silu_gate(experts)
    gate_up = (torch.randn(40, 2 * experts.intermediate_dim, generator=torch.Generator().manual_seed(0)) * 4).requires_grad_(True)
    grad = torch.randn(40, experts.intermediate_dim, generator=torch.Generator().manual_seed(1))
    theirs = experts._apply_gate(gate_up)
    ours = grouped._gate(experts, gate_up, True)
    assert ours.grad_fn.name().endswith("_SiluGateBackward")
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours, gate_up, grad)[0], torch.autograd.grad(theirs, gate_up, grad)[0],
                               rtol=1e-6, atol=1e-6)
    wide = gate_up.detach().double().requires_grad_(True)
    assert torch.autograd.gradcheck(grouped._SiluGate.apply, (wide,))


def test_combine_equals_weighted_index_add_and_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    tokens, k, hidden = 7, 2, 5
    # 12 of the 14 (token, slot) pairs routed (two sentinel slots), rows in expert order
    token = torch.tensor([0, 3, 5, 6, 1, 2, 3, 4, 0, 1, 2, 6])
    rows = torch.randn(12, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(12, generator=g, dtype=torch.float64, requires_grad=True)
    ours = grouped._Combine.apply(rows, weights, token, tokens)
    theirs = torch.zeros(tokens, hidden, dtype=torch.float64).index_add(0, token, rows * weights[:, None])
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[5], rows[2] * weights[2])  # a token with one routed row
    grad = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(ours, (rows, weights), grad), torch.autograd.grad(theirs, (rows, weights), grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda r, w: grouped._Combine.apply(r, w, token, tokens), (rows, weights))


def test_grouped_mm_takes_aligned_float_shapes_only():
    x = torch.zeros(3, 8)
    assert grouped._grouped_mm_takes(x, torch.zeros(2, 8, 4), sizes=(8, 4))
    assert not grouped._grouped_mm_takes(x, torch.zeros(2, 8, 6), sizes=(8, 6))  # 24 bytes: not a multiple of 16
    assert not grouped._grouped_mm_takes(x.double(), torch.zeros(2, 8, 4).double(), sizes=(8, 4))
    assert not grouped._grouped_mm_takes(x, torch.zeros(2, 8, 4, dtype=torch.bfloat16), sizes=(8, 4))
    assert grouped._grouped_mm_takes(x.bfloat16(), torch.zeros(2, 8, 8, dtype=torch.bfloat16), sizes=(8, 8))


def test_rank_up_equals_per_expert_products_with_an_empty_expert():
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 2]  # expert 1 has no rows
    rank, out, experts = 4, 8, len(counts)
    h = torch.randn(sum(counts), rank, generator=g, requires_grad=True)
    weight = torch.randn(out, rank * experts, generator=g, requires_grad=True)  # PEFT's rank-major lora_B
    b = weight.reshape(out, rank, experts).permute(2, 0, 1)  # [E, out, r], no unit stride in a matrix dimension
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    ours = grouped._RankUp.apply(h, b, offs)
    theirs = torch.cat([h_e @ b[e].T for e, h_e in enumerate(h.split(counts))])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    grad = torch.randn(ours.shape, generator=g)
    for a, c in zip(torch.autograd.grad(ours, (h, weight), grad), torch.autograd.grad(theirs, (h, weight), grad)):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-5)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        grouped._RankUp.apply(h, b, offs)
    assert {t.data_ptr() for t in kept} == {h.data_ptr(), weight.data_ptr(), offs.data_ptr()}  # no copy of B kept


def test_bf16_weights_with_float32_adapters_take_the_grouped_matmul(moe_dirs, monkeypatch):
    """PEFT keeps the adapters in float32 beside bf16 weights: the grouped path still runs (the
    factors cast to bf16 as in the loop) and equals the loop; no routed rows give zeros."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from maximus.models import expert_parameters

    model = AutoModelForCausalLM.from_pretrained(moe_dirs["mixtral"], dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"],  # r 8: 16 bytes in bf16
                                             target_parameters=expert_parameters(model)))
    lora = [p for n, p in model.named_parameters() if "lora_" in n and ".experts." in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    with torch.no_grad():
        for p in lora:
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    install_grouped_experts(model)
    loops = []
    looped = grouped._looped_rows
    monkeypatch.setattr(grouped, "_looped_rows", lambda *a: loops.append(1) or looped(*a))

    def loss_and_grads():
        loss = model(**_batch()).loss
        return [loss.detach()] + list(torch.autograd.grad(loss, lora))

    ours = loss_and_grads()
    assert loops == []
    monkeypatch.setattr(grouped, "_grouped_mm_takes", lambda *a, **k: False)
    theirs = loss_and_grads()
    assert loops == [1, 1]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    experts = grouped._innermost(model.base_model.model.model.layers[0].mlp.experts)
    none = grouped.grouped_experts(experts, torch.randn(3, experts.gate_up_proj.shape[-1], dtype=torch.bfloat16),
                                   torch.full((3, 2), experts.gate_up_proj.shape[0]), torch.rand(3, 2))
    assert torch.equal(none, torch.zeros(3, experts.gate_up_proj.shape[-1], dtype=torch.bfloat16))
