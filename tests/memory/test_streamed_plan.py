"""The planner streams frozen weights (`optimization.offload.params: auto`) only when nothing else
fits, counts what streaming costs (layers in flight on the device, the host memory or the disk
that holds the layers, the copies per step against the card's host-to-device rate), and plans a
70B-class QLoRA run for a 16 GB card."""
from __future__ import annotations

import pytest

from maximus.config import GPU_CARDS
from maximus.errors import BudgetError
from maximus.memory.estimate import estimate_peak
from maximus.memory.shape import load_model_config, model_shape
from maximus.plan_command import CARD_TFLOPS, card_tokens_per_s
from maximus.memory.planner import DEFAULT_MARGIN, plan_for_budget, resolve_budget
from maximus.memory.streamed_weights import streamed_layer_bytes
from maximus.memory.coefficients import DEVICE_FLOPS

SEVENTY_B = "meta-llama/Llama-3.1-70B"
SIXTEEN_GB = resolve_budget("16GB")
GIB = 2**30


def _plan(model: str, budget: int, **kw):
    return plan_for_budget(model, budget, method="qlora", seq_len=2048, **kw)


def test_auto_streams_only_when_no_other_plan_fits():
    eight_b = _plan("meta-llama/Llama-3.1-8B", SIXTEEN_GB, offload_params="auto")
    assert not eight_b.offload_params and eight_b.streamed_bytes_per_step == 0
    with pytest.raises(BudgetError):  # every cheaper lever: recompute, offload, tiles, micro-batch 1
        _plan(SEVENTY_B, SIXTEEN_GB, offload_params="off")
    plan = _plan(SEVENTY_B, SIXTEEN_GB, offload_params="auto")
    assert plan.offload_params and plan.params_store == "host" and plan.micro_batch_size == 1
    assert plan.peak_bytes <= SIXTEEN_GB * (1 - DEFAULT_MARGIN)
    shape = model_shape(load_model_config(SEVENTY_B))
    layer = streamed_layer_bytes(shape, "qlora", 2)
    # Every layer in host memory; three in flight on the device; each copied twice a micro-step but the ends;
    # and the embedding's rows of the micro-step's 2,048 tokens (its table is in host memory too).
    assert plan.host_bytes >= 80 * layer + shape.embedding_params * 2 and plan.disk_bytes == 0
    assert plan.streamed_bytes_per_step == 2 * 79 * layer + 2048 * shape.hidden_size * 2
    assert "frozen weights" in dict(plan.rows())["offload"]


def test_a_host_too_small_for_the_layers_streams_them_from_disk():
    plan = _plan(SEVENTY_B, SIXTEEN_GB, offload_params="auto", host_budget_bytes=8 * GIB)
    shape = model_shape(load_model_config(SEVENTY_B))
    assert plan.params_store == "disk" and plan.disk_bytes == 80 * streamed_layer_bytes(shape, "qlora", 2)
    assert plan.host_bytes <= 8 * GIB
    assert dict(plan.rows())["disk"] == f"{plan.disk_bytes / GIB:.2f} GiB for the streamed layers (a file under the cache)"


def test_a_budget_streaming_cannot_meet_names_the_smallest_streamed_plan():
    with pytest.raises(BudgetError) as err:
        _plan(SEVENTY_B, resolve_budget("2GB"), offload_params="auto")
    assert err.value.message.startswith("nothing fits in 1.86 GiB: the smallest plan needs ")
    assert "frozen weights streamed from host memory)" in err.value.message


def test_full_fine_tuning_streams_nothing_and_says_so():
    e = estimate_peak(SEVENTY_B, method="full", offload_params=True, device="cuda")
    assert "offload.params streams frozen weights only: full fine-tuning has none" in e.notes
    assert e.streamed_bytes_per_step == 0


@pytest.mark.parametrize("model", [SEVENTY_B, "Qwen/Qwen2.5-72B", "mistralai/Mistral-Large-Instruct-2407"])
def test_70b_class_qlora_fits_the_16gb_cards_with_tokens_per_second(model):
    """`maximus plan --model M --method qlora --seq 2048 --budget 16GB` and its card table: every
    card from the T4 up fits by streaming; the step is compute- or transfer-bound by the card's
    own compute and host-to-device rate."""
    plan = _plan(model, SIXTEEN_GB, offload_params="auto")
    assert plan.offload_params and plan.peak_bytes <= 16e9
    for card in ("T4", "L4", "A10", "RTX3090", "RTX4090", "A100-40GB") if model == SEVENTY_B else ("T4",):
        memory, _, h2d = GPU_CARDS[card]
        fitted = _plan(model, memory, offload_params="auto")
        scale = CARD_TFLOPS[card] * 1e12 / DEVICE_FLOPS["cuda"]
        speed, bound = card_tokens_per_s(fitted, scale, h2d)
        compute = fitted.compute_tokens_per_s * scale
        transfer = 2048 / (fitted.streamed_bytes_per_step / h2d)
        assert speed == pytest.approx(min(compute, transfer)) and speed > 0
        assert bound == ("transfer" if transfer < compute else "compute")


def test_a_slow_link_makes_a_step_transfer_bound():
    plan = _plan(SEVENTY_B, SIXTEEN_GB, offload_params="auto")
    scale = CARD_TFLOPS["H100"] * 1e12 / DEVICE_FLOPS["cuda"]
    assert card_tokens_per_s(plan, scale, 50e9)[1] == "compute"
    speed, bound = card_tokens_per_s(plan, scale, 1e9)  # a 1 GB/s link
    assert bound == "transfer" and speed == pytest.approx(2048 / (plan.streamed_bytes_per_step / 1e9))
