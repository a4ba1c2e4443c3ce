"""The planner: budgets respected, effective batch kept, errors word for word, `maximus plan`,
and a real CPU run of the chosen plan staying under its budget."""
import io
import json
from contextlib import redirect_stdout

import psutil
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from maximus.config import GPU_CARDS
from maximus.errors import BudgetError, ConfigError
from maximus.evaluate import autocast_for
from maximus.memory import MemoryMeter, estimate_peak, max_seq_len_for_budget, plan_for_budget, resolve_budget
from maximus.plan_command import plan_main

EIGHT_B = "meta-llama/Llama-3.1-8B"
GiB = 2**30


@pytest.mark.parametrize("budget_gib", [8, 12, 16, 24, 40, 80])
def test_plan_fits_the_budget_with_margin_and_keeps_the_effective_batch(budget_gib):
    plan = plan_for_budget(EIGHT_B, budget_gib * GiB, method="auto", batch_size=8, seq_len=2048)
    assert plan.peak_bytes <= budget_gib * GiB * 0.9
    assert plan.micro_batch_size * plan.grad_accum == 8
    assert plan.margin_bytes == int(budget_gib * GiB * 0.1)
    # the plan's peak is what the estimator predicts for exactly these settings
    again = estimate_peak(EIGHT_B, method=plan.method, micro_batch=plan.micro_batch_size, seq_len=2048,
                          grad_accum=plan.grad_accum,
                          checkpointing=list(plan.recompute), offload_activations=plan.offload_activations,
                          offload_optimizer=plan.offload_optimizer, loss_chunk_tokens=plan.loss_chunk_size,
                          tile_tokens=plan.tile_tokens, lean_lora=True)  # the planner plans Maximus' lean LoRA
    assert again.peak_bytes == plan.peak_bytes


def test_more_budget_never_gives_a_slower_plan():
    speeds = [plan_for_budget(EIGHT_B, g * GiB, method="auto", batch_size=8, seq_len=2048, world_size=2).tokens_per_s_guess
              for g in (8, 12, 16, 24, 40, 80)]
    assert speeds == sorted(speeds)


def test_auto_method_uses_qlora_when_tight_and_lora_when_roomy():
    assert plan_for_budget(EIGHT_B, 16 * GiB, method="auto", batch_size=8, seq_len=2048).method == "qlora"
    # full fine-tuning of 8B needs > 120 GiB for weights, grads and AdamW state: LoRA it is
    assert plan_for_budget(EIGHT_B, 80 * GiB, method="auto", batch_size=8, seq_len=2048).method == "lora"


def test_fixed_settings_are_honoured():
    plan = plan_for_budget(EIGHT_B, 80 * GiB, method="qlora", batch_size=8, seq_len=2048, micro_batch_size=2,
                           gradient_checkpointing="full", offload_activations="off", loss_chunk_size=256)
    assert (plan.micro_batch_size, plan.grad_accum, plan.recompute) == (2, 4, ("full",) * 32)
    assert (plan.offload_activations, plan.loss_chunk_size) == (False, 256)


def test_partial_checkpointing_picks_the_fewest_layers_that_fit():
    allow = {"checkpointing", "loss_chunk"}  # no selective, no offload: off / k layers / full
    off = estimate_peak(EIGHT_B, method="qlora", micro_batch=4, seq_len=2048, checkpointing="off")
    full = estimate_peak(EIGHT_B, method="qlora", micro_batch=4, seq_len=2048, checkpointing="full")
    budget = int((full.peak_bytes + off.peak_bytes) / 2 / 0.9)
    plan = plan_for_budget(EIGHT_B, budget, method="qlora", batch_size=4, seq_len=2048, micro_batch_size=4, allow=allow)
    k = plan.recompute.count("full")
    assert 0 < k < 32 and plan.recompute == ("full",) * k + ("none",) * (32 - k)
    assert plan.checkpointing_label == f"full {k}/32 layers"
    fewer = estimate_peak(EIGHT_B, method="qlora", micro_batch=4, seq_len=2048, checkpointing=k - 1,
                          loss_chunk_tokens=plan.loss_chunk_size)
    assert fewer.peak_bytes > budget * 0.9 >= plan.peak_bytes


