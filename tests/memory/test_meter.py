"""MemoryMeter on CPU: exact byte counts for known allocations, categories of a real model."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from maximus.memory import MemoryMeter, measure_step_peak


def test_known_allocation_raises_current_and_peak_by_its_bytes():
    meter = MemoryMeter("cpu")
    with meter.track():
        base = meter.current_bytes()
        x = torch.empty(1000, dtype=torch.float32)
        assert meter.current_bytes() - base == 4000
        assert meter.peak_bytes() - base == 4000
        y = torch.empty(250, dtype=torch.bfloat16)
        assert meter.current_bytes() - base == 4500
        del x
        # freeing lowers current, not peak
        assert meter.current_bytes() - base == 500
        assert meter.peak_bytes() - base == 4500
        meter.reset_peak()
        assert meter.peak_bytes() == meter.current_bytes()
        del y
    assert meter.current_bytes() == base


def test_views_and_inplace_ops_are_not_counted_twice():
    meter = MemoryMeter("cpu")
    with meter.track():
        a = torch.zeros(64, 64)
        a.add_(1.0)
        v = a.view(-1)[:10]
        t = a.t()
        assert meter.current_bytes() == 64 * 64 * 4
        b = a * 2  # a new tensor
        assert meter.current_bytes() == 2 * 64 * 64 * 4
        del a, v, t, b


def test_peak_follows_the_sequence_of_allocations():
    meter = MemoryMeter("cpu")
    with meter.track():
        a = torch.empty(1000)          # 4000
        b = a * 2                      # 8000
        del a                          # 4000
        c = torch.empty(3000)          # 16000 -> the peak
        del b, c
    assert meter.peak_bytes() == 16000
    assert meter.current_bytes() == 0


def test_storage_freed_after_tracking_stops_is_still_subtracted():
    meter = MemoryMeter("cpu")
    with meter.track():
        keep = torch.empty(256, dtype=torch.float64)
    assert meter.current_bytes() == 2048
    del keep
    assert meter.current_bytes() == 0


def test_over_budget_bytes_is_how_far_the_peak_passed_the_budget():
    meter = MemoryMeter("cpu", budget_bytes=1000)
    with meter.track():
        keep = torch.empty(256, dtype=torch.float64)  # 2048 bytes
    assert meter.over_budget_bytes() == 1048
    meter.budget_bytes = 4096
    assert meter.over_budget_bytes() == 0
    meter.budget_bytes = None
    assert meter.over_budget_bytes() == 0
    del keep


def _tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def test_breakdown_of_a_tiny_model_matches_tensor_sizes():
    model = _tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (2, 16))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    peak, meter = measure_step_peak(step, model, optimizer)
    parts = meter.breakdown(model, optimizer)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert parts["parameters"] == param_bytes + buffer_bytes
    assert parts["gradients"] == param_bytes  # fp32 grads, one per parameter
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    assert parts["optimizer_state"] == state_bytes
    assert parts["peak"] == peak
    assert parts["activations"] == peak - parts["parameters"] - parts["gradients"] - parts["optimizer_state"]
    assert parts["activations"] > 0
    # everything live now is exactly what the model and optimizer hold
    assert parts["current"] == param_bytes + buffer_bytes + param_bytes + state_bytes


def test_step_peak_exceeds_the_logits_it_must_hold():
    model = _tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (4, 64))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    peak, meter = measure_step_peak(step, model, optimizer)
    logits_bytes = 4 * 64 * 512 * 4
    static = meter.breakdown(model, optimizer)
    # the float32 logits and their log-softmax coexist at the loss
    assert peak >= static["parameters"] + static["optimizer_state"] + 2 * logits_bytes


def test_views_detaches_and_in_place_ops_are_skipped_by_schema_but_lifted_tensors_count():
    from maximus.memory.meter import _returns_alias

    aten = torch.ops.aten
    assert [_returns_alias(f) for f in (aten.view.default, aten.detach.default, aten.t.default, aten.add_.Tensor,
                                        aten.split.Tensor)] == [True] * 5
    assert [_returns_alias(f) for f in (aten.mm.default, aten._to_copy.default, aten.lift_fresh.default)] == [False] * 3
    meter = MemoryMeter("cpu")
    with meter.track():
        a = torch.tensor([1.0, 2.0, 3.0])  # made outside the dispatcher, reaches it through lift_fresh
        d = a.detach()
        assert meter.current_bytes() == 12
        del a, d
    assert meter.current_bytes() == 0
