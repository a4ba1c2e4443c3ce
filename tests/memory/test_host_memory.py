"""Host memory of offloaded state: the estimate counts it, the planner checks it (issue 17's plans
offload every checkpointed layer input to the host)."""
import pytest

from maximus.errors import BudgetError
from maximus.memory.estimate import estimate_peak
from maximus.memory.planner import max_seq_len_for_budget, plan_for_budget, resolve_budget

EIGHT_B = "meta-llama/Llama-3.1-8B"
# Llama-3.1-8B, LoRA r=32 on the 7 linear layers of 32 decoder layers: r x (in + out) per projection.
IN_OUT = (4096 + 4096) + (4096 + 1024) * 2 + (4096 + 4096) + (4096 + 14336) * 3
ADAPTER_PARAMS = 32 * 32 * IN_OUT


def test_host_bytes_are_the_offloaded_layer_inputs_and_the_optimizer_state():
    seq = 1000
    acts_only = estimate_peak(EIGHT_B, method="qlora", lora_r=32, seq_len=seq, checkpointing="full",
                              offload_activations=True)
    # One bf16 hidden state per token per layer.
    assert acts_only.host_bytes == 32 * seq * 4096 * 2
    both = estimate_peak(EIGHT_B, method="qlora", lora_r=32, seq_len=seq, checkpointing="full",
                         offload_activations=True, offload_optimizer=True)
    # OffloadedAdamW: fp32 master + fp32 gradient buffer + two fp32 moments per adapter parameter.
    assert both.host_bytes == 32 * seq * 4096 * 2 + ADAPTER_PARAMS * 16
    assert estimate_peak(EIGHT_B, method="qlora", lora_r=32, seq_len=seq, checkpointing="full").host_bytes == 0
    assert both.to_dict()["host_bytes"] == both.host_bytes


def test_the_planner_keeps_offloaded_state_within_the_host_memory():
    budget = resolve_budget("16GB")
    unchecked = max_seq_len_for_budget(EIGHT_B, budget, method="qlora", lora_r=32)
    plan = plan_for_budget(EIGHT_B, budget, method="qlora", lora_r=32, batch_size=1, seq_len=unchecked)
    assert plan.offload_activations and plan.host_bytes > 16 * 2**30
    assert ("host memory", f"{plan.host_bytes / 2**30:.2f} GiB for offloaded state: not checked against this "
                           "machine's RAM") in plan.rows()
    # With 16 GB of host RAM the longest context shrinks, and its plan fits the host.
    host = int(16e9)
    checked = max_seq_len_for_budget(EIGHT_B, budget, method="qlora", lora_r=32, host_budget_bytes=host)
    assert 0 < checked < unchecked
    fitted = plan_for_budget(EIGHT_B, budget, method="qlora", lora_r=32, batch_size=1, seq_len=checked,
                             host_budget_bytes=host)
    assert fitted.host_bytes <= host and fitted.host_budget_bytes == host
    assert ("host memory", f"{fitted.host_bytes / 2**30:.2f} GiB for offloaded state of 14.90 GiB available") \
        in fitted.rows()


def test_a_plan_that_needs_more_host_memory_is_refused_with_both_figures():
    seq, host = 75488, int(8e9)
    needed = 32 * seq * 4096 * 2  # the least host-hungry plan that fits the card: every layer input on the host
    longest = max_seq_len_for_budget(EIGHT_B, resolve_budget("16GB"), method="qlora", lora_r=32, host_budget_bytes=host)
    with pytest.raises(BudgetError) as err:
        plan_for_budget(EIGHT_B, resolve_budget("16GB"), method="qlora", lora_r=32, batch_size=1, seq_len=seq,
                        host_budget_bytes=host)
    message = str(err.value)
    assert message.startswith("nothing fits in 14.90 GiB: the smallest plan needs ")
    assert (f"; the longest sequence that fits is {longest:,} tokens at micro-batch 1; plans that offload more would "
            f"fit but need {needed / 2**30:.2f} GiB of host memory, {host / 2**30:.2f} GiB available") in message
    assert message.endswith("(hint: raise target_vram or lower training.seq_len)")


def test_every_plan_over_the_host_memory_is_a_budget_error_naming_it():
    with pytest.raises(BudgetError) as err:
        plan_for_budget(EIGHT_B, resolve_budget("16GB"), method="qlora", lora_r=32, batch_size=1, seq_len=4096,
                        offload_optimizer="on", host_budget_bytes=2**20)
    assert str(err.value) == (
        "every plan that fits needs more host memory than the 1.00 MiB available for offloaded state (the least: "
        f"{ADAPTER_PARAMS * 16 / 2**30:.2f} GiB) (hint: free host RAM, lower training.seq_len, or raise target_vram "
        "so less is offloaded)")


def test_plan_run_checks_the_host_only_for_a_gpu_of_this_machine(monkeypatch):
    import psutil
    import torch

    from maximus.memory.spec_from_config import HOST_OFFLOAD_SHARE, host_for_offload

    assert host_for_offload("cpu") is None
    if not torch.cuda.is_available():
        assert host_for_offload("cuda") is None  # `maximus plan` for a card on a machine without it
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only to reach the branch: no CUDA call follows
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    expected = psutil.virtual_memory().available // 2 * HOST_OFFLOAD_SHARE
    assert host_for_offload("cuda") == pytest.approx(expected, rel=0.05)