def test_nothing_fits_names_the_smallest_budget_word_for_word():
    with pytest.raises(BudgetError) as err:
        plan_for_budget(EIGHT_B, 4 * GiB, method="qlora", batch_size=2, seq_len=2048)
    assert str(err.value) == (
        "nothing fits in 4.00 GiB: the smallest plan needs 6.67 GiB (qlora, micro_batch 1, full checkpointing, "
        "activation offload, optimizer offload, MLP tiles of 256 tokens, seq 2048); not even one token fits (hint: "
        "raise target_vram or lower training.seq_len)")
    with pytest.raises(BudgetError) as err:
        plan_for_budget(EIGHT_B, 8 * GiB, method="lora", batch_size=2, seq_len=2048, allow={"checkpointing"})
    assert str(err.value) == (
        "nothing fits in 8.00 GiB: the smallest plan needs 19.49 GiB (lora, micro_batch 2, full checkpointing, "
        "seq 2048); not even one token fits (hint: raise target_vram, lower training.seq_len, or use method: qlora)")
    # the smallest budget named really is enough
    plan_for_budget(EIGHT_B, int(19.50 * GiB), method="lora", batch_size=2, seq_len=2048, allow={"checkpointing"})


def test_batch_must_split_over_ranks():
    with pytest.raises(ConfigError) as err:
        plan_for_budget(EIGHT_B, 80 * GiB, method="qlora", batch_size=6, world_size=4)
    assert str(err.value) == ("training.batch_size 6 is not a multiple of the 4 ranks "
                              "(hint: use a batch_size divisible by 4)")


def test_plan_to_dict_and_table():
    plan = plan_for_budget(EIGHT_B, 16 * GiB, method="qlora", batch_size=4, seq_len=2048)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["peak_bytes"] == plan.peak_bytes and d["effective_batch"] == 4
    assert set(d["breakdown"]) == {"weights", "adapters", "gradients", "optimizer", "activations", "loss", "workspace"}
    labels = [line.split("  ")[0] for line in plan.text().splitlines()]
    for row in ("weights", "adapters", "gradients", "optimizer", "activations", "loss", "margin", "predicted peak"):
        assert row in labels
    assert plan.table().row_count == len(labels)


def test_no_budget_gives_the_fastest_plan():
    plan = plan_for_budget(EIGHT_B, None, method="qlora", batch_size=8, seq_len=2048)
    assert plan.budget_bytes is None and plan.micro_batch_size == 8 and plan.recompute == ("none",) * 32


def test_resolve_budget():
    assert resolve_budget("16GB") == 16 * 10**9
    assert resolve_budget("24 GiB") == 24 * GiB
    assert resolve_budget("T4") == GPU_CARDS["T4"][0]
    assert resolve_budget(12345) == 12345
    assert resolve_budget(None) is None
    auto = resolve_budget("auto", "cpu")
    assert abs(auto - psutil.virtual_memory().available) < 2 * GiB


def test_max_seq_len_is_the_boundary():
    seq = max_seq_len_for_budget(EIGHT_B, 16 * 10**9, method="qlora", lora_r=32)
    assert seq > 2048
    kw = dict(method="qlora", batch_size=1, micro_batch_size=1, lora_r=32)
    plan_for_budget(EIGHT_B, 16 * 10**9, seq_len=seq, **kw)
    with pytest.raises(BudgetError):
        plan_for_budget(EIGHT_B, 16 * 10**9, seq_len=seq + 1, **kw)
    assert max_seq_len_for_budget(EIGHT_B, 24 * 10**9, method="qlora", lora_r=32) > seq
    assert max_seq_len_for_budget(EIGHT_B, 10**9, method="qlora") == 0


@pytest.mark.parametrize("settings", [dict(method="qlora", tile_tokens="off", host_budget_bytes=int(8e9)),
                                      dict(method="qlora", gradient_checkpointing="off", loss_chunk_size=128),
                                      dict(method="lora", offload_optimizer="on", micro_batch=2)])
def test_max_seq_len_is_the_boundary_with_fixed_settings_and_a_host_budget(settings):
    """The search stops a probe at the first plan that fits; its answer is still the planner's."""
    seq = max_seq_len_for_budget(EIGHT_B, 24 * 10**9, lora_r=32, **settings)
    mb = settings.pop("micro_batch", 1)
    kw = dict(batch_size=mb, micro_batch_size=mb, lora_r=32, **settings)
    assert seq > 0
    plan_for_budget(EIGHT_B, 24 * 10**9, seq_len=seq, **kw)
    with pytest.raises(BudgetError):
        plan_for_budget(EIGHT_B, 24 * 10**9, seq_len=seq + 1, **kw)


# -- maximus plan ------------------------------------------------------------------------------------


def _run_plan(argv):
    out = io.StringIO()
    with redirect_stdout(out):
        assert plan_main(argv) == 0
    return out.getvalue()


def test_plan_command_json():
    report = json.loads(_run_plan(["--model", EIGHT_B, "--method", "qlora", "--seq", "2048", "--batch", "2", "--json"]))
    expected = estimate_peak(EIGHT_B, method="qlora", micro_batch=2, seq_len=2048, checkpointing="full",
                             lean_lora=True)  # the run as Maximus executes it: lean LoRA projections
    assert report["peak_bytes"] == expected.peak_bytes
    assert [c["card"] for c in report["cards"]] == list(GPU_CARDS)
    fitting = [c for c in report["cards"] if c["fits"]]
    assert report["cheapest_card"] == min(fitting, key=lambda c: c["price_per_hour"])["card"]
    for c in fitting:
        assert c["plan"]["peak_bytes"] <= c["memory_bytes"]


def test_plan_command_reads_the_article_config(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text('model: "mistralai/Mistral-12B-v0.1"\ndataset: "my_dataset"\noptimization:\n  target_vram: 16GB\n'
                   "  use_ghost_logit: true\n  kronecker_sketching: true\ntraining:\n  batch_size: 4\n  epochs: 3\n")
    report = json.loads(_run_plan(["--config", str(cfg), "--json"]))
    assert report["settings"]["loss_mode"] == "ghost" and report["settings"]["batch_size"] == 4
    assert report["budget"]["budget_bytes"] == 16 * 10**9 and report["budget"]["fits"]
    text = _run_plan(["--config", str(cfg), "--method", "qlora"])
    assert "cheapest card that fits" in text


def test_plan_command_needs_a_model():
    with pytest.raises(ConfigError) as err:
        plan_main(["--seq", "1024"])
    assert str(err.value) == ("maximus plan needs --model or --config (hint: e.g. maximus plan --model "
                              "meta-llama/Llama-3.1-8B --method qlora --seq 2048 --batch 2)")


# -- a real run of the plan on CPU -------------------------------------------------------------------


def test_real_run_of_the_plan_stays_under_budget_and_uses_it():
    """In float32: the planner's arithmetic is the same at every dtype, and CPUs without bf16
    matmuls (AVX2) run bf16 tens of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    batch, seq = 4, 256
    allow = {"checkpointing", "micro_batch", "loss_chunk"}  # what plain Transformers can execute
    smallest = estimate_peak(config, method="lora", micro_batch=1, seq_len=seq, checkpointing="full",
                             loss_chunk_tokens=64, device="cpu", dtype="fp32").peak_bytes
    for budget in (int(smallest / 0.9 * 1.3), int(smallest / 0.9 * 3)):
        plan = plan_for_budget(config, budget, method="lora", batch_size=batch, seq_len=seq, allow=allow, device="cpu",
                               dtype="fp32", lean_lora=False)  # _run executes PEFT's own LoRA layers
        measured = _run(config, plan, batch, seq)
        assert measured <= budget
        assert measured >= 0.6 * budget  # the plan grows into the budget it has
    torch.set_num_threads(before)


def _run(config, plan, batch, seq):
    from maximus.losses.linear_cross_entropy import linear_cross_entropy

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=16, target_modules="all-linear"))
    lm = model.get_base_model()
    assert "selective" not in plan.recompute  # not in `allow`: plain Transformers runs none / full per layer
    if "full" in plan.recompute:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer, mode in zip(lm.model.layers, plan.recompute):
            layer.gradient_checkpointing = mode == "full"
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    data = torch.randint(0, config.vocab_size, (batch, seq))
    meter = MemoryMeter("cpu")

    def step():
        for i in range(plan.grad_accum):
            ids = data[i * plan.micro_batch_size:(i + 1) * plan.micro_batch_size]
            with autocast_for(torch.device("cpu"), torch.float32):  # as the trainer runs an fp32 step: none
                hidden = lm.model(input_ids=ids).last_hidden_state
                loss = linear_cross_entropy(hidden[:, :-1], lm.lm_head.weight, ids[:, 1:],
                                            chunk_size=plan.loss_chunk_size)
            (loss / plan.grad_accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        with meter.track(model, optimizer):
            step()
    return meter.peak_bytes()


def test_planned_loss_chunk_is_the_one_the_loss_would_pick():
    """Full fine-tuning trains the head, whose chunks have a 512-token floor; adapters keep the
    frozen-head default. The plan (which the trainer passes to the loss) and the estimate agree
    with the loss module, so a budgeted full run is not forced onto small chunks."""
    from maximus.losses.linear_cross_entropy import default_chunk_size

    full = plan_for_budget(EIGHT_B, None, method="full", batch_size=1, seq_len=2048)
    lora = plan_for_budget(EIGHT_B, None, method="lora", batch_size=1, seq_len=2048)
    assert full.loss_chunk_size == default_chunk_size(2048, 128256, 2, trainable_head=True) == 512
    assert lora.loss_chunk_size == default_chunk_size(2048, 128256, 2) == 256
    # the estimate without an explicit chunk counts the same chunk as with it
    for method, chunk in (("full", 512), ("lora", 256)):
        implicit = estimate_peak(EIGHT_B, method=method, seq_len=2048)
        explicit = estimate_peak(EIGHT_B, method=method, seq_len=2048, loss_chunk_tokens=chunk)
        assert implicit.breakdown == explicit.breakdown


#: The benchmark reference model (docs/benchmarks/reference.md: 128k vocabulary, hidden 512, 8 layers).
REFERENCE = dict(model_type="llama", vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)


def test_free_memory_default_recomputes_nothing_when_the_activations_fit():
    # The case: QLoRA r=16, seq 2048, batch 1, fp32 on a CPU with ~20 GB free. The
    # activations of all 8 layers fit many times over, so `auto` keeps them all.
    plan = plan_for_budget(REFERENCE, 20 * 10**9, method="qlora", batch_size=1, seq_len=2048, dtype="fp32",
                           device="cpu", free_memory=True)
    assert plan.recompute == ("none",) * 8
    assert (plan.offload_activations, plan.offload_optimizer) == (False, False)  # a CPU's host is its device
    assert plan.notes[-1] == "no target_vram: fitted to the 18.63 GiB of free memory"
    # Less free memory: only as many layers recompute as that memory requires.
    off = estimate_peak(REFERENCE, method="qlora", dtype="fp32", seq_len=2048, checkpointing="off", device="cpu",
                        loss_chunk_tokens=plan.loss_chunk_size, lean_lora=True)  # as the planner plans it
    tight = int(off.peak_bytes * 0.8 / 0.9)
    partial = plan_for_budget(REFERENCE, tight, method="qlora", batch_size=1, seq_len=2048, dtype="fp32",
                              device="cpu", free_memory=True)
    assert partial.recompute == ("full",) + ("none",) * 7 and partial.peak_bytes <= tight * 0.9
    assert partial.checkpointing_label == "full 1/8 layers"  # one layer replayed: the least recompute that fits


def test_free_memory_that_fits_nothing_runs_the_smallest_plan_with_a_note():
    with pytest.raises(BudgetError):
        plan_for_budget(REFERENCE, 10**8, method="qlora", batch_size=1, seq_len=2048, dtype="fp32", device="cpu")
    plan = plan_for_budget(REFERENCE, 10**8, method="qlora", batch_size=1, seq_len=2048, dtype="fp32", device="cpu",
                           free_memory=True)
    # the smallest plan tiles the MLP recompute as finely as the planner goes; backward then no longer
    # dominates, so the loss chunk shrinks too
    assert plan.recompute == ("full",) * 8 and plan.tile_tokens == 256 and plan.loss_chunk_size == 64
    assert plan.notes[-1] == ("no plan fits the 95.37 MiB of free memory; running the smallest (qlora, micro_batch 1, "
                              "full checkpointing, MLP tiles of 256 tokens, seq 2048)")
